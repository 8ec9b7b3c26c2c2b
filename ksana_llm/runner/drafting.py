"""Drafting tokens for speculative decoding with the model's MTP layer (DeepSeek V3/R1).

Once a step's tokens are known, the draft layer runs over the rows the main model computed in
that step whose next token is known: row p reads the main model's final hidden state at p and the
id of token p + 1, writes its own KV at p (the draft layer has its own paged cache, indexed by
the same block tables), and leads to token p + 2. A sequence's last row thus drafts the token
after its newest one. Further drafts chain, as vLLM chains DeepSeek's single MTP layer: draft j
(j >= 2) is one more row at the next position, reading the previous draft row's hidden state and
the previous draft.

Those chained rows' KV is overwritten once the main model gets there, and draft KV that is stale
or missing (a prefix-cache block filled by a forward-only request, a fork's shared block) only
makes drafts worse, never outputs wrong: the engine verifies every draft against the main model
(`runner.draft_verification`).

A mixin of `ModelRunner`: it works on the runner's `model`, `draft_kv_caches`, `device`, the
last step's `last_hidden` / `last_first_rows`, and its `build` (with the `_first_rows` it leaves)
and `_to_device`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ksana_llm.layers.attention import AttentionMetadata
from ksana_llm.layers.fused_kernels import use_fused_kernels
from ksana_llm.runner.logits_processing import to_device
from ksana_llm.runner.slices import SeqSlice


def draft_layers_for(model: nn.Module, num_speculative_tokens: int) -> int:
    """Draft layers to keep a cache for: ValueError when speculative decoding is asked of a model
    that cannot draft."""
    if num_speculative_tokens <= 0:
        return 0
    layers = getattr(model, "num_draft_layers", 0)
    if not layers:
        raise ValueError(f"num_speculative_tokens={num_speculative_tokens}: "
                         f"{type(model).__name__} has no draft (MTP) layers; speculative decoding "
                         "needs a checkpoint with multi-token-prediction weights (DeepSeek V3/R1)")
    return layers


@dataclass(frozen=True)
class DraftInput:
    """The draft layer's rows for one step.

    `slices[i]` covers positions `start ..` of one sequence, and its token ids are those of the
    tokens one position later; row t of it reads row t of the last step's slice `sources[i]`.
    Sampled slices draft from their last row: `num_drafts` holds how many tokens each drafts
    (>= 1), in slice order.
    """

    slices: list[SeqSlice]
    sources: list[int]
    num_drafts: list[int]


class MtpDrafting:
    @torch.inference_mode()
    def propose(self, draft: DraftInput) -> torch.Tensor:
        """[len(num_drafts), max(num_drafts)] int64 draft ids on the device, one row per sampled
        slice in slice order (-1 past a row's own count)."""
        with use_fused_kernels(self.fused_kernels):
            return self._propose(draft)

    def _propose(self, draft: DraftInput) -> torch.Tensor:
        if self.last_hidden is None:
            raise RuntimeError("propose() needs the hidden states of a step run just before")
        main_hidden, main_first = self.last_hidden, self.last_first_rows
        self.last_hidden = None  # read once: do not keep a step's activations alive
        input_ids, _, meta, rows, sampled = self.build(draft.slices)
        # Row t of slice i reads the main model's row t of its source slice.
        first_rows = self._first_rows
        gather = [0] * input_ids.shape[0]
        for i, s in enumerate(draft.slices):
            row, source = first_rows[i], main_first[draft.sources[i]]
            gather[row:row + s.num_tokens] = range(source, source + s.num_tokens)
        previous = main_hidden.index_select(0, to_device(gather, torch.long, self.device))
        hidden = self._draft_forward(input_ids.to(self.device, non_blocking=True), previous, meta)
        if not sampled:
            return torch.empty((0, 0), dtype=torch.long, device=self.device)
        # `build` orders slices its own way; drafts come back in slice order.
        order = sorted(range(len(sampled)), key=sampled.__getitem__)
        last = hidden.index_select(0, to_device([rows[j] for j in order], torch.long, self.device))
        tokens = self.model.draft_logits(last).argmax(dim=-1)
        columns = [tokens]
        sampled_slices = [draft.slices[sampled[j]] for j in order]
        for depth in range(1, max(draft.num_drafts)):
            tokens, last = self._chain(sampled_slices, draft.num_drafts, depth, tokens, last)
            columns.append(tokens)
        return torch.stack(columns, dim=1)

    def _chain(self, slices: list[SeqSlice], num_drafts: list[int], depth: int,
               tokens: torch.Tensor, last: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One more draft for the sequences that want more than `depth`: a row one position past
        the previous draft row, reading that row's hidden state and draft. Returns the new
        drafts (-1 for the others) and the hidden states to chain from."""
        active = [d for d, n in enumerate(num_drafts) if n > depth]
        chain = [SeqSlice([0], slices[d].start + slices[d].num_tokens - 1 + depth,
                          slices[d].block_table, sample=True) for d in active]
        _, _, meta, _, sampled = self.build(chain)
        # One row per chain slice, in `build`'s order: sampled[r] is the slice at row r.
        source = to_device([active[i] for i in sampled], torch.long, self.device)
        hidden = self._draft_forward(tokens.index_select(0, source),
                                     last.index_select(0, source), meta)
        new_tokens = torch.full_like(tokens, -1).index_copy_(
            0, source, self.model.draft_logits(hidden).argmax(dim=-1))
        return new_tokens, last.index_copy(0, source, hidden)

    def _draft_forward(self, input_ids: torch.Tensor, previous: torch.Tensor,
                       meta: AttentionMetadata) -> torch.Tensor:
        meta = self._to_device(meta)
        return self.model.draft_hidden(input_ids, previous, meta.positions,
                                       self.draft_kv_caches[0], meta)
