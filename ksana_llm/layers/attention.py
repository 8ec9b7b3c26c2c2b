"""Attention over the paged KV cache, and the metadata that describes one step's batch.

The runner lays a step's tokens out as [decode tokens (one per sequence) | prefill chunks], builds
one `AttentionMetadata`, and every layer reads it; models never see the scheduler.

This is the torch backend (CPU, and any device): it writes new K/V into the cache by slot, then
runs `scaled_dot_product_attention` over K/V gathered from the blocks — all decodes in one batched
call, each prefill chunk in its own call.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

KVCache = tuple[torch.Tensor, torch.Tensor]  # K and V: [num_blocks, block_size, kv_heads, head_dim]


@dataclass(frozen=True)
class KVCacheSpec:
    """What one layer keeps per cached token; models declare it, the runner allocates it.

    K is [num_blocks, block_size, num_kv_heads, head_dim] and V the same with `v_head_dim`. A
    `v_head_dim` of 0 means the layer keeps no separate V (MLA stores one compressed latent per
    token in K and reads its values from there).
    """

    num_kv_heads: int
    head_dim: int
    v_head_dim: int | None = None  # None: same as head_dim

    @property
    def v_dim(self) -> int:
        return self.head_dim if self.v_head_dim is None else self.v_head_dim

    def bytes_per_token(self, dtype: torch.dtype) -> int:
        elem = torch.empty((), dtype=dtype).element_size()
        return self.num_kv_heads * (self.head_dim + self.v_dim) * elem


@dataclass
class PrefillChunk:
    """One sequence's query chunk in the flattened batch."""

    start: int  # first token index in the flattened batch
    num_tokens: int
    context_len: int  # tokens attended to: cached prefix + this chunk
    # Slots of all `context_len` tokens; None when the chunk has no cached prefix (attend to the
    # chunk's own K/V directly, plain causal).
    slots: torch.Tensor | None = None
    mask: torch.Tensor | None = None  # [num_tokens, context_len] bool, True = attend


@dataclass
class DecodeGroup:
    """Decode tokens [start, start + count) whose contexts are padded to one length.

    Decodes are grouped by similar context length so that padding (gathered and attended for
    nothing) stays small when short and long sequences decode together.
    """

    start: int
    count: int
    length: int  # L: longest context in the group
    slots: torch.Tensor  # [count * L] cache slots to gather, padded
    mask: torch.Tensor | None = None  # [count, 1, 1, L] bool; None when nothing is padded


@dataclass
class KernelBatch:
    """The batch as the Triton kernels read it (block tables and lengths, no gathered slots)."""

    decode_block_tables: torch.Tensor  # [num_decodes, W] int32
    decode_context_lens: torch.Tensor  # [num_decodes] int32, the new token included
    prefill_block_tables: torch.Tensor  # [num_prefills, W] int32
    prefill_query_start_loc: torch.Tensor  # [num_prefills + 1] int32, rows after the decodes
    prefill_seq_lens: torch.Tensor  # [num_prefills] int32, cached prefix + this chunk

    def to(self, device: torch.device) -> KernelBatch:
        return KernelBatch(*(t.to(device, non_blocking=True) for t in (
            self.decode_block_tables, self.decode_context_lens, self.prefill_block_tables,
            self.prefill_query_start_loc, self.prefill_seq_lens)))


@dataclass
class AttentionMetadata:
    """One step's batch for the attention layers.

    The torch backend reads `decode_groups` / `prefills` (gathered slots and masks); the Triton
    backend reads `kernel_batch` instead, and the runner builds only the one its backend needs.
    """

    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    positions: torch.Tensor | None = None  # [T] absolute position of each new token
    num_decodes: int = 0  # the first num_decodes tokens are single-token decodes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)
    kernel_batch: KernelBatch | None = None
    sliding_window: int | None = None  # the Triton kernels apply it themselves


def _alibi_bias(slopes: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor,
                allowed: torch.Tensor | None) -> torch.Tensor:
    """ALiBi as an additive mask [..., Hq, Tq, Tk]: slope * (k_pos - q_pos), -inf where not
    allowed. q_pos: [..., Tq], k_pos: [Tk], allowed broadcastable to the result."""
    distance = (k_pos[None, :] - q_pos[..., :, None]).to(slopes.dtype)  # [..., Tq, Tk]
    bias = slopes[:, None, None] * distance.unsqueeze(-3)
    if allowed is not None:
        bias = bias.masked_fill(~allowed, float("-inf"))
    return bias


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata, scale: float,
                    alibi_slopes: torch.Tensor | None = None) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] / [T, Hkv, Dv] for the new tokens. Returns [T, Hq, Dv].

    `alibi_slopes` ([Hq], float32) adds ALiBi position biases (Baichuan-13B); it needs
    `meta.positions`.
    """
    if meta.kernel_batch is not None:
        return _kernel_attention(q, k, v, kv_cache, meta, scale, alibi_slopes)
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim, v_dim = k.shape[1], k.shape[2], v.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, v_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    gqa = q.shape[1] != num_kv_heads

    out = q.new_empty(q.shape[0], q.shape[1], v_dim)
    # With one query token, the query heads that share a KV head can act as that head's "query
    # positions": plain multi-head attention with no head expansion (faster than enable_gqa).
    group_size = q.shape[1] // num_kv_heads
    for g in meta.decode_groups:
        n, length = g.count, g.length
        kd = k_flat.index_select(0, g.slots).view(n, length, num_kv_heads, head_dim)
        vd = v_flat.index_select(0, g.slots).view(n, length, num_kv_heads, v_dim)
        qd = q[g.start:g.start + n].view(n, num_kv_heads, group_size, head_dim)
        mask = g.mask
        if alibi_slopes is not None:
            q_pos = meta.positions[g.start:g.start + n, None]  # [n, 1]
            bias = _alibi_bias(alibi_slopes, q_pos, torch.arange(length, device=q.device),
                               None if mask is None else mask.view(n, 1, 1, length))
            mask = bias.view(n, num_kv_heads, group_size, length).to(q.dtype)
        o = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                           attn_mask=mask, scale=scale)
        out[g.start:g.start + n] = o.reshape(n, q.shape[1], v_dim)
    for chunk in meta.prefills:
        s, n = chunk.start, chunk.num_tokens
        qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if chunk.slots is None:
            kp, vp = k[s:s + n], v[s:s + n]
        else:
            kp, vp = k_flat.index_select(0, chunk.slots), v_flat.index_select(0, chunk.slots)
        mask, causal = chunk.mask, chunk.mask is None and n > 1
        if alibi_slopes is not None:
            ctx = chunk.context_len
            k_pos = torch.arange(ctx, device=q.device)
            q_pos = torch.arange(ctx - n, ctx, device=q.device)
            allowed = mask if mask is not None else k_pos[None, :] <= q_pos[:, None]
            mask, causal = _alibi_bias(alibi_slopes, q_pos, k_pos, allowed).unsqueeze(0).to(q.dtype), False
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=mask, is_causal=causal, scale=scale, enable_gqa=gqa)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out


def _kernel_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                      meta: AttentionMetadata, scale: float,
                      alibi_slopes: torch.Tensor | None) -> torch.Tensor:
    """The Triton backend: store the new K/V, then one decode launch and one prefill launch
    that read the paged cache in place (no gathers)."""
    from ksana_llm import kernels  # imports triton: only when this backend was chosen

    k_cache, v_cache = kv_cache
    batch = meta.kernel_batch
    kernels.store_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    out = q.new_empty(q.shape[0], q.shape[1], v.shape[2])
    slopes = None if alibi_slopes is None else alibi_slopes.float()
    d = meta.num_decodes
    if d:
        kernels.paged_decode_attention(
            q[:d], k_cache, v_cache, batch.decode_block_tables, batch.decode_context_lens, scale,
            sliding_window=meta.sliding_window, alibi_slopes=slopes, out=out[:d])
    if q.shape[0] > d:
        kernels.paged_prefill_attention(
            q[d:], k_cache, v_cache, batch.prefill_block_tables, batch.prefill_query_start_loc,
            batch.prefill_seq_lens, scale, sliding_window=meta.sliding_window,
            alibi_slopes=slopes, out=out[d:])
    return out
