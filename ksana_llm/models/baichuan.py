"""Baichuan 1 and 2 (remote-code checkpoints) on the Llama block.

All four released sizes store q/k/v as one `W_pack` matmul without bias (renamed onto our fused
`qkv_proj` by `loader/weight_maps/baichuan_weight_map.json`). They differ in two ways:
- positions: the 7B models (hidden 4096) use RoPE, the 13B models (hidden 5120) use ALiBi with
  Baichuan's slopes (`_get_interleave`) and no RoPE;
- LM head: Baichuan2's `NormHead` divides every row of the head by its L2 norm (once, at its
  first eval forward); we do it once at load.
Neither choice is written in the released configs, so we infer it the way vLLM does (hidden size;
Baichuan2's vocabulary of 125696) and let a config key state it outright, which tiny test
checkpoints (and any oddly sized fine-tune) need:
- `position_embedding`: "rope" or "alibi";
- `normalize_lm_head`: true or false.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from types import SimpleNamespace
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM

BAICHUAN2_VOCAB_SIZE = 125696
ROPE_HIDDEN_SIZE = 4096  # Baichuan-7B and Baichuan2-7B; the 13B models (5120) use ALiBi
_POSITION_EMBEDDINGS = ("rope", "alibi")


def alibi_slopes(num_heads: int) -> torch.Tensor:
    """Baichuan's ALiBi slopes ([num_heads] float32, on the CPU): the geometric sequence
    2^(-8/n), 2^(-16/n), ... for n a power of two; otherwise those of the largest power of two
    below `num_heads`, followed by every other slope of twice that power (Press et al.; Bloom
    uses the same)."""
    def power_of_two(n: int) -> list[float]:
        start = 2.0 ** (-(2.0 ** -(math.log2(n) - 3)))
        return [start ** (i + 1) for i in range(n)]

    def slopes(n: int) -> list[float]:
        if math.log2(n).is_integer():
            return power_of_two(n)
        closest = 2 ** math.floor(math.log2(n))
        return power_of_two(closest) + slopes(2 * closest)[0::2][:n - closest]

    if num_heads < 1:
        raise ValueError(f"num_attention_heads must be >= 1, got {num_heads}")
    # device="cpu": models are built under the meta device, and slopes are data, not weights.
    return torch.tensor(slopes(num_heads), dtype=torch.float32, device="cpu")


def _position_embedding(config: Any) -> str:
    stated = getattr(config, "position_embedding", None)
    if stated is None:
        return "rope" if config.hidden_size == ROPE_HIDDEN_SIZE else "alibi"
    value = str(stated).lower()
    if value not in _POSITION_EMBEDDINGS:
        raise ValueError(f"position_embedding must be one of {_POSITION_EMBEDDINGS}, got {stated!r}")
    return value


def _normalize_lm_head(config: Any) -> bool:
    stated = getattr(config, "normalize_lm_head", None)
    if stated is None:
        return config.vocab_size == BAICHUAN2_VOCAB_SIZE
    if not isinstance(stated, bool):
        # A config.json value, i.e. user input: ValueError like every other config check.
        raise ValueError(f"normalize_lm_head must be true or false, got {stated!r}")  # noqa: TRY004
    return stated


def _baichuan_view(config: Any) -> SimpleNamespace:
    """Baichuan's config keys as the Llama keys our layers read."""
    def get(key: str, default: Any = None) -> Any:
        return getattr(config, key, default)

    heads = config.num_attention_heads
    return SimpleNamespace(
        vocab_size=config.vocab_size, hidden_size=config.hidden_size,
        num_hidden_layers=config.num_hidden_layers, num_attention_heads=heads,
        num_key_value_heads=heads, head_dim=config.hidden_size // heads,
        intermediate_size=config.intermediate_size, rms_norm_eps=get("rms_norm_eps", 1e-6),
        # The 13B configs state only model_max_length.
        max_position_embeddings=get("max_position_embeddings") or get("model_max_length") or 4096,
        rope_theta=10000.0, hidden_act=get("hidden_act", "silu"),
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False,
        position_embedding=_position_embedding(config),
        normalize_lm_head=_normalize_lm_head(config),
        # GPTQ / AWQ checkpoints: the MLP's split follows their groups
        quantization_config=get("quantization_config"))


class BaichuanForCausalLM(LlamaForCausalLM):
    """Baichuan-7B / 13B and Baichuan2-7B / 13B (base and chat)."""

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        view = _baichuan_view(config)
        super().__init__(view, parallel)
        self.original_config = config

    def uses_rope(self, config: Any) -> bool:
        return config.position_embedding == "rope"

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        slopes = None if config.position_embedding == "rope" else alibi_slopes(config.num_attention_heads)
        return LlamaAttention(config, layer_idx, alibi_slopes=slopes,
                              parallel=self.parallel)

    @property
    def max_context(self) -> int:
        return int(self.config.max_position_embeddings)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        filled = super().load_weights(weights, require_all=require_all)
        if self.config.normalize_lm_head:
            with torch.no_grad():
                weight = self.lm_head.weight
                weight.copy_(nn.functional.normalize(weight.float(), dim=-1))
            self.prepare_for_inference()  # the transposed head copy must see the new rows
        return filled
