"""Gemma (1), Gemma 2 and Gemma 3 (text) on the Llama block.

What every Gemma changes from Llama:
- RMSNorm multiplies by (1 + weight): the checkpoint stores the offset from 1, so each
  `*norm.weight` tensor gets 1 added as it loads and our RMSNorm runs unchanged (the same
  numbers in float32; in bf16 the sum and the normalised input are rounded before the multiply,
  where transformers multiplies in float32 and rounds once: within bf16's own noise, measured
  against fp32);
- token embeddings are multiplied by sqrt(hidden_size), rounded to the weights' dtype
  (`ScaledEmbedding`; embeddings given in place of tokens, `prompt_embeds`, are used as given,
  as transformers uses `inputs_embeds`, whose `get_input_embeddings()` scales them already;
  vLLM's Gemma 1 / 2 scale given rows once more);
- the gated MLP's activation is GeLU (tanh approximation), named `hidden_act` (Gemma 1) or
  `hidden_activation` (Gemma 2, 3); tied embeddings; `final_logit_softcapping` when set.

Gemma 2 (`Gemma2ForCausalLM`) adds:
- softmax scale `query_pre_attn_scalar`^-0.5, attention logits soft-capped at
  `attn_logit_softcapping` (cap * tanh(logit / cap), in both attention backends);
- a norm after attention and around the MLP (`pre_`/`post_feedforward_layernorm`);
- `layer_types`: windowed layers (`sliding_window`) interleaved with full ones. The runner keeps
  every block (the full layers read them); windowed layers mask what they do not see.

Gemma 3 (`Gemma3ForCausalLM`, the 1B model and text-only configs) is Gemma 2's layout with q/k
RMSNorm per head before RoPE instead of attention soft-capping, windowed layers 5 to 1, and
each kind of layer with its own RoPE (`rope_parameters["sliding_attention"]` /
`["full_attention"]`, or the older `rope_local_base_freq` / `rope_theta` + `rope_scaling`).

The multimodal Gemma 3 checkpoints (`Gemma3ForConditionalGeneration`, 4B to 27B) are served as
their language model, for text (`loader.multimodal_text`: their `text_config`, their
`language_model.` tensors, the vision tower and projector left out).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.attention import AttentionMetadata, KVCache
from ksana_llm.layers.norm import RMSNorm
from ksana_llm.layers.parallel import VocabParallelEmbedding
from ksana_llm.layers.rotary import rope_settings
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.models.llama import (LlamaAttention, LlamaForCausalLM, LlamaMLP, Rope,
                                    head_dim_of, input_norm, run_mlp)

SLIDING, FULL = "sliding_attention", "full_attention"


class ScaledEmbedding(VocabParallelEmbedding):
    """Token embeddings times `scale`, rounded to the weights' dtype first (as transformers'
    Gemma embedding multiplies by a tensor of that dtype)."""

    def __init__(self, vocab_size: int, hidden_size: int, ctx: ParallelContext, scale: float
                 ) -> None:
        super().__init__(vocab_size, hidden_size, ctx)
        self.scale = scale

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        hidden = super().forward(input_ids)
        # A Python number, not a tensor: no host-to-device copy inside a captured CUDA graph.
        return hidden * float(torch.tensor(self.scale, dtype=hidden.dtype))


def gemma_activation(config: Any) -> str:
    return (getattr(config, "hidden_activation", None) or getattr(config, "hidden_act", None)
            or "gelu_pytorch_tanh")


class GemmaForCausalLM(LlamaForCausalLM):
    """Gemma 2B / 7B (and CodeGemma): Llama's layers with the changes in the module doc."""

    # Made-up weights (load_format "dummy") give norms an offset of 0, a scale of 1.
    stores_norm_offsets = True

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__(config, parallel)
        if self.parallel.is_first_stage:
            self.model.embed_tokens = ScaledEmbedding(config.vocab_size, config.hidden_size,
                                                      self.parallel, config.hidden_size ** 0.5)
        self.final_logit_softcap = getattr(config, "final_logit_softcapping", None)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, layer_idx, parallel=self.parallel,
                        hidden_act=gemma_activation(config))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        logits = super().compute_logits(hidden)
        cap = self.final_logit_softcap
        if logits is not None and cap:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(_norms_from_offsets(weights), require_all=require_all)


def _norms_from_offsets(weights: Iterable[tuple[str, torch.Tensor]]
                        ) -> Iterator[tuple[str, torch.Tensor]]:
    """Gemma stores each RMSNorm weight as its offset from 1: give the norm 1 + w (float32)."""
    for name, tensor in weights:
        if name.endswith("norm.weight"):
            tensor = tensor.float() + 1.0
        yield name, tensor


class Gemma2DecoderLayer(nn.Module):
    """Gemma 2 and 3: norm -> attention -> norm, added to the residual; norm -> MLP -> norm,
    added to the residual. The additions ride on the next norm's fused add (as in
    `LlamaDecoderLayer`)."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module, *,
                 local_rope: bool) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        hidden = config.hidden_size
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.pre_feedforward_layernorm = RMSNorm(hidden, eps)
        self.mlp = mlp
        self.post_feedforward_layernorm = RMSNorm(hidden, eps)
        self.local_rope = local_rope  # read by LlamaModel: which RoPE table this layer takes

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.post_attention_layernorm(self.self_attn(rope, hidden, kv_cache, meta))
        hidden, residual = self.pre_feedforward_layernorm(hidden, residual)
        hidden = run_mlp(self.mlp, hidden, meta)
        return self.post_feedforward_layernorm(hidden), residual


def layer_types(config: Any) -> list[str]:
    types = list(getattr(config, "layer_types", None) or [])
    if len(types) != config.num_hidden_layers or set(types) - {SLIDING, FULL}:
        raise ValueError(f"layer_types must list {config.num_hidden_layers} entries of "
                         f"{SLIDING!r} / {FULL!r}, got {types}")
    return types


def rope_of(config: Any, layer_type: str) -> tuple[float, dict[str, Any]]:
    """(theta, scaling) of one kind of layer: transformers 5's per-kind `rope_parameters`, or
    the older `rope_theta` + `rope_scaling` (full) and `rope_local_base_freq` (windowed)."""
    params = getattr(config, "rope_parameters", None) or {}
    if layer_type in params:
        kind = dict(params[layer_type])
        return float(kind.get("rope_theta", 10000.0)), kind
    if layer_type == SLIDING:
        return float(getattr(config, "rope_local_base_freq", 10000.0)), {}
    return rope_settings(config)


class PerLayerWindows:
    """Models whose `layer_types` (in `_types`, checked by `layer_types`) mix sliding-window and
    full attention layers (Gemma 2 and 3, OLMo 3)."""

    _types: list[str]
    config: Any

    def _window_of(self, config: Any, layer_idx: int) -> int | None:
        return config.sliding_window if self._types[layer_idx] == SLIDING else None

    @property
    def layer_sliding_window(self) -> int | None:
        """The windowed layers' window (None when every layer is full): what
        `disable_sliding_window` caps sequences at. The model-wide `sliding_window` stays None,
        since the full layers see everything."""
        return self.config.sliding_window if SLIDING in self._types else None


class Gemma2ForCausalLM(PerLayerWindows, GemmaForCausalLM):
    """Gemma 2 2B / 9B / 27B."""

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        if getattr(config, "use_bidirectional_attention", False):
            raise ValueError("use_bidirectional_attention is not supported (an encoder setting)")
        self._types = layer_types(config)  # checked before any weight is built
        super().__init__(config, parallel)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx,
                              scale=float(config.query_pre_attn_scalar) ** -0.5,
                              layer_window=self._window_of(config, layer_idx),
                              softcap=getattr(config, "attn_logit_softcapping", None) or None,
                              parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return Gemma2DecoderLayer(config, self.make_attention(config, layer_idx),
                                  self.make_mlp(config, layer_idx),
                                  local_rope=self._types[layer_idx] == SLIDING)


class RopePerLayerKind(PerLayerWindows):
    """Windowed and full layers each with their own RoPE table (`rope_of`: Gemma 3, OLMo 3):
    the model's `__init__` calls `install_rope_tables` once its layers are built."""

    model: Any

    def uses_rope(self, config: Any) -> bool:
        return False  # the two tables come from install_rope_tables

    def install_rope_tables(self, config: Any) -> None:
        d, max_pos = head_dim_of(config), config.max_position_embeddings
        self.model.rotary_emb = build_rotary(d, max_pos, *rope_of(config, FULL))
        self.model.local_rotary_emb = build_rotary(d, max_pos, *rope_of(config, SLIDING))


class Gemma3ForCausalLM(RopePerLayerKind, Gemma2ForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        if getattr(config, "attn_logit_softcapping", None):
            raise ValueError("attn_logit_softcapping is not supported (Gemma 3 sets none)")
        super().__init__(config, parallel)
        self.install_rope_tables(config)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=True,
                              scale=float(config.query_pre_attn_scalar) ** -0.5,
                              layer_window=self._window_of(config, layer_idx),
                              parallel=self.parallel)
