"""What one step computes of one sequence (`SeqSlice`), shared by the model runner and the
drafting steps."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PromptLogprobTargets:
    """What a slice's captured rows are reduced to when they score the prompt (prompt
    log-probs): row `capture[j]` scores prompt token `token_ids[j]`; the top `top_k`
    alternatives come with it (`runner.prompt_logprobs.token_logprobs`)."""

    token_ids: tuple[int, ...]
    top_k: int


@dataclass(slots=True)
class SeqSlice:
    """The part of one sequence a step computes: tokens from position `start` on. (Read-only by
    convention, not frozen: a frozen dataclass costs a microsecond more to build, per sequence
    per step.)"""

    token_ids: list[int]
    start: int
    block_table: list[int]
    sample: bool  # True when these are the sequence's last pending tokens: return its logits
    # Absolute positions (within this slice) whose final hidden rows to return (forward-only
    # requests), with their logits too when `capture_logits`; or, with `prompt_logprobs`, only
    # those rows' prompt log-probs (`runner.captured_rows`).
    capture: tuple[int, ...] = ()
    capture_logits: bool = False
    prompt_logprobs: PromptLogprobTargets | None = None
    # Input embeddings that replace the token embeddings at some absolute positions of the
    # sequence (plugins, e.g. image features): (positions, [len(positions), hidden]). Only those
    # inside this slice are used.
    embeddings: tuple[tuple[int, ...], torch.Tensor] | None = None
    # Speculative decoding: the last `num_draft_tokens` tokens are drafts to verify; a sampled
    # slice then returns the logits of its last 1 + num_draft_tokens rows.
    num_draft_tokens: int = 0
    # The LoRA adapter slot its tokens use (runner.lora_slots); 0 = the base model.
    lora_slot: int = 0
    # LongRoPE models: the sequence is longer than the original context, so all its rows take
    # the long factors (engine.scheduler, layers.rotary_longrope).
    long_rope: bool = False

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)
