"""The model runner's batch building: a step's slices -> flat input ids, positions and the
attention metadata (slot mapping, block tables; for the torch backend, decode groups of similar
context length and per-chunk masks; for the Triton backend, the kernels' tables).

Token layout of a step: [one token per decoding sequence | each prefill chunk, in order]. Decodes
go first so attention can treat them as one batched call.

A mixin of `ModelRunner`: it reads the runner's `block_size`, `sliding_window`, `kv_scales`,
`lora`, `attention_backend` and `device`, and leaves the step's capture rows, first rows and
embedding overrides on it for `execute`.
"""

from __future__ import annotations

import itertools

import torch

from ksana_llm.layers.attention import AttentionMetadata, DecodeGroup, KernelBatch, PrefillChunk
from ksana_llm.runner.host_arrays import flat_batch, longest_first
from ksana_llm.runner.slices import SeqSlice

# Rows of the flattened batch whose input embeddings replace the token embeddings, and those
# embeddings: ([R] long, [R, hidden]). Models apply them right after the embedding lookup.
EmbeddingOverrides = tuple[torch.Tensor, torch.Tensor]


class BatchBuilding:
    def _window_ok(self, q_pos: torch.Tensor, k_pos: torch.Tensor) -> torch.Tensor:
        allowed = k_pos <= q_pos
        if self.sliding_window:
            allowed &= k_pos > q_pos - self.sliding_window
        return allowed

    def build(self, slices: list[SeqSlice]
              ) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata, list[int], list[int]]:
        """(input_ids, positions, metadata, last-token row of each sampled slice, their indices).

        The row of each forward-only capture position is left in `self._capture_rows`
        (slice index -> rows), read by `execute`."""
        # Decodes first, shortest context first (see _decode_groups), then prefill chunks.
        order = sorted(range(len(slices)), key=lambda i: (slices[i].num_tokens != 1,
                                                          slices[i].start))
        ordered = [slices[i] for i in order]
        num_decodes = sum(1 for s in ordered if s.num_tokens == 1)
        flat = flat_batch([s.token_ids for s in ordered], [s.start for s in ordered],
                          [s.block_table for s in ordered], self.block_size)
        sample_rows: list[int] = []
        sampled: list[int] = []
        override_rows: list[int] = []
        override_values: list[torch.Tensor] = []
        self._capture_rows = {}
        self._first_rows = first_rows = [0] * len(slices)
        row = 0  # the slice's first row in the flat batch
        for i, s in zip(order, ordered):
            first_rows[i] = row
            if s.capture:
                self._capture_rows[i] = [row + p - s.start for p in s.capture]
            if s.embeddings is not None:
                for k, p in enumerate(s.embeddings[0]):
                    if s.start <= p < s.start + s.num_tokens:
                        override_rows.append(row + p - s.start)
                        override_values.append(s.embeddings[1][k])
            row += s.num_tokens
            if s.sample:
                sample_rows.extend(range(row - 1 - s.num_draft_tokens, row))
                sampled.append(i)

        bs = self.block_size
        input_ids = torch.from_numpy(flat.input_ids)
        positions = torch.from_numpy(flat.positions)
        table = torch.from_numpy(flat.block_tables)
        slot_mapping = torch.from_numpy(flat.slots)

        meta = AttentionMetadata(slot_mapping=slot_mapping, positions=positions,
                                 num_decodes=num_decodes, sliding_window=self.sliding_window,
                                 kv_scales=self.kv_scales)
        if self.lora is not None:
            meta.lora = self.lora.batch([s.lora_slot for s in ordered],
                                        torch.from_numpy(flat.seq_index))
        if any(s.long_rope for s in ordered):
            long = torch.tensor([s.long_rope for s in ordered])
            meta.long_rope_rows = long.index_select(0, torch.from_numpy(flat.seq_index))
        self._embedding_overrides = self._overrides(override_rows, override_values)
        if self.attention_backend == "triton":
            lengths = [s.num_tokens for s in ordered[num_decodes:]]
            meta.kernel_batch = KernelBatch(
                decode_block_tables=table[:num_decodes].int(),
                decode_context_lens=(positions[:num_decodes] + 1).int(),
                decode_order=torch.from_numpy(longest_first(flat.positions[:num_decodes])),
                prefill_block_tables=table[num_decodes:].int(),
                prefill_query_start_loc=torch.tensor([0, *itertools.accumulate(lengths)],
                                                     dtype=torch.int32),
                prefill_seq_lens=torch.tensor([s.start + s.num_tokens for s in ordered[num_decodes:]],
                                              dtype=torch.int32))
            return input_ids, positions, meta, sample_rows, sampled
        # Contexts are gathered in whole blocks; the mask hides the tail of each last block (and
        # anything outside a sliding window).
        decode_positions = flat.positions[:num_decodes].tolist()  # ascending (see the order)
        for first, count in self._decode_groups(decode_positions):
            longest, shortest = decode_positions[first + count - 1] + 1, decode_positions[first] + 1
            width = -(-longest // bs)
            k_pos = torch.arange(width * bs)
            group = DecodeGroup(first, count, width * bs, table[first:first + count, :width])
            if self.sliding_window or shortest != width * bs:
                allowed = self._window_ok(positions[first:first + count, None], k_pos[None, :])
                group.mask = allowed[:, None, None, :]
            meta.decode_groups.append(group)
        start = num_decodes
        for i in range(num_decodes, len(ordered)):
            s = ordered[i]
            n, first = s.num_tokens, s.start
            chunk = PrefillChunk(start=start, num_tokens=n, context_len=first + n)
            needs_window = bool(self.sliding_window) and first + n > self.sliding_window
            if first or needs_window:
                width = -(-(first + n) // bs)
                chunk.blocks = table[i, :width]
                k_pos = torch.arange(width * bs)
                chunk.mask = self._window_ok(torch.arange(first, first + n)[:, None], k_pos[None, :])
            meta.prefills.append(chunk)
            start += n
        return input_ids, positions, meta, sample_rows, sampled

    @staticmethod
    def _overrides(rows: list[int], values: list[torch.Tensor]) -> EmbeddingOverrides | None:
        if not rows:
            return None
        return torch.tensor(rows, dtype=torch.long), torch.stack(values)

    @staticmethod
    def _decode_groups(positions: list[int], max_waste: float = 1.5, min_size: int = 8
                       ) -> list[tuple[int, int]]:
        """Split decodes (sorted by context length) into (first, count) groups whose longest
        context is at most `max_waste` times the shortest, so padding stays bounded; groups
        smaller than `min_size` are not split off (a launch costs more than a little padding)."""
        groups: list[tuple[int, int]] = []
        first = 0
        for i, pos in enumerate(positions):
            if i - first >= min_size and pos + 1 > max_waste * (positions[first] + 1) \
                    and len(positions) - i >= min_size:
                groups.append((first, i - first))
                first = i
        if positions:
            groups.append((first, len(positions) - first))
        return groups

    def _to_device(self, meta: AttentionMetadata) -> AttentionMetadata:
        if self.device.type == "cpu":
            return meta
        move = lambda t: None if t is None else t.to(self.device, non_blocking=True)  # noqa: E731
        meta.slot_mapping = move(meta.slot_mapping)
        meta.positions = move(meta.positions)
        meta.long_rope_rows = move(meta.long_rope_rows)
        if meta.lora is not None:
            meta.lora = meta.lora.to(self.device)
        if meta.kernel_batch is not None:
            meta.kernel_batch = meta.kernel_batch.to(self.device)
        for part in (*meta.decode_groups, *meta.prefills):
            part.blocks, part.mask = move(part.blocks), move(part.mask)
        return meta
