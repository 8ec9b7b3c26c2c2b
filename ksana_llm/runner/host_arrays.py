"""A step's flat inputs built with NumPy from the scheduled slices: no per-token Python loop.

Both the eager path (`ModelRunner.build`) and the CUDA-graph path (`DecodeInputs.fill`) lay out
the same things: token ids, positions, KV slots and padded block tables. Building them with a
few vectorised NumPy calls costs microseconds where per-token list work and `torch.tensor` on
nested lists cost a millisecond at a few hundred sequences: time the GPU would spend waiting.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np


def longest_first(context_lens: Sequence[int] | np.ndarray, total: int | None = None
                  ) -> np.ndarray:
    """int32 row order for the decode kernel's programs (`paged_decode_attention(order=)`):
    the rows by context length, longest first (ties in row order), then rows
    len(context_lens)..total - 1 (a graph bucket's padding, empty) as they are."""
    n = len(context_lens)
    order = np.argsort(-np.asarray(context_lens, dtype=np.int64), kind="stable")
    if total is not None and total > n:
        order = np.concatenate((order, np.arange(n, total)))
    return order.astype(np.int32)


def fill_block_tables(out: np.ndarray, block_tables: Sequence[Sequence[int]]) -> None:
    """Write table i at the start of row i of `out` (one C-level pass: a row-major boolean
    assignment keeps each row's order). Columns past a row's own table are left as they are."""
    n = len(block_tables)
    lens = np.fromiter((len(t) for t in block_tables), dtype=np.int64, count=n)
    used = int(lens.max()) if n else 0
    flat = np.fromiter(itertools.chain.from_iterable(block_tables), dtype=out.dtype,
                       count=int(lens.sum()))
    out[:n, :used][np.arange(used)[None, :] < lens[:, None]] = flat


@dataclass(frozen=True)
class FlatBatch:
    """Token-major inputs of one step: row r is token `input_ids[r]` of sequence `seq_index[r]`
    at position `positions[r]`, whose KV goes to `slots[r]`; `block_tables` is [n, width],
    zero-padded."""

    input_ids: np.ndarray  # [T] int64
    positions: np.ndarray  # [T] int64
    slots: np.ndarray  # [T] int64
    seq_index: np.ndarray  # [T] int64
    block_tables: np.ndarray  # [n, width] int64


def flat_batch(token_ids: Sequence[Sequence[int]], starts: Sequence[int],
               block_tables: Sequence[Sequence[int]], block_size: int) -> FlatBatch:
    """Sequence i computes `token_ids[i]` from position `starts[i]` on, with `block_tables[i]`."""
    n = len(starts)
    counts = np.fromiter((len(t) for t in token_ids), dtype=np.int64, count=n)
    total = int(counts.sum())
    ids = np.fromiter(itertools.chain.from_iterable(token_ids), dtype=np.int64, count=total)
    seq_index = np.repeat(np.arange(n, dtype=np.int64), counts)
    first_row = np.cumsum(counts) - counts
    positions = np.fromiter(starts, dtype=np.int64, count=n)[seq_index] \
        + np.arange(total, dtype=np.int64) - first_row[seq_index]
    width = max((len(t) for t in block_tables), default=0)
    tables = np.zeros((n, max(width, 1)), dtype=np.int64)
    fill_block_tables(tables, block_tables)
    slots = tables[seq_index, positions // block_size] * block_size + positions % block_size
    return FlatBatch(ids, positions, slots, seq_index, tables)
