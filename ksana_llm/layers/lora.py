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
    """One projection's adapters: `a` [slots * block, in], `b` [out, slots * block], where
    `block` = parts * max rank. The scaling (alpha / r) is folded into `b`; a slot's unused rank
    rows and columns are zero."""

    a: torch.Tensor
    b: torch.Tensor
    num_slots: int

    def delta(self, x: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
        """The adapters' contribution to the projection of `x` [T, in]: each token's own slot's
        B @ A @ x (zero for a token with no adapter). `token_mask` [T, slots], 1 at the slot."""
        shrunk = x @ self.a.t()
        num_tokens = x.shape[0]
        shrunk = (shrunk.view(num_tokens, self.num_slots, -1) * token_mask[:, :, None])
        return shrunk.view(num_tokens, -1) @ self.b.t()


@dataclass
class LoraBatch:
    """One step's adapters: every adapted projection's weights, keyed by its module name
    (`lora_name`, set on the module by the engine), and which slot each token uses."""

    weights: Mapping[str, LoraWeights]
    token_mask: torch.Tensor  # [T, slots] in the model's dtype: 1 where token t uses slot s

    def add_delta(self, module_name: str, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """`y` (the projection of `x`) plus the adapters' delta, when the projection has any."""
        weights = self.weights.get(module_name)
        if weights is None:
            return y
        return y + weights.delta(x, self.token_mask)

    def to(self, device: torch.device) -> LoraBatch:
        return LoraBatch(self.weights, self.token_mask.to(device, non_blocking=True))
