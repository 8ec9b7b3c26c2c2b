"""Prefill / extend attention kernels and the FP8 KV cache against their torch references.

Covers paged prefill (fresh prompts, chunks after a cached prefix, empty slots; sliding window and
ALiBi; chunked prefill equal to one whole prefill and to decode), storing K/V into FP8 caches
and both attention kernels reading them. Without CUDA the kernels run in triton's interpreter on
CPU tensors (TRITON_INTERPRET=1, set by tests/kernel_harness.py before triton loads); with CUDA
the same tests run natively on the GPU, adding bf16.
"""

from __future__ import annotations

# First: without CUDA the harness switches triton to its interpreter before triton loads.
from tests.kernel_harness import (DTYPES, PREFILL_SEQS, WINDOW_ALIBI, PagedBatch, assert_close,
                                  dense_attention, dtype_id, make_paged_batch, prefill_inputs,
                                  random_q, slopes_for)
from tests.kernel_harness import device_fixture  # noqa: F401  (the `device` fixture)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from ksana_llm import kernels  # noqa: E402
from ksana_llm.kernels import reference as ref  # noqa: E402
from ksana_llm.kernels.kv_quant import from_cache, to_cache  # noqa: E402

# --------------------------------------------------------------------------------------------
# Prefill / extend attention
# --------------------------------------------------------------------------------------------

PREFILL_SHAPES = [  # (block_size, q heads per kv head, head_dim)
    pytest.param(8, 1, 64, id="bs8-mha-d64"),
    pytest.param(16, 2, 80, id="bs16-gqa2-d80"),
    pytest.param(32, 4, 32, id="bs32-gqa4-d32"),
    pytest.param(64, 2, 96, id="bs64-gqa2-d96"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size, group, head_dim", PREFILL_SHAPES)
def test_prefill_matches_reference(device, dtype, block_size, group, head_dim):
    kv_heads = 2
    batch, q, starts, lens = prefill_inputs(PREFILL_SEQS, block_size=block_size,
                                            kv_heads=kv_heads, heads=kv_heads * group,
                                            head_dim=head_dim, dtype=dtype, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, starts, lens, head_dim ** -0.5)
    out = kernels.paged_prefill_attention(*args)
    assert out.dtype == dtype and out.shape == q.shape
    assert_close(out, ref.paged_prefill_attention_ref(*args), dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_prefill_over_a_latent_cache(device, dtype):
    """MLA's absorbed prefill: every query head on one latent "head", values a strided view of
    the keys' leading columns."""
    latent, rope_dim = 32, 16
    batch, q, starts, lens = prefill_inputs(PREFILL_SEQS, block_size=16, kv_heads=1, heads=20,
                                            head_dim=latent + rope_dim, dtype=dtype,
                                            device=device)
    args = (q, batch.k_cache, batch.k_cache[..., :latent], batch.block_tables, starts, lens, 0.1)
    out = kernels.paged_prefill_attention(*args)
    assert out.shape == (q.shape[0], 20, latent)
    assert_close(out, ref.paged_prefill_attention_ref(*args), dtype)


@pytest.mark.parametrize("window, alibi", WINDOW_ALIBI)
def test_prefill_window_and_alibi(device, window, alibi):
    heads = 4
    batch, q, starts, lens = prefill_inputs(PREFILL_SEQS, block_size=16, kv_heads=2,
                                            heads=heads, head_dim=32, dtype=torch.float32,
                                            device=device, v_head_dim=16)
    slopes = slopes_for(heads, device) if alibi else None
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, starts, lens, 0.2)
    out = kernels.paged_prefill_attention(*args, sliding_window=window, alibi_slopes=slopes)
    expected = ref.paged_prefill_attention_ref(*args, sliding_window=window,
                                               alibi_slopes=slopes)
    assert_close(out, expected, torch.float32)


def test_chunked_prefill_equals_whole_prefill(device):
    """Store K/V and attend chunk by chunk (prefix hit, then the rest) == one whole prefill."""
    kv_heads, heads, head_dim, block_size, n = 2, 4, 32, 16, 45
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(n, heads, head_dim, generator=gen).to(device)
    k = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    v = torch.randn(n, kv_heads, head_dim, generator=gen).to(device)
    k_cache = torch.zeros(8, block_size, kv_heads, head_dim, device=device)
    v_cache = torch.zeros_like(k_cache)
    table = torch.tensor([[5, 2, 7, 0]], dtype=torch.int32, device=device)
    pos = torch.arange(n, device=device)
    slots = table[0].long()[pos // block_size] * block_size + pos % block_size
    kernels.store_kv(k, v, k_cache, v_cache, slots)

    def run(lo: int, hi: int) -> torch.Tensor:
        return kernels.paged_prefill_attention(
            q[lo:hi], k_cache, v_cache, table,
            torch.tensor([0, hi - lo], dtype=torch.int32, device=device),
            torch.tensor([hi], dtype=torch.int32, device=device), 0.2)

    whole = run(0, n)
    chunked = torch.cat([run(0, 19), run(19, n)])
    assert_close(chunked, whole, torch.float32)
    expected = dense_attention(q, k, v, pos, 0.2, None, None)
    assert_close(whole, expected, torch.float32)
    # The last token alone is a decode: the decode kernel must agree.
    decode = kernels.paged_decode_attention(q[n - 1:], k_cache, v_cache, table,
                                            torch.tensor([n], dtype=torch.int32, device=device),
                                            0.2)
    assert_close(decode, whole[n - 1:], torch.float32)


# --------------------------------------------------------------------------------------------
# FP8 KV caches (kv_cache_dtype): entries are value / kv_scale in one byte
# --------------------------------------------------------------------------------------------

FP8_KV = [pytest.param(torch.float8_e4m3fn, id="e4m3"), pytest.param(torch.float8_e5m2, id="e5m2")]


def to_fp8(batch: PagedBatch, kv_dtype: torch.dtype, kv_scale: float) -> PagedBatch:
    """The same batch over FP8 caches: every slot (noise included) quantized with kv_scale."""
    return PagedBatch(to_cache(batch.k_cache.float(), kv_dtype, kv_scale),
                      to_cache(batch.v_cache.float(), kv_dtype, kv_scale), batch.block_tables,
                      batch.lens, batch.dense_k, batch.dense_v)


@pytest.mark.parametrize("kv_dtype", FP8_KV)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_store_kv_into_fp8_cache(device, dtype, kv_dtype):
    """The kernel stores exactly the reference's bytes: value / scale, rounded, saturated."""
    kv_heads, head_dim, block_size, scale = 2, 64, 16, 0.05
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(6, kv_heads, head_dim, generator=gen).to(device, dtype)
    v = torch.randn(6, kv_heads, head_dim, generator=gen).to(device, dtype)
    k[0, 0, 0] = 1e4  # / 0.05 is past both formats' largest finite value: saturates
    slots = torch.tensor([3, -1, 17, 40, 0, 63], device=device)
    k_cache = torch.zeros(4, block_size, kv_heads, head_dim, device=device, dtype=kv_dtype)
    v_cache = torch.zeros_like(k_cache)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kv_ref(k, v, expected_k, expected_v, slots, kv_scale=scale)
    kernels.store_kv(k, v, k_cache, v_cache, slots, kv_scale=scale)
    assert k_cache.dtype == kv_dtype
    assert torch.equal(k_cache.view(torch.uint8), expected_k.view(torch.uint8))
    assert torch.equal(v_cache.view(torch.uint8), expected_v.view(torch.uint8))
    assert from_cache(k_cache[0, 3, 0, 0], torch.float32, scale) == \
        torch.finfo(kv_dtype).max * scale
    # Read back, a value is within the format's rounding of what was stored.
    back = from_cache(v_cache[2, 8], torch.float32, scale)  # slot 40: token 3
    rel = {torch.float8_e4m3fn: 2 ** -4, torch.float8_e5m2: 2 ** -3}[kv_dtype]
    assert torch.allclose(back, v[3].float(), rtol=rel, atol=scale * 2 ** -9)


@pytest.mark.parametrize("kv_dtype", FP8_KV)
@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_and_prefill_read_fp8_cache(device, dtype, kv_dtype):
    """Over an FP8 cache (scale != 1, GQA, long contexts split, a prefix hit), both attention
    kernels equal the reference on the dequantized entries."""
    kv_heads, heads, head_dim, block_size, scale = 2, 8, 64, 16, 0.25
    batch = to_fp8(make_paged_batch([1, 30, 300], block_size=block_size, kv_heads=kv_heads,
                                    head_dim=head_dim, dtype=dtype, device=device),
                   kv_dtype, scale)
    q = random_q(3, heads, head_dim, dtype, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, head_dim ** -0.5)
    expected = ref.paged_decode_attention_ref(*args, kv_scale=scale)
    for num_splits in (1, 3):
        assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits,
                                                    kv_scale=scale), expected, dtype)
    # The scale is applied: reading the same bytes with scale 1 gives another answer.
    assert not torch.allclose(ref.paged_decode_attention_ref(*args).float(), expected.float(),
                              atol=1e-2)

    batch, q, starts, lens = prefill_inputs(PREFILL_SEQS, block_size=block_size,
                                            kv_heads=kv_heads, heads=heads, head_dim=head_dim,
                                            dtype=dtype, device=device)
    batch = to_fp8(batch, kv_dtype, scale)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, starts, lens, head_dim ** -0.5)
    out = kernels.paged_prefill_attention(*args, kv_scale=scale)
    assert out.dtype == dtype
    assert_close(out, ref.paged_prefill_attention_ref(*args, kv_scale=scale), dtype)

