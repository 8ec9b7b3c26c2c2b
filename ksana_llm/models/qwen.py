"""The Qwen families on the Llama block.

- Qwen2 (also Qwen1.5 and Qwen2.5, which ship as `Qwen2ForCausalLM`): q/k/v carry a bias, the
  output projection does not.
- Qwen3: RMSNorm over each head of q and k before RoPE; `head_dim` need not be hidden / heads.
- Qwen (v1, `QWenLMHeadModel`, remote code): one fused `c_attn` with a bias, its own config key
  names. Its checkpoint names are mapped onto ours by `loader/weight_maps/qwen_weight_map.json`;
  its config is read here into the Llama keys our layers use.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM


def uniform_sliding_window(config: Any) -> int | None:
    """The sliding window of a Qwen2/Qwen3 config, which must be the same for every layer.

    transformers keeps `sliding_window` set (and `use_sliding_window` false) in most released
    configs, and marks the windowed layers in `layer_types`; only those layers use the window.
    Our runner applies one window to the whole model, so a mix of windowed and full layers is
    refused rather than served wrong.
    """
    window = getattr(config, "sliding_window", None)
    if not window or not getattr(config, "use_sliding_window", False):
        return None
    types = list(getattr(config, "layer_types", None) or [])
    if not types:  # older configs: layers from max_window_layers on use the window
        first = getattr(config, "max_window_layers", 0)
        types = ["sliding_attention" if i >= first else "full_attention"
                 for i in range(config.num_hidden_layers)]
    if all(t == "full_attention" for t in types):
        return None
    if all(t == "sliding_attention" for t in types):
        return int(window)
    raise ValueError(
        f"use_sliding_window with max_window_layers={getattr(config, 'max_window_layers', None)} "
        f"mixes windowed and full-attention layers (layer_types={types}); only a window on every "
        "layer (max_window_layers=0) or none (use_sliding_window=false) is supported")


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Qwen1.5 / Qwen2 / Qwen2.5."""

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        window = uniform_sliding_window(config)  # validates before any weight is built
        super().__init__(config, parallel)
        self._window = window

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qkv_bias=True, o_bias=False,
                              parallel=self.parallel)

    @property
    def sliding_window(self) -> int | None:
        return self._window


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Qwen3 dense models; biases follow `attention_bias` (false in released checkpoints)."""

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        window = self.window_of(config)
        super().__init__(config, parallel)
        self._window = window

    @staticmethod
    def window_of(config: Any) -> int | None:
        """The config's sliding window (validated before any weight is built)."""
        return uniform_sliding_window(config)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qk_norm=True, parallel=self.parallel)

    @property
    def sliding_window(self) -> int | None:
        return self._window


def _qwen_v1_view(config: Any) -> SimpleNamespace:
    """Qwen v1's config keys as the Llama keys our layers read. Refuses what we do not run."""
    def get(key: str, default: Any = None) -> Any:
        return getattr(config, key, default)

    heads, hidden = config.num_attention_heads, config.hidden_size
    head_dim = get("kv_channels") or hidden // heads
    if head_dim * heads != hidden:
        # QWenAttention splits c_attn's output in hidden-sized thirds and heads of
        # hidden // heads; any other kv_channels has no consistent meaning there.
        raise ValueError(f"kv_channels={head_dim} times num_attention_heads={heads} must equal "
                         f"hidden_size={hidden}")
    if float(get("rotary_pct", 1.0)) != 1.0:
        raise ValueError(f"rotary_pct={get('rotary_pct')} is not supported (only 1.0: RoPE on the "
                         "whole head, as in every released Qwen v1 model)")
    if not get("scale_attn_weights", True):
        raise ValueError("scale_attn_weights=false is not supported (released Qwen v1 models "
                         "scale attention by 1/sqrt(head_dim))")
    seq_length = get("seq_length") or get("max_position_embeddings") or 2048
    return SimpleNamespace(
        vocab_size=config.vocab_size, hidden_size=hidden, num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=heads, num_key_value_heads=heads, head_dim=head_dim,
        # Qwen v1 states the width of w1 and w2 together: each is half of intermediate_size.
        intermediate_size=config.intermediate_size // 2,
        rms_norm_eps=get("layer_norm_epsilon", 1e-6),
        max_position_embeddings=max(get("max_position_embeddings") or 0, seq_length),
        rope_theta=float(get("rotary_emb_base", 10000.0)), hidden_act="silu",
        tie_word_embeddings=bool(get("tie_word_embeddings", False)),
        attention_bias=False, mlp_bias=False, seq_length=seq_length,
        # GPTQ checkpoints (Qwen-7B/14B/72B-Chat-Int4): the MLP's split follows their groups
        quantization_config=get("quantization_config"))


class QWenLMHeadModel(LlamaForCausalLM):
    """Qwen v1 (Qwen-1.8B/7B/14B/72B and their chat models).

    Context limit: released configs turn on `use_dynamic_ntk` and `use_logn_attn`. Both change
    nothing until a sequence grows past `seq_length` (the training length): NTK rescales RoPE
    from the prompt's length and logn scales queries by log(position) / log(seq_length) only
    beyond it. We do not implement them, so with either flag on the model's context is capped
    at `seq_length` (`max_context`), where our output is exactly the original's.
    """

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        view = _qwen_v1_view(config)
        super().__init__(view, parallel)
        self.original_config = config

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        # c_attn has a bias whatever `no_bias` says; c_proj has none.
        return LlamaAttention(config, layer_idx, qkv_bias=True, o_bias=False,
                              parallel=self.parallel)

    @property
    def max_context(self) -> int:
        original = self.original_config
        if getattr(original, "use_dynamic_ntk", False) or getattr(original, "use_logn_attn", False):
            return int(self.config.seq_length)
        return int(self.config.max_position_embeddings)
