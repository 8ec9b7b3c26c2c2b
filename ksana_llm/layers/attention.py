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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    num_decodes: int = 0  # the first num_decodes tokens are single-token decodes
    decode_groups: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillChunk] = field(default_factory=list)


def paged_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache,
                    meta: AttentionMetadata, scale: float) -> torch.Tensor:
    """q: [T, Hq, D]; k, v: [T, Hkv, D] for the new tokens. Returns [T, Hq, D]."""
    k_cache, v_cache = kv_cache
    num_kv_heads, head_dim = k.shape[1], k.shape[2]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    k_flat.index_copy_(0, meta.slot_mapping, k)
    v_flat.index_copy_(0, meta.slot_mapping, v)
    gqa = q.shape[1] != num_kv_heads

    out = torch.empty_like(q)
    # With one query token, the query heads that share a KV head can act as that head's "query
    # positions": plain multi-head attention with no head expansion (faster than enable_gqa).
    group_size = q.shape[1] // num_kv_heads
    for g in meta.decode_groups:
        n, length = g.count, g.length
        kd = k_flat.index_select(0, g.slots).view(n, length, num_kv_heads, head_dim)
        vd = v_flat.index_select(0, g.slots).view(n, length, num_kv_heads, head_dim)
        qd = q[g.start:g.start + n].view(n, num_kv_heads, group_size, head_dim)
        o = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                           attn_mask=g.mask, scale=scale)
        out[g.start:g.start + n] = o.reshape(n, q.shape[1], head_dim)
    for chunk in meta.prefills:
        s, n = chunk.start, chunk.num_tokens
        qp = q[s:s + n].transpose(0, 1).unsqueeze(0)  # [1, Hq, n, D]
        if chunk.slots is None:
            kp, vp = k[s:s + n], v[s:s + n]
        else:
            kp, vp = k_flat.index_select(0, chunk.slots), v_flat.index_select(0, chunk.slots)
        o = F.scaled_dot_product_attention(
            qp, kp.transpose(0, 1).unsqueeze(0), vp.transpose(0, 1).unsqueeze(0),
            attn_mask=chunk.mask, is_causal=chunk.mask is None and n > 1, scale=scale,
            enable_gqa=gqa)
        out[s:s + n] = o.squeeze(0).transpose(0, 1)
    return out
