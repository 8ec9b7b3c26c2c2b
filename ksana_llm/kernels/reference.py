"""Plain torch references for every Triton kernel in this package.

They define what each kernel must compute: readable, slow (one sequence at a time), fp32 math.
Tests compare the kernels against them, and the references themselves against dense attention
computed without any paging. Nothing here imports triton, so they run anywhere torch does.
"""

from __future__ import annotations

import torch

from ksana_llm.kernels.kv_quant import from_cache, to_cache
from ksana_llm.loader.weight_quant import dequantize_weight


def store_kv_ref(k: torch.Tensor, v: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                 slot_mapping: torch.Tensor, *, kv_scale: float = 1.0) -> None:
    """Write k [T, Hkv, D] / v [T, Hkv, Dv] into the caches at `slot_mapping` (< 0 = skip); an
    FP8 cache gets value / kv_scale, rounded."""
    keep = slot_mapping >= 0
    slots = slot_mapping[keep].long()
    block_size = k_cache.shape[1]
    blocks, offsets = slots // block_size, slots % block_size
    k_cache[blocks, offsets] = to_cache(k[keep], k_cache.dtype, kv_scale)
    v_cache[blocks, offsets] = to_cache(v[keep], v_cache.dtype, kv_scale)


def gather_kv(cache: torch.Tensor, block_table: torch.Tensor, length: int, *,
              dtype: torch.dtype | None = None, kv_scale: float = 1.0) -> torch.Tensor:
    """The first `length` tokens of one sequence from a paged cache: [length, H, D], as `dtype`
    values (default: the cache's own dtype; FP8 entries read as entry * kv_scale)."""
    block_size = cache.shape[1]
    pos = torch.arange(length, device=cache.device)
    blocks = block_table.long()[pos // block_size]
    return from_cache(cache[blocks, pos % block_size], dtype or cache.dtype, kv_scale)


def attend_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_pos: torch.Tensor,
               scale: float, *, sliding_window: int | None = None,
               alibi_slopes: torch.Tensor | None = None,
               softcap: float | None = None,
               sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of queries at absolute positions `q_pos` [n] over keys at positions 0..L-1.

    q [n, Hq, D], k [L, Hkv, D], v [L, Hkv, Dv] -> [n, Hq, Dv] in q's dtype. Causal (key pos <=
    query pos), optionally windowed (key pos > query pos - window) and ALiBi-biased
    (+ slope[h] * (key pos - query pos)); `softcap` caps the scaled scores at
    softcap * tanh(score / softcap) (Gemma 2). `sinks` [Hq] (GPT-OSS): one more logit per head
    in the softmax's denominator, attached to no value (it only takes weight from the keys).
    Query head h reads KV head h // (Hq // Hkv).
    """
    group = q.shape[1] // k.shape[1]
    kf = k.float().repeat_interleave(group, dim=1)
    vf = v.float().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q.float(), kf) * scale  # [Hq, n, L]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    k_pos = torch.arange(k.shape[0], device=q.device)
    rel = k_pos[None, :] - q_pos.long()[:, None]  # [n, L]
    allowed = rel <= 0
    if sliding_window is not None:
        allowed &= rel > -sliding_window
    if alibi_slopes is not None:
        scores = scores + alibi_slopes.float()[:, None, None] * rel[None].float()
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    if sinks is not None:
        sink_logits = sinks.float()[:, None, None].expand(-1, scores.shape[1], 1)
        probs = torch.softmax(torch.cat([scores, sink_logits], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # a query with no key gets zeros
    return torch.einsum("hnl,lhd->nhd", probs, vf).to(q.dtype)


def paged_decode_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                               block_tables: torch.Tensor, context_lens: torch.Tensor,
                               scale: float, *, sliding_window: int | None = None,
                               alibi_slopes: torch.Tensor | None = None,
                               softcap: float | None = None,
                               sinks: torch.Tensor | None = None,
                               kv_scale: float = 1.0) -> torch.Tensor:
    """One query token per sequence at position context_len - 1: q [B, Hq, D] -> [B, Hq, Dv]."""
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    for b, length in enumerate(context_lens.tolist()):
        if length == 0:
            continue
        k = gather_kv(k_cache, block_tables[b], length, dtype=q.dtype, kv_scale=kv_scale)
        v = gather_kv(v_cache, block_tables[b], length, dtype=q.dtype, kv_scale=kv_scale)
        q_pos = torch.tensor([length - 1], device=q.device)
        out[b] = attend_ref(q[b:b + 1], k, v, q_pos, scale, sliding_window=sliding_window,
                            alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)[0]
    return out


def paged_prefill_attention_ref(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                                block_tables: torch.Tensor, query_start_loc: torch.Tensor,
                                seq_lens: torch.Tensor, scale: float, *,
                                sliding_window: int | None = None,
                                alibi_slopes: torch.Tensor | None = None,
                                softcap: float | None = None,
                                sinks: torch.Tensor | None = None,
                                kv_scale: float = 1.0) -> torch.Tensor:
    """Query chunks over a paged prefix: q [T, Hq, D] -> [T, Hq, Dv].

    Sequence b's queries are rows query_start_loc[b]:query_start_loc[b+1]; they are the last
    q_len tokens of its seq_lens[b]-token context, whose K/V are all in the cache already.
    """
    out = q.new_zeros(q.shape[0], q.shape[1], v_cache.shape[-1])
    starts = query_start_loc.tolist()
    for b, length in enumerate(seq_lens.tolist()):
        s, e = starts[b], starts[b + 1]
        if e == s:
            continue
        k = gather_kv(k_cache, block_tables[b], length, dtype=q.dtype, kv_scale=kv_scale)
        v = gather_kv(v_cache, block_tables[b], length, dtype=q.dtype, kv_scale=kv_scale)
        q_pos = torch.arange(length - (e - s), length, device=q.device)
        out[s:e] = attend_ref(q[s:e], k, v, q_pos, scale, sliding_window=sliding_window,
                              alibi_slopes=alibi_slopes, softcap=softcap, sinks=sinks)
    return out


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float,
                 residual: torch.Tensor | None = None, *, weight_in_float32: bool = False
                 ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """`layers.norm.RMSNorm` semantics: (x + residual) in x's dtype, normalised in fp32, cast
    back, then times the weight -- or, `weight_in_float32`, times the weight in fp32 and then
    cast back to x's dtype. Returns normed, or (normed, x + residual)."""
    if residual is not None:
        x = x + residual
    xf = x.float()
    normed = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    out = ((weight.float() * normed).to(x.dtype) if weight_in_float32
           else weight * normed.to(x.dtype))
    return out if residual is None else (out, x)


def rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX rotate-half on the first 2 * cos.shape[-1] dims of x [T, H, D]; cos/sin [T, R/2].
    Computed in fp32, returned in x's dtype (the rest of the head dim passes through)."""
    half = cos.shape[-1]
    cos = cos.reshape(x.shape[0], 1, half).float()
    sin = sin.reshape(x.shape[0], 1, half).float()
    xf = x.float()
    x1, x2 = xf[..., :half], xf[..., half:2 * half]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin, xf[..., 2 * half:]), dim=-1)
    return rotated.to(x.dtype)


def silu_and_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """`layers.activation`'s torch SwiGLU: silu(gate) * up over x [..., 2I], in x's dtype."""
    gate, up = x.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def fp8_linear_ref(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, group_size: int,
                   bias: torch.Tensor | None = None, zero_point: torch.Tensor | None = None
                   ) -> torch.Tensor:
    """The quantized weight (8-bit, or packed 4-bit codes with their zero points) dequantized
    to x's dtype (`loader.weight_quant`), then a plain linear."""
    return torch.nn.functional.linear(
        x, dequantize_weight(weight, scale, group_size, x.dtype, zero_point), bias)


def expert_matmul_ref(a: torch.Tensor, weight: torch.Tensor, experts: torch.Tensor,
                      rows_per_input: int, scale: torch.Tensor | None = None,
                      group_size: int = 0, zero_point: torch.Tensor | None = None,
                      input_order: torch.Tensor | None = None, *, fp4: bool = False
                      ) -> torch.Tensor:
    """Assignment i of `experts` [T, K] (expert ids, flattened) gets a[i // rows_per_input] @
    weight[expert]^T, with quantized experts dequantized to a's dtype first (`fp8_linear_ref`;
    `fp4`: packed e2m1 codes) and a's columns taken in the expert's `input_order`, in float32,
    rounded to a's dtype."""
    flat = experts.reshape(-1).long()
    rows = a[torch.arange(flat.numel(), device=a.device) // rows_per_input]
    if input_order is not None:
        rows = rows.gather(1, input_order[flat])
    if scale is not None:
        weight = torch.stack([dequantize_weight(weight[e], scale[e], group_size, a.dtype,
                                                None if zero_point is None else zero_point[e],
                                                fp4)
                              for e in range(weight.shape[0])])
    return torch.bmm(weight[flat].float(), rows.float().unsqueeze(-1)).squeeze(-1).to(a.dtype)
