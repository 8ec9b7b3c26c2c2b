"""Triton helpers shared by the paged attention kernels: one K/V tile of a paged context.

Decode and prefill attention walk a sequence's context the same way, in tiles of BLOCK_N token
positions gathered through its block table; they differ only in which keys each query row may
see. These helpers are inlined into both kernels (Triton inlines every jit call), so sharing them
costs nothing at run time.
"""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def tile_slots(table, pos, kv_mask, BLOCK_SIZE: tl.constexpr):
    """(block, in_block): the cache block and slot of each position in the tile."""
    # int64: block * stride can pass 2**31 elements in a large cache.
    block = tl.load(table + pos // BLOCK_SIZE, mask=kv_mask, other=0).to(tl.int64)
    return block, pos % BLOCK_SIZE


@triton.jit
def tile_scores(q, k_head, block, in_block, stride_kb, stride_ks, d, d_mask, kv_mask,
                DOT_PRECISION: tl.constexpr):
    """q [rows, len(d)] against the keys' dims `d` at the tile's cache slots: [rows, BLOCK_N].

    Used for a head's main tile and, with its tail dims (`head_dim_tiles`), for the tail whose
    scores are added to the main tile's. The K tile is loaded transposed, [len(d), BLOCK_N], so
    the dot needs no tl.trans; an FP8 cache's entries widen to q's type (the K scale is folded
    into the caller's score scale)."""
    k = tl.load(k_head + block[None, :] * stride_kb + in_block[None, :] * stride_ks
                + d[:, None], mask=d_mask[:, None] & kv_mask[None, :], other=0.0)
    return tl.dot(q, k.to(q.dtype), input_precision=DOT_PRECISION)


@triton.jit
def accumulate_tile(s, m_i, l_i, acc, q, v_head, block, in_block, kv_mask, stride_vb, stride_vs,
                    dv, dv_mask, DOT_PRECISION: tl.constexpr):
    """One online-softmax step: scores `s` (log2 domain, -inf where a key is not visible) and
    the tile's values folded into the running (max, sum, weighted values). Returns the new
    (m_i, l_i, acc). Values widen to q's type, as keys do in `tile_scores`."""
    # A row may see no key at all so far (a padding row past a chunk's end under a window, or a
    # row whose window starts after this tile): keep its max finite so exp2(-inf - -inf) never
    # makes a NaN.
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_head + block[:, None] * stride_vb + in_block[:, None] * stride_vs
                + dv[None, :], mask=kv_mask[:, None] & dv_mask[None, :], other=0.0)
    v = v.to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def add_sink(Sinks, heads, head_mask, m_i, l_i, acc):
    """Fold each head's sink logit (GPT-OSS; natural log domain, read from `Sinks` at `heads`)
    into the finished online softmax: one more term in the denominator, attached to no value,
    so it only takes weight from the keys. Returns the new (m_i, l_i, acc)."""
    sink = tl.load(Sinks + heads, mask=head_mask, other=0.0).to(tl.float32) * 1.4426950408889634
    m_new = tl.maximum(m_i, sink)  # finite: the sink is
    alpha = tl.exp2(m_i - m_new)
    return m_new, l_i * alpha + tl.exp2(sink - m_new), acc * alpha[:, None]


@triton.jit
def capped_scores(s, scale_log2, softcap, USE_SOFTCAP: tl.constexpr):
    """Raw q.k scores -> the log2-domain scores the online softmax takes: times `scale_log2`
    (softmax scale * log2(e), an FP8 cache's K scale folded in), or with logit soft-capping
    (Gemma 2) cap * tanh(score * scale / cap) first. tanh from exp2, which every Triton
    version and the interpreter have: 1 - 2 / (e^(2x) + 1), exact at both infinities."""
    if USE_SOFTCAP:
        x = s * (scale_log2 / 1.4426950408889634) / softcap
        t = 1.0 - 2.0 / (tl.exp2(x * 2.8853900817779268) + 1.0)  # tanh(x); 2 * log2(e)
        return softcap * t * 1.4426950408889634
    return s * scale_log2
