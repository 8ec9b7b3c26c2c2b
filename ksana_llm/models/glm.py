"""GLM-4 (`GlmForCausalLM`: glm-4-9b(-chat)-hf) and GLM-4-0414 (`Glm4ForCausalLM`: GLM-4-9B/32B-0414,
GLM-Z1) on the Llama block.

- RoPE covers the first `partial_rotary_factor` (0.5) of each head, its dims paired as (0, 1),
  (2, 3), ... (transformers' GLM rotation). Pairs are rotated the same way in q and k, and a
  dot product does not see an order both share: the rotary rows of each head's q_proj / k_proj
  (weights and biases) are reordered to halves as they load, (0, 2, 4, ... | 1, 3, 5, ...),
  and our NeoX rotation of the first dims runs unchanged (kernels included).
- q/k/v carry biases (`attention_bias`), the output projection none; the MLP's gate and up come
  fused (`gate_up_proj`, split as they load, as Phi-3's).
- GLM-4-0414 adds a norm after attention (`post_self_attn_layernorm`) and after the MLP
  (`post_mlp_layernorm`): Gemma 2's sandwich layout, whose norms they load into.

A quantized checkpoint's q/k weights (GPTQ, AWQ, FP8: `QuantizedWeight`, rows first) are
reordered the same way.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.rotary import partial_rotary_dim, rope_settings
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.models.gemma import Gemma2DecoderLayer
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of
from ksana_llm.models.phi3 import split_fused_checkpoint_tensors


def halves_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """Within one head: the interleaved rotary dims as halves (evens, then odds), the rest
    where they are."""
    rotary = torch.arange(rotary_dim)
    return torch.cat((rotary[0::2], rotary[1::2], torch.arange(rotary_dim, head_dim)))


class GlmForCausalLM(LlamaForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        # Checked before any weight is built.
        self._rotary_dim = partial_rotary_dim(config, head_dim_of(config), default=0.5)
        super().__init__(config, parallel)
        theta, scaling = rope_settings(config)
        self.model.rotary_emb = build_rotary(self._rotary_dim, config.max_position_embeddings,
                                             theta, scaling)

    def uses_rope(self, config: Any) -> bool:
        return False  # a table over the rotary dims only, installed in __init__

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, o_bias=False, parallel=self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        tensors = split_fused_checkpoint_tensors(self._rotary_rows_as_halves(weights),
                                                 self.config)
        return super().load_weights(tensors, require_all=require_all)

    def _rotary_rows_as_halves(self, weights: Iterable[tuple[str, torch.Tensor]]
                               ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            module, _, kind = name.rpartition(".")
            if module.endswith((".q_proj", ".k_proj")) and kind in ("weight", "bias"):
                tensor = self.loaded_output_rows(module, tensor)
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
        order = (halves_order(d, self._rotary_dim) + d * torch.arange(heads)[:, None]).reshape(-1)
        if isinstance(rows, QuantizedWeight):
            return rows.select_rows(order)
        return rows if rows.is_meta else rows.index_select(0, order.to(rows.device))


class Glm4ForCausalLM(GlmForCausalLM):
    # GLM-4-0414's norm names -> the sandwich layer's (`Gemma2DecoderLayer`)
    _NORM_NAMES = ((".post_attention_layernorm.", ".pre_feedforward_layernorm."),
                   (".post_self_attn_layernorm.", ".post_attention_layernorm."),
                   (".post_mlp_layernorm.", ".post_feedforward_layernorm."))

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return Gemma2DecoderLayer(config, self.make_attention(config, layer_idx),
                                  self.make_mlp(config, layer_idx), local_rope=False)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(self._renamed_norms(weights), require_all=require_all)

    def _renamed_norms(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            for theirs, ours in self._NORM_NAMES:
                if theirs in name:
                    name = name.replace(theirs, ours)
                    break
            yield name, tensor
