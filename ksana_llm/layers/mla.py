"""Multi-head latent attention (DeepSeek-V2 / V3 / R1) over the paged KV cache.

Per token MLA keeps one compressed latent instead of per-head keys and values:
`c_kv = kv_a_layernorm(kv_a_proj(x)[:r])` (r = kv_lora_rank) and one shared roped key part `k_pe`
(rope dim dr). The cache holds `[c_kv | k_pe]` — `r + dr` numbers per token, one "KV head", no V
cache (`KVCacheSpec(1, r + dr, v_head_dim=0)`): 576 numbers per token per layer for DeepSeek-V3
instead of 128 heads x (192 + 128).

`kv_b_proj` expands a latent into per-head `k_nope` (W_UK [H, dn, r]) and values (W_UV [H, dv, r]).
Two exact ways to attend:
- absorbed (decode; short prefill chunks): fold W_UK into the query,
  `q_lat[h] = q_nope[h] @ W_UK[h]`, so scores are `[q_lat | q_pe] . [c_kv | k_pe]` straight against
  the cache; the output stays in latent space, `o_lat[h] = sum_t p[h, t] c_kv[t]`, and W_UV maps
  it to `v_head_dim` afterwards. Nothing per head is ever materialised per cached token.
- expanded (long prefill chunks): run `kv_b_proj` over the context's latents and do ordinary
  multi-head attention. Expanding costs a fixed amount per cached token, absorbed attention more
  per query row, so chunks with enough rows (`expand_min_tokens`) take this form.
W_UK and W_UV are views of `kv_b_proj.weight`: no second copy of the weights.
Decodes attend in one call per group; so do short chunks of one length over cached contexts
(`AttentionMetadata.chunk_batches`: speculative decoding's verify slices), whose (row, head)
pairs act as the query positions of one latent "head", as a decode's heads do.

On the Triton backend both forms give way to the absorbed one through the paged attention
kernels, the latent serving as the one KV head every query head shares and the values as a view
of its first r columns (`_kernel_attention`).

Under tensor parallelism each rank keeps num_heads / tp heads: its rows of the query projection
(`q_b_proj` or `q_proj`) and of `kv_b_proj`, and its columns of `o_proj` (whose partial outputs
are summed). The down-projections and their norms are small and replicated, so every rank
computes and caches the same latents: the cache is not split, as in vLLM's MLA.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from ksana_llm.kernels.kv_quant import through_cache
from ksana_llm.layers.attention import AttentionMetadata, ChunkBatch, KVCache, KVCacheSpec
from ksana_llm.layers.kv_cache_layout import gather_kv, store_kv
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.norm import RMSNorm
from ksana_llm.layers.parallel import SINGLE, RowParallelLinear, check_heads_divisible
from ksana_llm.layers.rotary import apply_rotary, rope_settings
from ksana_llm.layers.rotary_yarn import mla_softmax_scale

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin for this step's positions: [T, 1, dr/2]

# The q_a / kv_a down-projections both read the hidden state: one matmul (`qkv_a_proj`) when the
# query is low-rank. checkpoint part -> (fused parameter, part index); see MLADims.fused_parts.
MLA_FUSED_PARTS = MappingProxyType({
    "q_a_proj": ("qkv_a_proj", 0), "kv_a_proj_with_mqa": ("qkv_a_proj", 1),
})

# transformers (and DeepSeek's reference) build q_a_layernorm / kv_a_layernorm with the default
# eps, not config.rms_norm_eps.
_LATENT_NORM_EPS = 1e-6


@dataclass(frozen=True)
class MLADims:
    num_heads: int
    q_lora_rank: int | None  # None: a plain full-rank q_proj
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def from_config(cls, config: Any) -> MLADims:
        dims = cls(int(config.num_attention_heads), getattr(config, "q_lora_rank", None) or None,
                   int(config.kv_lora_rank), int(config.qk_nope_head_dim),
                   int(config.qk_rope_head_dim), int(config.v_head_dim))
        for name in ("num_heads", "kv_lora_rank", "qk_nope_head_dim", "v_head_dim"):
            if getattr(dims, name) <= 0:
                raise ValueError(f"{name} must be positive, got {getattr(dims, name)}")
        if dims.qk_rope_head_dim <= 0 or dims.qk_rope_head_dim % 2:
            raise ValueError(f"qk_rope_head_dim must be a positive even number, "
                             f"got {dims.qk_rope_head_dim}")
        return dims

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Numbers cached per token: the latent plus the shared roped key."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def fused_parts(self) -> Mapping[str, tuple[str, int]]:
        """Checkpoint parts that load into a fused parameter (for `load_checkpoint`)."""
        return MLA_FUSED_PARTS if self.q_lora_rank is not None else MappingProxyType({})

    def cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(1, self.latent_dim, v_head_dim=0)

    def expand_min_tokens(self) -> float:
        """Query rows from which a prefill chunk is cheaper expanded than absorbed.

        Per cached token, expanding costs r * (dn + dv) once (kv_b_proj) plus n * (dn + dr + dv)
        for n query rows; absorbed attention costs n * (2r + dr). Expanded wins for
        n > r (dn + dv) / (2r - dn - dv): 170 rows for DeepSeek-V3."""
        r, spread = self.kv_lora_rank, self.qk_nope_head_dim + self.v_head_dim
        return math.inf if 2 * r <= spread else r * spread / (2 * r - spread)


def apply_rotary_interleaved(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """RoPE on interleaved pairs (x0, x1), (x2, x3), ...; the result comes out de-interleaved
    (all rotated evens, then all rotated odds), as in transformers. q and k get the same layout,
    so their dot products are unchanged."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class MultiLatentAttention(nn.Module):
    """DeepSeek MLA; parameter names are the checkpoint's (`q_a_proj` and `kv_a_proj_with_mqa`
    load into `qkv_a_proj` through MLA_FUSED_PARTS)."""

    def __init__(self, config: Any, layer_idx: int = 0, *,
                 parallel: ParallelContext = SINGLE, interleaved_rope: bool | None = None
                 ) -> None:
        """`interleaved_rope`: the rope dims pair up as (0, 1), (2, 3), ...; None reads the
        config's `rope_interleave` (DeepSeek-V3's field; V2 always interleaves)."""
        super().__init__()
        full = MLADims.from_config(config)
        check_heads_divisible(full.num_heads, parallel)
        d = self.dims = dataclasses.replace(full, num_heads=full.num_heads // parallel.tp_size)
        first_head = parallel.tp_rank * d.num_heads
        hidden = config.hidden_size
        bias = bool(getattr(config, "attention_bias", False))

        def heads_of(in_features: int, per_head: int) -> MergedLinear:
            """This rank's heads' rows of a [num_heads * per_head, in] projection."""
            return MergedLinear(in_features, [full.num_heads * per_head],
                                shards=[(first_head * per_head, d.num_heads * per_head)])

        if d.q_lora_rank is None:
            self.q_proj = heads_of(hidden, d.qk_head_dim)
            self.kv_a_proj_with_mqa = nn.Linear(hidden, d.latent_dim, bias=bias)
        else:
            self.qkv_a_proj = MergedLinear(hidden, [d.q_lora_rank, d.latent_dim], bias=bias)
            self.q_a_layernorm = RMSNorm(d.q_lora_rank, _LATENT_NORM_EPS)
            self.q_b_proj = heads_of(d.q_lora_rank, d.qk_head_dim)
        self.kv_a_layernorm = RMSNorm(d.kv_lora_rank, _LATENT_NORM_EPS)
        self.kv_b_proj = heads_of(d.kv_lora_rank, d.qk_nope_head_dim + d.v_head_dim)
        # Decode multiplies by views of this weight (W_UK, W_UV): it must stay a dense matrix.
        self.kv_b_proj.quantized_capable = False
        self.o_proj = RowParallelLinear(full.num_heads * d.v_head_dim, hidden, bias=bias,
                                        ctx=parallel)
        _, scaling = rope_settings(config)
        self.scale = mla_softmax_scale(d.qk_head_dim, scaling, config.max_position_embeddings)
        self.interleaved_rope = (bool(getattr(config, "rope_interleave", False))
                                 if interleaved_rope is None else interleaved_rope)
        # Prefill chunks with at least this many rows attend in the expanded form.
        self.expand_min_tokens: float = d.expand_min_tokens()
        self.layer_idx = layer_idx  # picks this layer's FP8 cache scale from the metadata

    # ---- pieces -----------------------------------------------------------------------------
    def _w_uk_uv(self) -> tuple[torch.Tensor, torch.Tensor]:
        """W_UK [H, dn, r] and W_UV [H, dv, r], views of kv_b_proj.weight."""
        d = self.dims
        w = self.kv_b_proj.weight.view(d.num_heads, d.qk_nope_head_dim + d.v_head_dim,
                                       d.kv_lora_rank)
        return w[:, :d.qk_nope_head_dim], w[:, d.qk_nope_head_dim:]

    def _rotate(self, x: torch.Tensor, rope: Rope) -> torch.Tensor:
        return (apply_rotary_interleaved if self.interleaved_rope else apply_rotary)(x, *rope)

    def _project(self, hidden: torch.Tensor, rope: Rope
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q_nope [T, H, dn], q_pe [T, H, dr] roped, cache entries [T, r + dr])."""
        d = self.dims
        if d.q_lora_rank is None:
            q, latent = self.q_proj(hidden), self.kv_a_proj_with_mqa(hidden)
        else:
            q_a, latent = self.qkv_a_proj(hidden).split([d.q_lora_rank, d.latent_dim], dim=-1)
            q = self.q_b_proj(self.q_a_layernorm(q_a))
        q = q.view(hidden.shape[0], d.num_heads, d.qk_head_dim)
        q_nope, q_pe = q.split([d.qk_nope_head_dim, d.qk_rope_head_dim], dim=-1)
        c_kv, k_pe = latent.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        k_pe = self._rotate(k_pe.unsqueeze(1), rope).squeeze(1)
        entries = torch.cat((self.kv_a_layernorm(c_kv), k_pe), dim=-1)
        return q_nope, self._rotate(q_pe, rope), entries

    def _absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> torch.Tensor:
        """[q_nope @ W_UK | q_pe]: queries in latent space, [n, H, r + dr]."""
        w_uk, _ = self._w_uk_uv()
        q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [n, H, r]
        return torch.cat((q_lat, q_pe), dim=-1)

    def _unabsorb(self, o_lat: torch.Tensor) -> torch.Tensor:
        """Latent outputs [n, H, r] -> values [n, H, dv] through W_UV."""
        _, w_uv = self._w_uk_uv()
        return torch.bmm(o_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)

    def _expanded_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """Ordinary multi-head attention over the context's expanded keys and values.
        q_*: [n, H, *]; kv: [ctx, r + dr]; returns [n, H, dv]."""
        d = self.dims
        ctx = kv.shape[0]
        c_kv, k_pe = kv.split([d.kv_lora_rank, d.qk_rope_head_dim], dim=-1)
        k_nope, v = self.kv_b_proj(c_kv).view(ctx, d.num_heads, -1).split(
            [d.qk_nope_head_dim, d.v_head_dim], dim=-1)
        k = torch.cat((k_nope, k_pe.unsqueeze(1).expand(ctx, d.num_heads, d.qk_rope_head_dim)), -1)
        q = torch.cat((q_nope, q_pe), dim=-1)
        o = F.scaled_dot_product_attention(
            q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
            is_causal=mask is None and q.shape[0] > 1, scale=self.scale)
        return o.transpose(0, 1)

    def _absorbed_prefill(self, q_nope: torch.Tensor, q_pe: torch.Tensor, kv: torch.Tensor,
                          mask: torch.Tensor | None) -> torch.Tensor:
        """Absorbed attention of n query rows against [ctx, r + dr] latents; returns [n, H, dv]."""
        n, heads = q_nope.shape[0], self.dims.num_heads
        q = self._absorb(q_nope, q_pe).transpose(0, 1)  # [H, n, r + dr]
        k = kv.unsqueeze(0).expand(heads, -1, -1)  # one latent "head" shared by every query head
        o_lat = F.scaled_dot_product_attention(
            q, k, k[..., :self.dims.kv_lora_rank], attn_mask=mask,
            is_causal=mask is None and n > 1, scale=self.scale)
        return self._unabsorb(o_lat.transpose(0, 1))

    def _batched_absorbed(self, q_nope: torch.Tensor, q_pe: torch.Tensor, cache: torch.Tensor,
                          batch: ChunkBatch, kv_scale: float) -> torch.Tensor:
        """Absorbed attention of C chunks of n rows each ([C * n, H, *] queries) against their
        gathered latents. A chunk's rows act as n query "heads" sharing the one latent KV head
        (GQA), and each row's heads as its query positions, so each row's mask is broadcast
        over its heads rather than copied. Returns [C * n, H, dv]."""
        d = self.dims
        num_chunks, n = len(batch.chunks), batch.num_tokens
        q = self._absorb(q_nope, q_pe).view(num_chunks, n, d.num_heads, -1)
        kv = gather_kv(cache, batch.kv_rows, (num_chunks,), dtype=q_nope.dtype,
                       kv_scale=kv_scale)  # [C, 1, L, r + dr]
        o = F.scaled_dot_product_attention(
            q, kv, kv[..., :d.kv_lora_rank], attn_mask=batch.mask[:, :, None, :],
            scale=self.scale, enable_gqa=True)
        return self._unabsorb(o.reshape(num_chunks * n, d.num_heads, d.kv_lora_rank))

    # ---- forward ----------------------------------------------------------------------------
    def _kernel_attention(self, q_nope: torch.Tensor, q_pe: torch.Tensor,
                          entries: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata,
                          kv_scale: float) -> torch.Tensor:
        """The Triton backend: the store kernel writes the step's latents (skipping padding
        rows' slot -1 in CUDA-graph buckets; the spec's V cache is empty), then absorbed
        attention for every row, decodes in one launch and prefill chunks in another, straight
        over the paged latents -- the latent is the one KV "head" every query head shares, and
        the values are a view of its first r columns (no copy). Long prefill chunks stay
        absorbed here (the torch backend expands them). Returns [T, H, dv]."""
        from ksana_llm import kernels  # imports triton: only when this backend was chosen

        cache = kv_cache[0]
        kernels.store_kv(entries.unsqueeze(1), entries[:, None, :0], cache, kv_cache[1],
                         meta.slot_mapping, kv_scale=kv_scale)
        d, batch, nd = self.dims, meta.kernel_batch, meta.num_decodes
        q = self._absorb(q_nope, q_pe)  # [T, H, r + dr]
        values = cache[..., :d.kv_lora_rank]
        o_lat = q.new_empty(q.shape[0], d.num_heads, d.kv_lora_rank)
        if nd:
            kernels.paged_decode_attention(
                q[:nd], cache, values, batch.decode_block_tables, batch.decode_context_lens,
                self.scale, kv_scale=kv_scale, out=o_lat[:nd], order=batch.decode_order)
        if q.shape[0] > nd:
            kernels.paged_prefill_attention(
                q[nd:], cache, values, batch.prefill_block_tables, batch.prefill_query_start_loc,
                batch.prefill_seq_lens, self.scale, kv_scale=kv_scale, out=o_lat[nd:])
        return self._unabsorb(o_lat)

    def forward(self, rope: Rope, hidden: torch.Tensor, kv_cache: KVCache,
                meta: AttentionMetadata) -> torch.Tensor:
        d = self.dims
        num_tokens = hidden.shape[0]
        q_nope, q_pe, entries = self._project(hidden, rope)
        cache = kv_cache[0]  # [blocks, block_size, 1, latent_dim]: one latent "head" per token
        kv_scale = meta.kv_scale(self.layer_idx)
        if meta.kernel_batch is not None:
            out = self._kernel_attention(q_nope, q_pe, entries, kv_cache, meta, kv_scale)
            return self.o_proj(out.reshape(num_tokens, -1))
        store_kv(cache, meta.slot_index(cache.shape[1]), entries.unsqueeze(1), kv_scale)
        cached = {"dtype": entries.dtype, "kv_scale": kv_scale}

        out = hidden.new_empty(num_tokens, d.num_heads, d.v_head_dim)
        if meta.decode_groups:
            # One query row per sequence: the heads act as that row's query positions against the
            # single latent "head" — plain attention, nothing expanded per head.
            nd = meta.num_decodes
            q_abs = self._absorb(q_nope[:nd], q_pe[:nd])  # [nd, H, r + dr]
            o_lat = q_abs.new_empty(nd, d.num_heads, d.kv_lora_rank)
            for g in meta.decode_groups:
                n = g.count
                kv = gather_kv(cache, g.rows(1), (n,), **cached)  # [n, 1, L, latent]
                o = F.scaled_dot_product_attention(
                    q_abs[g.start:g.start + n].unsqueeze(1), kv, kv[..., :d.kv_lora_rank],
                    attn_mask=g.mask, scale=self.scale)
                o_lat[g.start:g.start + n] = o.squeeze(1)
            out[:nd] = self._unabsorb(o_lat)
        batched: set[int] = set()
        if len(meta.prefills) > 1:
            # Short chunks of one length over cached contexts (speculative decoding's verify
            # slices) attend in one call per length, like decodes.
            for batch in meta.chunk_batches(self.expand_min_tokens, 1):
                batched.update(batch.chunks)
                out.index_copy_(0, batch.rows, self._batched_absorbed(
                    q_nope.index_select(0, batch.rows), q_pe.index_select(0, batch.rows), cache,
                    batch, kv_scale))
        for k, chunk in enumerate(meta.prefills):
            if k in batched:
                continue
            s, n = chunk.start, chunk.num_tokens
            if chunk.blocks is None:
                kv = through_cache(entries[s:s + n], cache.dtype, kv_scale)
            else:
                kv = gather_kv(cache, chunk.rows(1), (), **cached)[0]
            attend = self._expanded_prefill if n >= self.expand_min_tokens else self._absorbed_prefill
            out[s:s + n] = attend(q_nope[s:s + n], q_pe[s:s + n], kv, chunk.mask)
        return self.o_proj(out.view(num_tokens, -1))
