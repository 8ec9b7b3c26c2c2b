"""The token ids of the rows with penalties or n-gram bans, kept on the device.

Those read a row's whole history: the ids of its prompt and output (repetition penalty,
`no_repeat_ngram_size`) or of its output (presence and frequency penalties). Rebuilding that from
the host's token lists at every step costs host time proportional to the history, and needs the
previous step's token on the host, so such steps could not run ahead of the read-back (async
scheduling). Instead each row holds a slot in one table from its first sample until it is
released:

    ids  [slots, width] int32   prompt ids, then output ids, then `vocab_size` (padding)

A slot is filled once from the row's lists; afterwards the sampler writes every token it samples
there on the device (`record`), in stream order with the next step's reads. The host keeps each
slot's lengths (it knows how many tokens each row has, even before their ids are read back).
Padding is `vocab_size`, one past the logits: `logits_processing` works on a buffer with a spare
last column for it, which also takes ids beyond the logits (added tokens past the LM head: kept
as they are in the table, so n-grams tell them apart), like `transformers` does.

Memory: capacity x width int32, both grown by doubling (the width to the longest history seen,
the capacity to the most rows alive at once) and kept for the engine's life, outside the KV
cache's memory budget: 256 rows of 32k-token histories take 32 MB, where a [rows, vocab] count
table would take 150 MB at Qwen's 152k ids. Each step reads only the columns its rows fill.
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING

import torch

from ksana_llm.runner.logits_processing import PenaltyIds, to_device

if TYPE_CHECKING:  # only for annotations: the sampler imports this module
    from ksana_llm.runner.sampler import SamplingRow

__all__ = ["TokenHistories"]


class TokenHistories:
    def __init__(self, vocab_size: int, device: torch.device, capacity: int = 8,
                 width: int = 256) -> None:
        self.vocab_size = vocab_size
        self.device = device
        self.ids = torch.full((capacity, width), vocab_size, dtype=torch.int32, device=device)
        self.prompt_lengths = [0] * capacity
        self.lengths = [0] * capacity
        self._free = list(range(capacity - 1, -1, -1))  # popped from the end: lowest first
        # Keyed by id(row): a row's finalizer drops its entry before the id can be reused, so a
        # row nobody released (a caller that drives the sampler directly) frees its slot too.
        self._slots: dict[int, tuple[int, weakref.finalize]] = {}

    @property
    def capacity(self) -> int:
        return self.ids.shape[0]

    @property
    def width(self) -> int:
        return self.ids.shape[1]

    @property
    def num_rows(self) -> int:
        return len(self._slots)

    def slots(self, rows: list[SamplingRow]) -> list[int]:
        """Each row's slot; rows without one get a slot filled from their token lists."""
        slots, new = [], []
        for row in rows:
            entry = self._slots.get(id(row))
            if entry is None:
                slot = self._allocate(row)
                new.append((slot, row))
            else:
                slot = entry[0]
            slots.append(slot)
        if new:
            self._fill(new)
        return slots

    def history(self, slots: list[int]) -> tuple[torch.Tensor, list[int]]:
        """Each slot's ids (prompt, then output) as [len(slots), W] int64, right-padded with
        `vocab_size`, and their lengths; W is the longest (at least 1)."""
        lengths = [self.lengths[s] for s in slots]
        width = max(1, max(lengths))
        index = to_device(slots, torch.int64, self.device)
        return self.ids[:, :width].index_select(0, index).long(), lengths

    def penalty_ids(self, batch_size: int, members: list[int], slots: list[int],
                    *, prompt: bool) -> PenaltyIds:
        """Rows `members` of a batch get the ids of slots `slots` (prompt and output, or output
        only); the other rows get none. Ids past the logits become `vocab_size`."""
        if prompt:
            picked, _ = self.history(slots)  # padded past each row's length already
        else:
            starts = [self.prompt_lengths[s] for s in slots]
            ends = [self.lengths[s] for s in slots]
            width = max(1, max(e - b for b, e in zip(starts, ends)))
            columns = max(ends)  # every row's ids lie before its end
            rows = self.ids[:, :columns].index_select(0, to_device(slots, torch.int64,
                                                                    self.device))
            begin = to_device(starts, torch.int64, self.device)
            end = to_device(ends, torch.int64, self.device)
            positions = begin[:, None] + torch.arange(width, device=self.device)
            picked = rows.gather(1, positions.clamp(max=columns - 1)).long()
            picked.masked_fill_(positions >= end[:, None], self.vocab_size)
        out = torch.full((batch_size, picked.shape[1]), self.vocab_size, dtype=torch.int64,
                         device=self.device)
        out.index_copy_(0, to_device(members, torch.int64, self.device),
                        picked.clamp_(max=self.vocab_size))
        return PenaltyIds(out)

    def record(self, slots: list[int], rows_of: list[int], token_ids: torch.Tensor) -> None:
        """Append the tokens just sampled: slot slots[i] took token_ids[rows_of[i]]."""
        positions = [self.lengths[s] for s in slots]
        if max(positions) >= self.width:
            self._widen(max(positions) + 1)
        tokens = token_ids.index_select(0, to_device(rows_of, torch.int64, token_ids.device))
        self.ids.index_put_((to_device(slots, torch.int64, self.device),
                             to_device(positions, torch.int64, self.device)),
                            tokens.to(self.device, torch.int32))
        for s in slots:
            self.lengths[s] += 1

    def release(self, row: SamplingRow) -> None:
        """The row is done: its slot may serve another row (refilled before any read)."""
        entry = self._slots.pop(id(row), None)
        if entry is not None:
            entry[1].detach()
            self._free.append(entry[0])

    def _drop(self, key: int) -> None:
        entry = self._slots.pop(key, None)
        if entry is not None:
            self._free.append(entry[0])

    def _allocate(self, row: SamplingRow) -> int:
        if not self._free:
            old = self.capacity
            self.ids = torch.cat([self.ids, torch.full_like(self.ids, self.vocab_size)])
            self.prompt_lengths.extend([0] * old)
            self.lengths.extend([0] * old)
            self._free.extend(range(2 * old - 1, old - 1, -1))
        slot = self._free.pop()
        self._slots[id(row)] = (slot, weakref.finalize(row, self._drop, id(row)))
        return slot

    def _widen(self, needed: int) -> None:
        width = self.width
        while width < needed:
            width *= 2
        pad = torch.full((self.capacity, width - self.width), self.vocab_size,
                         dtype=self.ids.dtype, device=self.device)
        self.ids = torch.cat([self.ids, pad], dim=1)

    def _fill(self, new: list[tuple[int, SamplingRow]]) -> None:
        """Write the new rows' lists into their slots (padding the rest): host work in the
        histories' length, not the table's width."""
        histories = []
        for slot, row in new:
            if any(t < 0 for t in row.output_token_ids):
                # A placeholder for a token still on the device (async scheduling): a row gets
                # its slot at its first sample, before it can have one.
                raise RuntimeError("a penalised row's history holds a token not yet read back")
            histories.append(row.prompt_token_ids + row.output_token_ids)
            self.prompt_lengths[slot] = len(row.prompt_token_ids)
            self.lengths[slot] = len(histories[-1])
        longest = max(len(h) for h in histories)
        if longest >= self.width:
            self._widen(longest + 1)
        vocab = self.vocab_size
        index = to_device([slot for slot, _ in new], torch.int64, self.device)
        self.ids.index_fill_(0, index, vocab)  # a reused slot's old ids must not show
        if longest:
            padded = [h + [vocab] * (longest - len(h)) for h in histories]
            self.ids[:, :longest].index_copy_(0, index, to_device(padded, torch.int32,
                                                                   self.device))
