"""What one step computes of one sequence (`SeqSlice`), shared by the model runner and the
drafting steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(slots=True)
class SeqSlice:
    """The part of one sequence a step computes: tokens from position `start` on. (Read-only by
    convention, not frozen: a frozen dataclass costs a microsecond more to build, per sequence
    per step.)"""

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool  # True when these are the sequence's last pending tokens: return its logits
    # Forward-only: absolute positions (within this slice) whose final hidden rows to return,
    # with their logits too when `capture_logits`.
    capture: tuple[int, ...] = ()
    capture_logits: bool = False
    # Input embeddings that replace the token embeddings at some absolute positions of the
    # sequence (plugins, e.g. image features): (positions, [len(positions), hidden]). Only those
    # inside this slice are used.
    embeddings: tuple[tuple[int, ...], torch.Tensor] | None = None
    # Speculative decoding: the last `num_draft_tokens` tokens are drafts to verify; a sampled
    # slice then returns the logits of its last 1 + num_draft_tokens rows.
    num_draft_tokens: int = 0
    # The LoRA adapter slot its tokens use (runner.lora_slots); 0 = the base model.
    lora_slot: int = 0

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
