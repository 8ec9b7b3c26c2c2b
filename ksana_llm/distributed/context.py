"""Who this process is in a parallel run, and the process groups it talks over.

A `ParallelContext` is passed explicitly to the model and the runner (no global state). Global
ranks are laid out pipeline-major: rank = pp_rank * tp_size + tp_rank, so the ranks of one
pipeline stage form one tensor-parallel group (on one node in a multi-node run).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


def balanced_split(total: int, parts: int, index: int, unit: int = 1) -> tuple[int, int]:
    """(start, size) of part `index` when `total` items are split as evenly as possible in
    whole `unit`s (`total` a multiple of it); the first parts get one unit more. Used for
    uneven TP splits (vocab, MLP width, quantized experts' intermediate columns in whole scale
    blocks)."""
    if unit < 1 or total % unit:
        raise ValueError(f"splitting {total} items in units of {unit}: not a whole number")
    base, extra = divmod(total // unit, parts)
    size = base + (1 if index < extra else 0)
    start = index * base + min(index, extra)
    return start * unit, size * unit


@dataclass(frozen=True)
class ParallelContext:
    tp_size: int = 1
    tp_rank: int = 0
    pp_size: int = 1
    pp_rank: int = 0
    tp_group: Any = None  # torch.distributed ProcessGroup of this stage's TP ranks (None: TP 1)
    device_group: Any = None  # the default group (all ranks), for pipeline send/recv

    @property
    def world_size(self) -> int:
        return self.tp_size * self.pp_size

    @property
    def rank(self) -> int:
        return self.pp_rank * self.tp_size + self.tp_rank

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp_size - 1

    def stage_rank(self, pp_rank: int) -> int:
        """Global rank of the process with this TP rank in stage `pp_rank`."""
        return pp_rank * self.tp_size + self.tp_rank

    def layer_range(self, num_layers: int) -> tuple[int, int]:
        """[start, end) of the decoder layers this pipeline stage holds."""
        start, size = balanced_split(num_layers, self.pp_size, self.pp_rank)
        return start, start + size

    def tp_split(self, total: int, unit: int = 1) -> tuple[int, int]:
        """This rank's (start, size) of `total` items, in whole `unit`s (`balanced_split`)."""
        return balanced_split(total, self.tp_size, self.tp_rank, unit)
