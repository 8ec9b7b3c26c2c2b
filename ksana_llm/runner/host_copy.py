"""Copies from the device to the host that do not wait for the device.

`start_host_copy(t)` queues the copy and returns at once: on CUDA into pinned memory, behind an
event, so work queued after it (the next step's forward) does not delay reading it; `wait()`
blocks until that copy, and only that copy, is done. On a CPU the tensor is already there.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

__all__ = ["HostCopy", "copies_done", "host_buffer", "start_host_copy"]


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
    host = host_buffer(tensor.shape, tensor)
    host.copy_(tensor, non_blocking=True)
    return copies_done(host, tensor.device)


def host_buffer(shape: tuple[int, ...] | torch.Size, like: torch.Tensor) -> torch.Tensor:
    """An uninitialised host tensor of `like`'s dtype to copy parts of device tensors into with
    `copy_(..., non_blocking=True)`: pinned when `like` is on CUDA (a copy into pageable memory
    would wait for the device)."""
    return torch.empty(shape, dtype=like.dtype, pin_memory=like.device.type == "cuda")


def copies_done(host: torch.Tensor, device: torch.device) -> HostCopy:
    """`host`, valid once the copies into it queued so far on `device`'s current stream are."""
    if device.type != "cuda":
        return HostCopy(host, None)
    copied = torch.cuda.Event()
    copied.record(torch.cuda.current_stream(device))  # the copies' stream, any device
    return HostCopy(host, copied)
