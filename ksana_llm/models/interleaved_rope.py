"""Checkpoints whose RoPE pairs each head's dims as (0, 1), (2, 3), ... (GPT-J's rotation:
GLM, Cohere), served by our NeoX rotation of halves.

Pairs are rotated the same way in q and k, and a dot product does not see an order both share:
the rotary rows of each head's q_proj / k_proj (weights, dense or quantized, biases, LoRA B) are
reordered to halves as they load, (0, 2, 4, ... | 1, 3, 5, ...), the rest where they are, and the
rotation runs unchanged (kernels included). Per-head norm weights on q and k ([head_dim], or
[heads, head_dim]: Cohere's) take the same order.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.models.llama import head_dim_of


def halves_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Within one head: the interleaved rotary dims as halves (evens, then odds), the rest
    where they are."""
    rotary = torch.arange(rotary_dim)
    return torch.cat((rotary[0::2], rotary[1::2], torch.arange(rotary_dim, head_dim)))


class InterleavedRotaryRows:
    """A causal LM mixin: `_rotary_dim` (set before the weights are built) is how many of each
    head's dims rotate; the model's `load_weights` runs its tensors through
    `rotary_rows_as_halves`, and the LoRA slots read `loaded_output_rows`."""

    _rotary_dim: int
    config: Any

    def rotary_rows_as_halves(self, weights: Iterable[tuple[str, torch.Tensor]]
                              ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            if module.endswith((".q_proj", ".k_proj")) and kind in ("weight", "bias"):
                tensor = self.loaded_output_rows(module, tensor)
            elif module.endswith((".q_norm", ".k_norm")) and kind == "weight" \
                    and tensor.shape[-1] == head_dim_of(self.config):
                # A per-head norm's weights, one set for all heads or one per head.
                tensor = tensor[..., self._head_order().to(tensor.device)]
            yield name, tensor

    def loaded_output_rows(self, module: str, rows: torch.Tensor | QuantizedWeight
                           ) -> torch.Tensor | QuantizedWeight:
        """`rows` (a weight, dense or quantized, a bias, or a LoRA B of checkpoint module
        `module`) in the order this model holds that module's outputs: each head's rotary rows
        as halves for q_proj and k_proj, as stored for anything else."""
        if not module.endswith((".q_proj", ".k_proj")):
            return rows
        d = head_dim_of(self.config)
        heads = rows.shape[0] // d
        order = (self._head_order() + d * torch.arange(heads)[:, None]).reshape(-1)
        if isinstance(rows, QuantizedWeight):
            return rows.select_rows(order)
        return rows if rows.is_meta else rows.index_select(0, order.to(rows.device))

    def _head_order(self) -> torch.Tensor:
        return halves_order(head_dim_of(self.config), self._rotary_dim)
