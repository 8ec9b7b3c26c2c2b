"""LoRA adapters applied per token: several adapters, and the base model, in one batch.

Each adaptable projection (`qkv_proj`, `o_proj`, `gate_up_proj`, `down_proj`) may have a
`LoraWeights`: every adapter slot's A and B matrices stacked into two dense matrices, so a step
computes all slots' low-rank products in two matmuls and a per-token mask keeps each token's own
slot. That costs `slots x rank` extra columns (small next to the projection) and needs no per-step
Python loop over adapters, no gather of per-token weights and no allocation that depends on which
adapters the batch uses.

For a projection fused from P checkpoint parts (q/k/v, gate/up) each slot holds P rank-blocks:
part p's A rows feed only part p's output rows of B, so the parts stay independent, as they are in
the checkpoint.

The weights belong to an engine (`runner.lora_slots`), not to the modules, so two engines may
share one model; a step's `LoraBatch` (in `AttentionMetadata.lora`) carries both the weights and
the token mask, and is None when no token of the step uses an adapter, which leaves the base
model's path untouched.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch


@dataclass
class LoraWeights:
    """One projection's adapters: `a` [slots * block, in] and `b_t` [slots * block, out] (B
    transposed), where `block` = parts * max rank: slot s owns rows [s * block, (s + 1) * block)
    of both, so any run of slots is a contiguous slice. The scaling (alpha / r) is folded into
    `b_t`; a slot's unused rank rows are zero."""

    a: torch.Tensor
    b_t: torch.Tensor
    num_slots: int

    @property
    def block(self) -> int:
        return self.a.shape[0] // self.num_slots

    def delta(self, x: torch.Tensor, token_mask: torch.Tensor, first_slot: int = 0
              ) -> torch.Tensor:
        """The adapters' contribution to the projection of `x` [T, in]: each token's own slot's
        B @ A @ x (zero for a token with no adapter). `token_mask` [T, n] (bool) covers slots
        first_slot .. first_slot + n - 1 (True at the token's slot): only those are computed."""
        rows = slice(first_slot * self.block, (first_slot + token_mask.shape[1]) * self.block)
        num_tokens = x.shape[0]
        shrunk = (x @ self.a[rows].t()).view(num_tokens, token_mask.shape[1], -1)
        # A select, not a multiply by 0/1: an inf in another slot's product must not turn into
        # NaN (inf * 0) in this token's row.
        kept = torch.where(token_mask[:, :, None], shrunk, 0.0)
        return kept.view(num_tokens, -1) @ self.b_t[rows]


@dataclass
class LoraBatch:
    """One step's adapters: every adapted projection's weights, keyed by its module name
    (`lora_name`, set on the module by the engine), and which slot each token uses. Only the
    run of slots the step's tokens use is computed: `token_mask` [T, n] covers slots
    first_slot .. first_slot + n - 1 (0-based), True where token t uses that slot."""

    weights: Mapping[str, LoraWeights]
    token_mask: torch.Tensor  # bool
    first_slot: int = 0

    def add_delta(self, module_name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the projection of `x`) plus the adapters' delta, when the projection has any."""
        weights = self.weights.get(module_name)
        if weights is None:
            return y
        return y + weights.delta(x, self.token_mask, self.first_slot)

    def to(self, device: torch.device) -> LoraBatch:
        return LoraBatch(self.weights, self.token_mask.to(device, non_blocking=True),
                         self.first_slot)
