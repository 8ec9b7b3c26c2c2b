"""Pipeline-parallel plumbing: placeholders for the layers another stage holds, and the
point-to-point transfers of hidden states between stages (torch.distributed send/recv)."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn


class PipelineGap(nn.Module):
    """Stands where another pipeline stage's layer (or embedding, or norm) would be. It has no
    parameters, so the layer numbering of checkpoint names is kept."""

    def forward(self, *args: object, **kwargs: object) -> None:
        raise RuntimeError("this part of the model lives on another pipeline stage")


def send_hidden(hidden: torch.Tensor, dst: int) -> None:
    dist.send(hidden.contiguous(), dst)


def recv_hidden(shape: tuple[int, ...] | torch.Size, dtype: torch.dtype, device: torch.device,
                src: int) -> torch.Tensor:
    buffer = torch.empty(tuple(shape), dtype=dtype, device=device)
    dist.recv(buffer, src)
    return buffer
