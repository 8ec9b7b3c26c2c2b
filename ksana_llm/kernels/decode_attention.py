"""Paged decode attention (one query token per sequence), flash-decoding style.

Grid: (KV head x head block, sequence, split). A program takes the query heads that share its
KV head (GQA), up to MAX_HEAD_BLOCK of them, so each K/V tile is read from memory once per block
of heads (once for the whole group unless it is wider, as MLA's single latent "head" shared by
every query head is), and walks its split of the context in tiles of BLOCK_N tokens gathered
through the block table (any page size works: the tile is independent of it). V may be a view of
K's leading columns (MLA's latent: values are the keys' first dims), read through its strides. With one split the program writes the final output; otherwise it writes a
partial (normalised output, log-sum-exp) and `_reduce_kernel` merges the splits.

Programs start in grid order, a sequence's heads together; with `order` (a permutation of the
batch, longest context first: the runners pass `runner.host_arrays.longest_first`) the
sequences are taken in that order, so the long programs start first and the launch does not
end on a few of them running alone while most SMs idle (longest-processing-time-first; the
rows stay where they are).

The number of splits is picked on the host from the block-table width (an upper bound on the
context), never from `context_lens` itself, so a launch needs no device->host sync and stays the
same shape inside a CUDA graph.
"""

from __future__ import annotations

import functools
import math
import os

import torch
import triton
import triton.language as tl

from ksana_llm.kernels._common import (check_alibi, check_sinks, check_cache_dtype, check_kv_cache,
                                       check_last_dim_contiguous, check_same_device, check_softcap,
                                       check_window,
                                       dot_precision, dot_tile, head_dim_tiles, next_pow2)
from ksana_llm.kernels.paged_tiles import (accumulate_tile, add_sink, capped_scores, tile_scores,
                                           tile_slots)

# Assumed SM count when running in the interpreter on CPU (an H100/H200 has 132), so the split
# choice made in CPU tests is the one a Hopper GPU would make.
_INTERPRETER_SMS = 132
# A split shorter than this costs more in the reduce step and partial writes than it gains.
MIN_SPLIT_TOKENS = 256
MAX_SPLITS = 64
# Query heads one program takes: a wider group (MLA: every head on one latent) is split into
# blocks of this many, so the query tile stays within registers for 576-wide heads.
MAX_HEAD_BLOCK = 16

_LOG2E = 1.4426950408889634


@triton.jit
def _decode_kernel(
    Q, K_cache, V_cache, Block_tables, Context_lens, Order, Alibi, Sinks, Out, Mid_o, Mid_lse,
    scale_log2, v_scale, window, softcap, split_len,
    stride_qb, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ob, stride_oh,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    GROUP: tl.constexpr, BLOCK_G: tl.constexpr, HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DT: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_ALIBI: tl.constexpr, USE_SOFTCAP: tl.constexpr,
    USE_SINKS: tl.constexpr, SINGLE_SPLIT: tl.constexpr,
    USE_ORDER: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    b = tl.program_id(1)
    if USE_ORDER:
        b = tl.load(Order + b)
    kv_head = tl.program_id(0) // HEAD_BLOCKS
    head_block = tl.program_id(0) % HEAD_BLOCKS
    split = tl.program_id(2)

    ctx = tl.load(Context_lens + b)
    q_pos = ctx - 1
    kv_start = 0
    if USE_WINDOW:
        # keys with pos > q_pos - window, i.e. pos >= ctx - window
        kv_start = tl.maximum(ctx - window, 0)
    lo = kv_start + split * split_len
    hi = tl.minimum(lo + split_len, ctx)

    g = head_block * BLOCK_G + tl.arange(0, BLOCK_G)
    g_mask = g < GROUP
    heads = kv_head * GROUP + g
    d = tl.arange(0, BLOCK_D)
    d_mask = d < HEAD_DIM
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < HEAD_DIM_V

    q = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + d[None, :],
                mask=g_mask[:, None] & d_mask[None, :], other=0.0)
    if BLOCK_DT > 0:  # the head's dims past BLOCK_D (`head_dim_tiles`)
        dt = BLOCK_D + tl.arange(0, BLOCK_DT)
        dt_mask = dt < HEAD_DIM
        q_tail = tl.load(Q + b * stride_qb + heads[:, None] * stride_qh + dt[None, :],
                         mask=g_mask[:, None] & dt_mask[None, :], other=0.0)
    if USE_ALIBI:
        slopes = tl.load(Alibi + heads, mask=g_mask, other=0.0) * 1.4426950408889634

    m_i = tl.full([BLOCK_G], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_G], tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], tl.float32)
    table = Block_tables + b.to(tl.int64) * stride_bt
    k_head = K_cache + kv_head * stride_kh
    v_head = V_cache + kv_head * stride_vh
    for start in range(lo, hi, BLOCK_N):
        pos = start + tl.arange(0, BLOCK_N)
        kv_mask = pos < hi
        block, in_block = tile_slots(table, pos, kv_mask, BLOCK_SIZE)
        s = tile_scores(q, k_head, block, in_block, stride_kb, stride_ks, d, d_mask, kv_mask,
                        DOT_PRECISION)  # [BLOCK_G, BLOCK_N]
        if BLOCK_DT > 0:
            s += tile_scores(q_tail, k_head, block, in_block, stride_kb, stride_ks, dt, dt_mask,
                             kv_mask, DOT_PRECISION)
        s = capped_scores(s, scale_log2, softcap, USE_SOFTCAP)  # log2 domain
        if USE_ALIBI:
            s += slopes[:, None] * (pos - q_pos).to(tl.float32)[None, :]
        s = tl.where(kv_mask[None, :], s, float("-inf"))
        m_i, l_i, acc = accumulate_tile(s, m_i, l_i, acc, q, v_head, block, in_block, kv_mask,
                                        stride_vb, stride_vs, dv, dv_mask, DOT_PRECISION)

    if USE_SINKS and SINGLE_SPLIT:  # with several splits, the reduce step adds the sink
        m_i, l_i, acc = add_sink(Sinks, heads, g_mask, m_i, l_i, acc)
    # An empty split (or context) leaves l_i == 0: output zeros, log-sum-exp -inf.
    # The V scale (1.0 unless the cache is FP8) applies to the whole weighted sum at once.
    out = acc * (v_scale / tl.where(l_i > 0, l_i, 1.0))[:, None]
    out_mask = g_mask[:, None] & dv_mask[None, :]
    if SINGLE_SPLIT:
        tl.store(Out + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                 out.to(Out.dtype.element_ty), mask=out_mask)
    else:
        tl.store(Mid_o + b * stride_mb + heads[:, None] * stride_mh + split * stride_ms
                 + dv[None, :], out, mask=out_mask)
        lse = tl.where(l_i > 0, m_i + tl.log2(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))
        tl.store(Mid_lse + b * stride_lb + heads * stride_lh + split, lse, mask=g_mask)


# num_splits varies with batch and context; unspecialised, it cannot trigger recompiles.
@triton.jit(do_not_specialize=["num_splits"])
def _reduce_kernel(
    Mid_o, Mid_lse, Sinks, Out, num_splits,
    stride_mb, stride_mh, stride_ms,
    stride_lb, stride_lh,
    stride_ob, stride_oh,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_S: tl.constexpr,
    USE_SINKS: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    s_mask = s < num_splits
    dv = tl.arange(0, BLOCK_DV)
    dv_mask = dv < HEAD_DIM_V
    lse = tl.load(Mid_lse + b * stride_lb + h * stride_lh + s, mask=s_mask,
                  other=float("-inf"))
    m = tl.max(lse, 0)
    if USE_SINKS:  # one more logit in the denominator (log2 domain), attached to no value
        sink = tl.load(Sinks + h).to(tl.float32) * 1.4426950408889634
        m = tl.maximum(m, sink)
    m = tl.where(m == float("-inf"), 0.0, m)  # all splits empty: weights all 0, output 0
    w = tl.exp2(lse - m)
    denom = tl.sum(w, 0)
    if USE_SINKS:
        denom += tl.exp2(sink - m)
    o = tl.load(Mid_o + b * stride_mb + h * stride_mh + s[:, None] * stride_ms + dv[None, :],
                mask=s_mask[:, None] & dv_mask[None, :], other=0.0)
    out = tl.sum(o * w[:, None], 0) / tl.where(denom > 0, denom, 1.0)
    tl.store(Out + b * stride_ob + h * stride_oh + dv, out.to(Out.dtype.element_ty), mask=dv_mask)


def _num_sms(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).multi_processor_count
    return _INTERPRETER_SMS


def head_blocks(group: int) -> int:
    """Programs per KV head: its query heads in blocks of at most MAX_HEAD_BLOCK."""
    return -(-group // MAX_HEAD_BLOCK)


def choose_num_splits(batch_size: int, num_kv_heads: int, max_context: int, num_sms: int,
                      *, min_split_tokens: int = MIN_SPLIT_TOKENS, max_splits: int = MAX_SPLITS,
                      split_fill: tuple[float, float] | None = None) -> int:
    """Splits per (sequence, KV head) so that the launch fills the GPU without making splits
    shorter than `min_split_tokens`. `split_fill` (fill, target), programs per SM: a launch
    with at least `fill` per SM gets 1 split (no reduce pass), a smaller one is split to about
    `target` per SM (default `decode_split_fill()`: (1, 2) unless KSANA_DECODE_SPLIT_FILL says
    otherwise). `num_kv_heads` counts programs per sequence: KV heads times their head blocks
    (`head_blocks`)."""
    fill, target = split_fill or decode_split_fill()
    programs = batch_size * num_kv_heads
    if programs >= fill * num_sms or max_context <= min_split_tokens:
        return 1
    wanted = math.ceil(target * num_sms / programs)
    by_length = max(1, max_context // min_split_tokens)
    return max(1, min(wanted, by_length, max_splits))


# Launch settings from the environment, for measuring others on a GPU without editing code
# (`benchmarks/gpu/run.sh engine-qwen3-tuned` runs the engine under what `decode-tune` found
# fastest): KSANA_DECODE_TILES="BLOCK_N,num_warps,num_stages" replaces `_decode_config`'s
# choice for 16-bit queries of heads up to 128 wide, KSANA_DECODE_SPLIT_FILL="fill,target"
# `choose_num_splits`' default. Read at each launch (a CUDA graph keeps what it captured).
TILES_ENV = "KSANA_DECODE_TILES"
SPLIT_FILL_ENV = "KSANA_DECODE_SPLIT_FILL"
DEFAULT_SPLIT_FILL = (1.0, 2.0)


def decode_split_fill() -> tuple[float, float]:
    """`choose_num_splits`' (fill, target) programs per SM: KSANA_DECODE_SPLIT_FILL, else
    DEFAULT_SPLIT_FILL."""
    return _parse_split_fill(os.environ.get(SPLIT_FILL_ENV) or None)


@functools.lru_cache(maxsize=8)
def _parse_split_fill(text: str | None) -> tuple[float, float]:
    if text is None:
        return DEFAULT_SPLIT_FILL
    try:
        fill, target = (float(v) for v in text.split(","))
    except ValueError:
        fill = target = float("nan")
    if not (0 < fill <= target < float("inf")):
        raise ValueError(f"{SPLIT_FILL_ENV}: expected 'fill,target' programs per SM with "
                         f"0 < fill <= target, got {text!r}")
    return fill, target


@functools.lru_cache(maxsize=8)
def _parse_tiles(text: str) -> tuple[int, int, int]:
    try:
        tiles = tuple(int(v) for v in text.split(","))
    except ValueError:
        tiles = ()
    try:
        return check_tiles(tiles)  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{TILES_ENV}={text!r}: {exc}") from None


def _decode_config(head_dim: int, dtype: torch.dtype) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages): fp32 and heads wider than 128 take 32-token tiles, so
    the double-buffered K and V tiles stay well within shared memory; KSANA_DECODE_TILES
    replaces the others' (64, 4, 2)."""
    wide = head_dim > 128 or dtype == torch.float32
    if wide:
        return 32, 4, 2
    given = os.environ.get(TILES_ENV)
    return _parse_tiles(given) if given else (64, 4, 2)


def check_tiles(tiles: tuple[int, int, int]) -> tuple[int, int, int]:
    """`tiles` as (BLOCK_N, num_warps, num_stages), or a ValueError naming what is off."""
    if len(tiles) != 3 or not all(isinstance(t, int) and t >= 1 for t in tiles):
        raise ValueError(f"tiles: expected (BLOCK_N, num_warps, num_stages) positive ints, "
                         f"got {tiles!r}")
    block_n, num_warps, _ = tiles
    if block_n < 16 or block_n & (block_n - 1):
        raise ValueError(f"tiles: BLOCK_N must be a power of two from 16, got {block_n}")
    if num_warps > 16 or num_warps & (num_warps - 1):
        raise ValueError(f"tiles: num_warps must be a power of two up to 16, got {num_warps}")
    return tiles


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, context_lens: torch.Tensor, scale: float,
                           *, sliding_window: int | None = None,
                           alibi_slopes: torch.Tensor | None = None,
                           softcap: float | None = None, num_splits: int | None = None,
                           kv_scale: float = 1.0, sinks: torch.Tensor | None = None,
                           out: torch.Tensor | None = None,
                           tiles: tuple[int, int, int] | None = None,
                           order: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context.

    q [B, Hq, D]; k_cache / v_cache [num_blocks, block_size, Hkv, D|Dv]; block_tables [B, W]
    int32; context_lens [B] int32 (tokens in the cache, the new token's included: it sits at
    position context_len - 1). Returns [B, Hq, Dv] in q's dtype (into `out` when given).
    `sliding_window`: attend only keys with pos > q_pos - window. `alibi_slopes` [Hq]: add
    slope[h] * (k_pos - q_pos). `sinks` [Hq] (GPT-OSS): one more logit per head in the softmax's
    denominator, attached to no value. `num_splits` overrides the flash-decoding split count (tests,
    tuning); by default it follows `choose_num_splits` on the block-table capacity. An FP8
    cache holds value / kv_scale (`kv_quant`): its entries read as entry * kv_scale.
    `tiles` (BLOCK_N, num_warps, num_stages) overrides `_decode_config`'s launch settings, for
    tuning on a GPU (`benchmarks/gpu/bench_kernels.py decode-tune`): BLOCK_N a power of two
    from 16, num_warps a power of two up to 16, num_stages from 1.
    `order` [B] int32: a permutation of the batch, the order in which programs take the
    sequences (longest context first balances the launch); the output rows stay in the
    batch's order. Not checked to be a permutation on the device (that would sync): a
    repeated index leaves a row unwritten.
    """
    block_size, num_kv_heads, head_dim, v_head_dim = check_kv_cache(k_cache, v_cache)
    if q.dim() != 3 or q.shape[2] != head_dim or q.shape[1] % num_kv_heads != 0:
        raise ValueError(f"q: expected [B, Hq, {head_dim}] with Hq a multiple of "
                         f"{num_kv_heads}, got {tuple(q.shape)}")
    check_cache_dtype(q, k_cache)
    batch, num_heads = q.shape[0], q.shape[1]
    if block_tables.dim() != 2 or block_tables.shape[0] != batch:
        raise ValueError(f"block_tables: expected [{batch}, W], got {tuple(block_tables.shape)}")
    if context_lens.shape != (batch,):
        raise ValueError(f"context_lens: expected shape ({batch},), "
                         f"got {tuple(context_lens.shape)}")
    if num_splits is not None and num_splits < 1:
        raise ValueError(f"num_splits: must be >= 1, got {num_splits}")
    check_same_device(q=q, k_cache=k_cache, block_tables=block_tables,
                      context_lens=context_lens, alibi_slopes=alibi_slopes, out=out,
                      order=order, sinks=sinks)
    if order is not None and (order.shape != (batch,) or order.dtype != torch.int32):
        raise ValueError(f"order: expected int32 of shape ({batch},), got "
                         f"{order.dtype} {tuple(order.shape)}")
    check_last_dim_contiguous("q", q)
    if block_tables.stride(-1) != 1:
        block_tables = block_tables.contiguous()
    context_lens = context_lens.contiguous()
    window = check_window(sliding_window)
    cap = check_softcap(softcap)
    slopes = check_alibi(alibi_slopes, num_heads)
    sink_logits = check_sinks(sinks, num_heads)
    if out is None:
        out = q.new_empty(batch, num_heads, v_head_dim)
    elif out.shape != (batch, num_heads, v_head_dim):
        raise ValueError(f"out: expected shape ({batch}, {num_heads}, {v_head_dim}), "
                         f"got {tuple(out.shape)}")
    else:
        check_last_dim_contiguous("out", out)
    if batch == 0:
        return out

    block_n, num_warps, num_stages = _decode_config(head_dim, q.dtype) if tiles is None \
        else check_tiles(tiles)
    block_d, block_dt = head_dim_tiles(head_dim)
    max_context = block_tables.shape[1] * block_size
    if window:
        max_context = min(max_context, window)
    group = num_heads // num_kv_heads
    blocks_per_head = head_blocks(group)
    if num_splits is None:
        num_splits = choose_num_splits(batch, num_kv_heads * blocks_per_head, max_context,
                                       _num_sms(q.device))
    per_split = max(1, -(-max_context // num_splits))  # ceil
    split_len = -(-per_split // block_n) * block_n  # whole tiles: only a split's last is ragged
    single = num_splits == 1
    if single:
        mid_o = mid_lse = out  # unused
        mid_strides = (0, 0, 0, 0, 0)
    else:
        mid_o = torch.empty(batch, num_heads, num_splits, v_head_dim, device=q.device,
                            dtype=torch.float32)
        mid_lse = torch.empty(batch, num_heads, num_splits, device=q.device, dtype=torch.float32)
        mid_strides = (mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
                       mid_lse.stride(0), mid_lse.stride(1))
    _decode_kernel[(num_kv_heads * blocks_per_head, batch, num_splits)](
        q, k_cache, v_cache, block_tables, context_lens,
        order.contiguous() if order is not None else context_lens,
        slopes if slopes is not None else q,
        sink_logits if sink_logits is not None else q, out, mid_o, mid_lse,
        scale * kv_scale * _LOG2E, kv_scale, window, cap, split_len,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        *mid_strides,
        GROUP=group, BLOCK_G=dot_tile(min(group, MAX_HEAD_BLOCK)), HEAD_BLOCKS=blocks_per_head,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_DT=block_dt,
        HEAD_DIM_V=v_head_dim, BLOCK_DV=dot_tile(v_head_dim),
        BLOCK_SIZE=block_size, BLOCK_N=block_n,
        USE_WINDOW=bool(window), USE_ALIBI=slopes is not None, USE_SOFTCAP=bool(cap),
        USE_SINKS=sink_logits is not None, SINGLE_SPLIT=single,
        USE_ORDER=order is not None, DOT_PRECISION=dot_precision(q.dtype),
        num_warps=num_warps, num_stages=num_stages,
    )
    if not single:
        _reduce_kernel[(batch, num_heads)](
            mid_o, mid_lse, sink_logits if sink_logits is not None else out, out, num_splits,
            *mid_strides,
            out.stride(0), out.stride(1),
            HEAD_DIM_V=v_head_dim, BLOCK_DV=next_pow2(v_head_dim),
            BLOCK_S=next_pow2(num_splits), USE_SINKS=sink_logits is not None,
            num_warps=4,
        )
    return out
