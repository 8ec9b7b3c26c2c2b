"""Llama's attention block over the paged KV cache, which most families build on (options for
their differences: biases, q/k norms, ALiBi, scales, per-layer windows, soft-capping)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ksana_llm.layers.attention import (AttentionMetadata, KVCache, kernel_kv_write,
                                        paged_attention)
from ksana_llm.layers.fused_kernels import fused_kernels_on
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.norm import RMSNorm
from ksana_llm.layers.parallel import (SINGLE, RowParallelLinear, check_heads_divisible,
                                       kv_head_shard)
from ksana_llm.layers.rotary import apply_rotary

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions: [T, 1, D/2]


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    """Multi-head / grouped-query attention over the paged KV cache.

    The options cover the families built on this block: `qkv_bias` / `o_bias` override the
    config's `attention_bias` (Qwen2 and Qwen v1 bias q/k/v but not the output); `qk_norm` adds
    RMSNorm over each head of q and k before RoPE (Qwen3, Gemma 3); `alibi_slopes`
    ([num_heads]) replaces RoPE with ALiBi position biases (Baichuan-13B); `scale` replaces
    head_dim^-0.5 (Gemma's query_pre_attn_scalar^-0.5); `layer_window` is this layer's own
    sliding window where layers differ (Gemma 2, 3); `softcap` caps the attention logits at
    softcap * tanh(logit / softcap) (Gemma 2); `sinks` adds a learned logit per head to the
    softmax's denominator (GPT-OSS: `self_attn.sinks`, this rank's heads' under tensor
    parallelism).

    Under tensor parallelism each rank keeps num_heads / tp query heads and the KV heads they
    read (split, or replicated when there are fewer KV heads than ranks); `o_proj` sums the
    ranks' partial outputs.
    """

    accepts_lora = True  # its projections apply the step's LoRA adapters (meta.lora)
    # OLMo 2: `q_norm` / `k_norm` are one RMSNorm over all of q's heads and one over k's, applied
    # to the projections as they come (models/olmo2.py).
    norms_whole_projections = False

    def __init__(self, config: Any, layer_idx: int = 0, *, qkv_bias: bool | None = None,
                 o_bias: bool | None = None, qk_norm: bool = False,
                 alibi_slopes: torch.Tensor | None = None, scale: float | None = None,
                 layer_window: int | None = None, softcap: float | None = None,
                 sinks: bool = False, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        total_heads = config.num_attention_heads
        total_kv_heads = getattr(config, "num_key_value_heads", None) or total_heads
        if total_heads % total_kv_heads:  # else it surfaces later as a puzzling weight shape
            raise ValueError(f"num_attention_heads ({total_heads}) must be a multiple of "
                             f"num_key_value_heads ({total_kv_heads})")
        check_heads_divisible(total_heads, parallel)
        self.num_heads = total_heads // parallel.tp_size
        first_kv, self.num_kv_heads = kv_head_shard(total_kv_heads, parallel)
        self.head_dim = d = head_dim_of(config)
        self.scale = d ** -0.5 if scale is None else scale
        self.layer_window = layer_window
        self.softcap = softcap
        self.sinks = (nn.Parameter(torch.zeros(self.num_heads), requires_grad=False) if sinks
                      else None)
        bias = bool(getattr(config, "attention_bias", False))
        self.split = (self.num_heads * d, self.num_kv_heads * d, self.num_kv_heads * d)
        q_shard = (parallel.tp_rank * self.num_heads * d, self.num_heads * d)
        kv_shard = (first_kv * d, self.num_kv_heads * d)
        self.qkv_proj = MergedLinear(config.hidden_size,
                                     [total_heads * d, total_kv_heads * d, total_kv_heads * d],
                                     bias=bias if qkv_bias is None else qkv_bias,
                                     shards=[q_shard, kv_shard, kv_shard])
        self.o_proj = RowParallelLinear(total_heads * d, config.hidden_size,
                                        bias=bias if o_bias is None else o_bias, ctx=parallel)
        if alibi_slopes is not None:
            first_head = parallel.tp_rank * self.num_heads
            alibi_slopes = alibi_slopes[first_head:first_head + self.num_heads]
        if qk_norm:
            eps = getattr(config, "rms_norm_eps", 1e-6)
            self.q_norm = RMSNorm(self.head_dim, eps)
            self.k_norm = RMSNorm(self.head_dim, eps)
        self.qk_norm = qk_norm
        self.layer_idx = layer_idx  # picks this layer's FP8 cache scale from the metadata
        # A plain CPU tensor, not a buffer: models are built on the meta device and a buffer
        # would come out of `to_empty` uninitialised. Moved to the device on first use.
        self._alibi_slopes = None if alibi_slopes is None else alibi_slopes.float().cpu()
        # The sinks in float32, as every attention path reads them (`sinks_in_float32`), and the
        # address of the parameter they were copied from.
        self._float_sinks: torch.Tensor | None = None
        self._float_sinks_source: int | None = None

    def _norm_weights(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(q_norm, k_norm) weights for the fused norm + RoPE kernel, or None when there are no
        q/k norms or the kernel cannot stand in for them (weights in another dtype, or the two
        norms' eps differ, or they multiply their weights in float32, which that kernel does not)."""
        if not self.qk_norm or self.q_norm.eps != self.k_norm.eps or self.q_norm.weight_in_float32:
            return None
        weights = (self.q_norm.weight, self.k_norm.weight)
        return weights if all(w.dtype == dtype for w in weights) else None

    def _slopes_on(self, device: torch.device) -> torch.Tensor | None:
        slopes = self._alibi_slopes
        if slopes is not None and slopes.device != device:
            slopes = self._alibi_slopes = slopes.to(device)
        return slopes

    def sinks_in_float32(self, refresh: bool = False) -> torch.Tensor | None:
        """The sink logits as float32: the parameter itself when it is float32, else a copy
        converted once rather than per layer per step. The copy stays at one address (captured
        CUDA graphs read it there), copied again in place when the parameter has moved or been
        cast, or when asked (`refresh`): the model's `prepare_for_inference`, which every load
        and weight update ends with, does -- the loader writes parameters through `.data`, which
        no version counter sees."""
        sinks = self.sinks
        if sinks is None or sinks.dtype == torch.float32:
            return sinks
        copy = self._float_sinks
        if copy is None or copy.device != sinks.device or copy.shape != sinks.shape:
            copy = self._float_sinks = torch.empty(sinks.shape, dtype=torch.float32,
                                                   device=sinks.device)
            refresh = True
        if refresh or self._float_sinks_source != sinks.data_ptr():
            with torch.no_grad():
                copy.copy_(sinks)
            self._float_sinks_source = sinks.data_ptr()
        return copy

    def forward(self, rope: Rope | None, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = hidden.shape[0]
        q, k, v = self.qkv_proj(hidden, meta.lora).split(self.split, dim=-1)
        if self.norms_whole_projections:
            q, k = self.q_norm(q), self.k_norm(k)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        slopes = self._slopes_on(q.device)
        # No table: a layer without positions in q/k (ALiBi's, or SmolLM3's NoPE layers).
        rotate = slopes is None and rope is not None
        write_kv = None
        if rotate and fused_kernels_on():  # in-place RoPE
            from ksana_llm import kernels

            # q, k are views of this step's fresh QKV output. In the same launch: Qwen3's q/k
            # norms when their weights have q's dtype (they do once the model is cast), and the
            # store of K/V into the paged cache when the attention reads it with the kernels.
            norms = self._norm_weights(q.dtype)
            if self.qk_norm and norms is None:
                q, k = self.q_norm(q), self.k_norm(k)
            write_kv = kernel_kv_write(v, kv_cache, meta, k.dtype)
            kernels.apply_rotary_(q, k, *rope, norm_weights=norms,
                                  eps=self.q_norm.eps if norms is not None else 1e-6,
                                  write_kv=write_kv)
        else:
            if self.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            if rotate:
                q, k = apply_rotary(q, *rope), apply_rotary(k, *rope)
        out = paged_attention(q, k, v, kv_cache, meta, self.scale, alibi_slopes=slopes,
                              kv_scale=meta.kv_scale(self.layer_idx),
                              kv_stored=write_kv is not None, layer_window=self.layer_window,
                              softcap=self.softcap, sinks=self.sinks_in_float32())
        return self.o_proj(out.reshape(num_tokens, -1), meta.lora)
