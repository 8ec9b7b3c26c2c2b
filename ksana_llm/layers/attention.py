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
class AttentionMetadata:
    slot_mapping: torch.Tensor  # [T] cache slot (block * block_size + offset) of each new token
    num_decodes: int = 0  # the first num_decodes tokens are single-token decodes
    decode_slots: torch.Tensor | None = None  # [num_decodes * L] slots to gather, padded
    decode_len: int = 0  # L: longest decode context in the batch
    decode_mask: torch.Tensor | None = None  # [num_decodes, 1, 1, L] bool; None if no padding
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
    nd = meta.num_decodes
    if nd:
        length = meta.decode_len
        kd = k_flat.index_select(0, meta.decode_slots).view(nd, length, num_kv_heads, head_dim)
        vd = v_flat.index_select(0, meta.decode_slots).view(nd, length, num_kv_heads, head_dim)
        # With one query token, the query heads that share a KV head can act as that head's
        # "query positions": plain MHA with no head expansion (faster than enable_gqa on CPU).
        group = q.shape[1] // num_kv_heads
        qd = q[:nd].view(nd, num_kv_heads, group, head_dim)
        o = F.scaled_dot_product_attention(qd, kd.transpose(1, 2), vd.transpose(1, 2),
                                           attn_mask=meta.decode_mask, scale=scale)
        out[:nd] = o.reshape(nd, q.shape[1], head_dim)
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
