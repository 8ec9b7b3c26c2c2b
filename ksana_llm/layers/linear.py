"""Linear layers that know how to load checkpoint tensors, including fused (merged) ones."""

from __future__ import annotations

import logging
import os

import torch
from torch import nn

from ksana_llm.layers.lora import LoraBatch

logger = logging.getLogger("ksana_llm.model")


def prepack_cpu_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """oneDNN's blocked copy of a float32 CPU weight, or None where it does not apply.

    Measured on the 2-core AVX2 CI machine with SmolLM2's shapes: 1.05-1.8x faster than
    `F.linear` (MKL) from 1 to 1,024 rows, and 1.2-2x for the 49152-row LM head. The price is a
    second copy of the weight, which is why only CPU float32 weights get one.
    """
    if weight.device.type != "cpu" or weight.dtype != torch.float32 \
            or not torch.backends.mkldnn.is_available():
        return None
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach())


# "1" / "0": prepack CPU float32 weights always / never; unset: when they fit (see below).
PREPACK_ENV_VAR = "KSANA_LLM_CPU_PREPACK"


def available_memory_bytes() -> int | None:
    """The kernel's estimate of memory available to new allocations (MemAvailable), or None
    where /proc/meminfo does not exist."""
    try:
        with open("/proc/meminfo", encoding="ascii") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def prepack_fits(num_bytes: int) -> bool:
    """Whether to make prepacked copies of `num_bytes` of CPU weights: $KSANA_LLM_CPU_PREPACK
    ("1"/"0") decides when set; otherwise only when the copies take at most half the memory
    available now, leaving the rest to the KV cache and activations (a model whose float32
    weights fill a third of RAM would otherwise run out of memory for a 1.05-2x speed-up)."""
    forced = os.environ.get(PREPACK_ENV_VAR)
    if forced is not None:
        if forced not in ("0", "1"):
            raise ValueError(f"{PREPACK_ENV_VAR} must be 0 or 1, got {forced!r}")
        return forced == "1"
    available = available_memory_bytes()
    if available is None or num_bytes <= available // 2:
        return True
    logger.warning("CPU weights not prepacked: a second copy (%.1f GB) would take more than half "
                   "the %.1f GB available; set %s=1 to force it", num_bytes / 2**30,
                   available / 2**30, PREPACK_ENV_VAR)
    return False


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
                  ) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class MergedLinear(nn.Module):
    """One matmul for several projections stacked along the output dim (QKV, gate/up).

    Checkpoints store the parts separately; `load_shard` copies part `index` into its rows. Under
    tensor parallelism a rank keeps only some rows of each part: `shards[i]` is (first row, row
    count) of part i's full checkpoint tensor (column-parallel), and `out_sizes` are the kept
    sizes. Without shards every row is kept.
    """

    def __init__(self, in_features: int, out_sizes: list[int], bias: bool = False,
                 shards: list[tuple[int, int]] | None = None) -> None:
        super().__init__()
        self.full_sizes = list(out_sizes)
        self.shards = list(shards) if shards is not None else [(0, n) for n in out_sizes]
        if len(self.shards) != len(self.full_sizes):
            raise ValueError("one shard per part")
        self.out_sizes = [size for _, size in self.shards]
        self.offsets = [sum(self.out_sizes[:i]) for i in range(len(self.out_sizes))]
        total = sum(self.out_sizes)
        self.weight = nn.Parameter(torch.empty(total, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(total), requires_grad=False) if bias else None
        self._packed: torch.Tensor | None = None  # see prepack()
        self.lora_name = ""  # its name in the model, under which an engine keeps its adapters

    def prepack(self) -> None:
        """Called once the weights are loaded (CPU float32 only: see prepack_cpu_weight)."""
        self._packed = prepack_cpu_weight(self.weight)

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        if self._packed is not None and x.dim() == 2:
            y = packed_linear(x, self._packed, self.bias)
        else:
            y = nn.functional.linear(x, self.weight, self.bias)
        return y if lora is None else lora.add_delta(self.lora_name, x, y)

    def load_shard(self, param: nn.Parameter, tensor: torch.Tensor, index: int) -> None:
        if tensor.shape[0] != self.full_sizes[index]:
            raise ValueError(f"shard {index} has {tensor.shape[0]} rows, "
                             f"expected {self.full_sizes[index]}")
        first, size = self.shards[index]
        offset = self.offsets[index]
        param.data[offset:offset + size].copy_(tensor[first:first + size])
