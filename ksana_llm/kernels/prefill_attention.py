"""Paged prefill / extend attention: query chunks of many sequences over their paged contexts.

One launch covers every sequence, whatever its chunk length. Grid: (query block, query head).
Sequence b owns the query-block indices starting at query_start_loc[b] // BLOCK_M + b (enough for
its ceil(q_len / BLOCK_M) blocks, since these starts never overlap); a program finds its sequence
by binary search over query_start_loc, so the grid size (T // BLOCK_M + B) comes from shapes alone:
no device->host sync, CUDA-graph friendly. The chunk's own K/V are already in the cache, so the
kernel reads the cached prefix and the chunk alike through the block table.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import (check_alibi, check_sinks, check_cache_dtype, check_kv_cache,
                                       check_last_dim_contiguous, check_same_device, check_softcap,
                                       check_window,
                                       dot_precision, dot_tile, head_dim_tiles)
from ksana_llm.kernels.paged_tiles import (accumulate_tile, add_sink, capped_scores, tile_scores,
                                           tile_slots)

_LOG2E = 1.4426950408889634


@triton.jit
def _find_sequence(Query_start_loc, q_block, num_seqs, BLOCK_M: tl.constexpr):
    """The last sequence b whose first query block (query_start_loc[b] // BLOCK_M + b) is
    <= q_block."""
    left = 0
    right = num_seqs
    while left < right:
        mid = (left + right) // 2
        first_block = tl.load(Query_start_loc + mid) // BLOCK_M + mid
        if first_block <= q_block:
            left = mid + 1
        else:
            right = mid
    return left - 1


# The batch size varies step to step; unspecialised (==1, %16), it cannot trigger recompiles.
@triton.jit(do_not_specialize=["num_seqs"])
def _prefill_kernel(
    Q, K_cache, V_cache, Block_tables, Query_start_loc, Seq_lens, Alibi, Sinks, Out,
    scale_log2, v_scale, window, softcap, num_seqs,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    q_block = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // GROUP

    b = _find_sequence(Query_start_loc, q_block, num_seqs, BLOCK_M)
    q_start = tl.load(Query_start_loc + b)
    q_len = tl.load(Query_start_loc + b + 1) - q_start
    m0 = (q_block - (q_start // BLOCK_M + b)) * BLOCK_M
    if m0 >= q_len:  # a spare block of this sequence's range
        return
    ctx = tl.load(Seq_lens + b)
    prefix = ctx - q_len

    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_mask = offs_m < q_len
    q_pos = prefix + offs_m
    rows = (q_start + offs_m).to(tl.int64)
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < HEAD_DIM_V
    q = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + d[None, :],
                mask=m_mask[:, None] & d_mask[None, :], other=0.0)
    if BLOCK_DT > 0:  # the head's dims past BLOCK_D (`head_dim_tiles`)
        dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        dt_mask = dt < HEAD_DIM
        q_tail = tl.load(Q + rows[:, None] * stride_qt + head * stride_qh + dt[None, :],
                         mask=m_mask[:, None] & dt_mask[None, :], other=0.0)
    if USE_ALIBI:
        slope = tl.load(Alibi + head) * 1.4426950408889634

    # Keys this block can see: causal up to its last query, windowed from its first one.
    kv_hi = tl.minimum(ctx, prefix + m0 + BLOCK_M)
    kv_lo = 0
    if USE_WINDOW:
        kv_lo = tl.maximum(prefix + m0 - window + 1, 0)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
    table = Block_tables + b.to(tl.int64) * stride_bt
    k_head = K_cache + kv_head * stride_kh
    v_head = V_cache + kv_head * stride_vh
    for start in range(kv_lo, kv_hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        kv_mask = pos < kv_hi
        block, in_block = tile_slots(table, pos, kv_mask, BLOCK_SIZE)
        s = tile_scores(q, k_head, block, in_block, stride_kb, stride_ks, d, d_mask, kv_mask,
                        DOT_PRECISION)  # [BLOCK_M, BLOCK_N]
        if BLOCK_DT > 0:
            s += tile_scores(q_tail, k_head, block, in_block, stride_kb, stride_ks, dt, dt_mask,
                             kv_mask, DOT_PRECISION)
        s = capped_scores(s, scale_log2, softcap, USE_SOFTCAP)  # log2 domain
        rel = pos[None, :] - q_pos[:, None]  # key pos - query pos
        if USE_ALIBI:
            s += slope * rel.to(tl.float32)
        allowed = (rel <= 0) & kv_mask[None, :]
        if USE_WINDOW:
            allowed &= rel > -window
        s = tl.where(allowed, s, float("-inf"))
        m_i, l_i, acc = accumulate_tile(s, m_i, l_i, acc, q, v_head, block, in_block, kv_mask,
                                        stride_vb, stride_vs, dv, dv_mask, DOT_PRECISION)

    if USE_SINKS:
        m_i, l_i, acc = add_sink(Sinks, head + tl.zeros([BLOCK_M], tl.int32), m_mask, m_i, l_i,
                                 acc)
    # The V scale (1.0 unless the cache is FP8) applies to the whole weighted sum at once.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    tl.store(Out + rows[:, None] * stride_ot + head * stride_oh + dv[None, :],
             out.to(Out.dtype.element_ty), mask=m_mask[:, None] & dv_mask[None, :])


def _prefill_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages): 64x64 tiles for 16-bit heads up to 128; fp32 and
    wider heads get smaller tiles to stay within shared memory."""
    if dtype == torch.float32 or head_dim > 128:
        return 32, 32, 4, 2
    return 64, 64, 4, 2


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float, *,
                            sliding_window: int | None = None,
                            alibi_slopes: torch.Tensor | None = None,
                            softcap: float | None = None, kv_scale: float = 1.0,
                            sinks: torch.Tensor | None = None,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of query chunks over their paged contexts (prefill, chunked prefill,
    prefix-cache hits, and multi-token extends alike).

    q [T, Hq, D]: sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1]
    (query_start_loc [B+1] int32, starting at 0). seq_lens [B] int32: context length including
    the chunk, whose K/V must already be in the cache (`store_kv` first); query i of sequence b
    sits at position seq_lens[b] - q_len_b + i. block_tables [B, W] int32. Returns [T, Hq, Dv]
    in q's dtype (into `out` when given). An FP8 cache holds value / kv_scale (`kv_quant`).
    `sinks` [Hq] (GPT-OSS): one more logit per head in the softmax's denominator, attached to
    no value.
    """
    block_size, num_kv_heads, head_dim, v_head_dim = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q: expected [T, Hq, {head_dim}] with Hq a multiple of "
                         f"{num_kv_heads}, got {tuple(q.shape)}")
    check_cache_dtype(q, k_cache)
    num_tokens, num_heads = q.shape[0], q.shape[1]
    if seq_lens.dim() != 1:
        raise ValueError(f"seq_lens: expected [B], got {tuple(seq_lens.shape)}")
    batch = seq_lens.shape[0]
    if query_start_loc.shape != (batch + 1,):
        raise ValueError(f"query_start_loc: expected shape ({batch + 1},), "
                         f"got {tuple(query_start_loc.shape)}")
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [{batch}, W], got {tuple(block_tables.shape)}")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables,
                      query_start_loc=query_start_loc, seq_lens=seq_lens,
                      alibi_slopes=alibi_slopes, out=out, sinks=sinks)
    check_last_dim_contiguous("q", q)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    query_start_loc = query_start_loc.contiguous()
    seq_lens = seq_lens.contiguous()
    window = check_window(sliding_window)
    cap = check_softcap(softcap)
    slopes = check_alibi(alibi_slopes, num_heads)
    sink_logits = check_sinks(sinks, num_heads)
    if out is None:
        out = q.new_empty(num_tokens, num_heads, v_head_dim)
    elif out.shape != (num_tokens, num_heads, v_head_dim):
        raise ValueError(f"out: expected shape ({num_tokens}, {num_heads}, {v_head_dim}), "
                         f"got {tuple(out.shape)}")
    else:
        check_last_dim_contiguous("out", out)
    if num_tokens == 0 or batch == 0:
        return out

    block_m, block_n, num_warps, num_stages = _prefill_config(head_dim, q.dtype)
    block_d, block_dt = head_dim_tiles(head_dim)
    # sum_b ceil(q_len_b / BLOCK_M) <= T // BLOCK_M + B: every block of every sequence has a slot.
    grid = (num_tokens // block_m + batch, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
        slopes if slopes is not None else q,
        sink_logits if sink_logits is not None else q, out,
        scale * kv_scale * _LOG2E, kv_scale, window, cap, batch,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DT=block_dt,
        HEAD_DIM_V=v_head_dim, BLOCK_DV=dot_tile(v_head_dim),
        BLOCK_SIZE=block_size, BLOCK_M=block_m, BLOCK_N=block_n,
        USE_WINDOW=bool(window), USE_ALIBI=slopes is not None, USE_SOFTCAP=bool(cap),
        USE_SINKS=sink_logits is not None, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    return out
