"""GLM-4 (`GlmForCausalLM`: glm-4-9b(-chat)-hf) and GLM-4-0414 (`Glm4ForCausalLM`: GLM-4-9B/32B-0414,
GLM-Z1) on the Llama block.

- RoPE covers the first `partial_rotary_factor` (0.5) of each head, its dims paired as (0, 1),
  (2, 3), ... (transformers' GLM rotation): the q/k rotary rows are reordered to halves as they
  load (models/interleaved_rope.py).
- q/k/v carry biases (`attention_bias`), the output projection none; the MLP's gate and up come
  fused (`gate_up_proj`, split as they load, as Phi-3's).
- GLM-4-0414 adds a norm after attention (`post_self_attn_layernorm`) and after the MLP
  (`post_mlp_layernorm`): Gemma 2's sandwich layout, whose norms they load into.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.rotary import partial_rotary_dim, rope_settings
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.models.gemma import Gemma2DecoderLayer
from ksana_llm.models.interleaved_rope import InterleavedRotaryRows
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM, head_dim_of
from ksana_llm.models.phi3 import split_fused_checkpoint_tensors


class GlmForCausalLM(InterleavedRotaryRows, LlamaForCausalLM):
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
        tensors = split_fused_checkpoint_tensors(self.rotary_rows_as_halves(weights),
                                                 self.config)
        return super().load_weights(tensors, require_all=require_all)


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
