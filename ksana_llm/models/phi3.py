"""Phi-3 and Phi-4 (`Phi3ForCausalLM`): Llama's layers with fused checkpoint projections.

The checkpoint stores q/k/v as one `qkv_proj` and gate/up as one `gate_up_proj` (gate first),
the layout of our own fused matmuls; they are split into their parts as they load, so tensor
parallelism shards them like any Llama's. `sliding_window` applies to every layer, as in
transformers' Phi-3 (2047 in Phi-3-mini-4k's config, null in Phi-4's).

RoPE may cover only the first `partial_rotary_factor` of each head (Phi-4-mini: 0.75), and may
be LongRoPE (`rope_scaling` type "longrope" / "su": the 128k-context Phi-3, Phi-3.5 and
Phi-4-mini), whose factors switch with the sequence's length (layers.rotary_longrope).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.rotary import partial_rotary_dim, rope_settings
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.models.llama import MistralForCausalLM, head_dim_of


class Phi3ForCausalLM(MistralForCausalLM):
    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        rotary_dim = partial_rotary_dim(config, head_dim_of(config))  # checked before the weights
        super().__init__(config, parallel)
        theta, scaling = rope_settings(config)
        if "original_max_position_embeddings" not in scaling and \
                getattr(config, "original_max_position_embeddings", None):
            # transformers 4.x kept it beside rope_scaling, not in it.
            scaling["original_max_position_embeddings"] = config.original_max_position_embeddings
        self.model.rotary_emb = build_rotary(rotary_dim, config.max_position_embeddings, theta,
                                             scaling)

    def uses_rope(self, config: Any) -> bool:
        return False  # a table over the rotary dims only, installed in __init__

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(split_fused_checkpoint_tensors(weights, self.config),
                                    require_all=require_all)


def split_fused_checkpoint_tensors(weights: Iterable[tuple[str, torch.Tensor]], config: Any
                                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """`qkv_proj` -> q_proj, k_proj, v_proj and `gate_up_proj` -> gate_proj, up_proj (rows in
    that order), so that each part lands in this rank's shard of our fused matmul (Phi-3; GLM's
    gate_up_proj). A quantized checkpoint's weights (GPTQ, AWQ, FP8: `QuantizedWeight`, rows
    first) split the same way."""
    d = head_dim_of(config)
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    qkv_rows = [config.num_attention_heads * d, kv_heads * d, kv_heads * d]
    for name, tensor in weights:
        if name.endswith(".self_attn.qkv_proj.weight"):
            prefix = name[:-len("qkv_proj.weight")]
            if tensor.shape[0] != sum(qkv_rows):
                raise ValueError(f"checkpoint tensor {name!r}: {tensor.shape[0]} rows, "
                                 f"expected {sum(qkv_rows)} (q, k, v heads x head_dim)")
            for part, piece in zip(("q_proj", "k_proj", "v_proj"), split_rows(tensor, qkv_rows)):
                yield f"{prefix}{part}.weight", piece
        elif name.endswith(".mlp.gate_up_proj.weight"):
            prefix = name[:-len("gate_up_proj.weight")]
            if tensor.shape[0] != 2 * config.intermediate_size:
                raise ValueError(f"checkpoint tensor {name!r}: {tensor.shape[0]} rows, "
                                 f"expected {2 * config.intermediate_size} (gate, up)")
            gate, up = split_rows(tensor, [config.intermediate_size] * 2)
            yield f"{prefix}gate_proj.weight", gate
            yield f"{prefix}up_proj.weight", up
        else:
            yield name, tensor


def split_rows(tensor: torch.Tensor | QuantizedWeight, sizes: list[int]
                ) -> list[torch.Tensor | QuantizedWeight]:
    """A dense tensor's or a quantized checkpoint's weight's rows, in parts of `sizes`."""
    if isinstance(tensor, QuantizedWeight):
        return tensor.split_rows(sizes)
    return list(torch.split(tensor, sizes))
