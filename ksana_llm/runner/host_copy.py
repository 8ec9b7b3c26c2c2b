"""Copies from the device to the host that do not wait for the device.

`start_host_copy(t)` queues the copy and returns at once: on CUDA into pinned memory, behind an
event, so work queued after it (the next step's forward) does not delay reading it; `wait()`
blocks until that copy, and only that copy, is done. On a CPU the tensor is already there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostCopy", "start_host_copy"]


@dataclass(frozen=True)
class HostCopy:
    tensor: torch.Tensor  # on the host; its contents are valid once `wait` returns
    copied: Any  # torch.cuda.Event recorded after the copy, or None (already on the host)

    def wait(self) -> torch.Tensor:
        if self.copied is not None:
            self.copied.synchronize()
        return self.tensor


def start_host_copy(tensor: torch.Tensor) -> HostCopy:
    if tensor.device.type != "cuda":
        return HostCopy(tensor, None)
    host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    host.copy_(tensor, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(tensor.device))  # the copy's stream, any device
    return HostCopy(host, copied)
