"""The per-layer Triton kernels around attention against their torch references: RMSNorm (+
residual), rotary on the fused QKV output's views (with Qwen3's q/k norms and the K/V store
fused in), and SwiGLU's silu(gate) * up. Run as tests/test_kernels.py is (see its docstring):
in the interpreter on CPU, natively on a GPU."""

from __future__ import annotations

# First: without CUDA the harness switches triton to its interpreter before triton loads.
from tests.kernel_harness import DTYPES, assert_close, dtype_id
from tests.kernel_harness import device_fixture  # noqa: F401  (the `device` fixture)

# isort: split

import pytest  # noqa: E402
import torch  # noqa: E402

from ksana_llm import kernels  # noqa: E402
from ksana_llm.kernels import reference as ref  # noqa: E402
from ksana_llm.kernels._common import CacheWrite  # noqa: E402


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("weight_fp32", [False, True], ids=["weight-same", "weight-fp32"])
def test_rms_norm_matches_reference(device, dtype, weight_fp32):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 100, generator=gen).to(device, dtype)  # non-power-of-two hidden
    residual = torch.randn(3, 5, 100, generator=gen).to(device, dtype)
    weight = torch.randn(100, generator=gen).to(device, torch.float32 if weight_fp32 else dtype)
    x_before, residual_before = x.clone(), residual.clone()

    out = kernels.rms_norm(x, weight, 1e-6)
    expected = ref.rms_norm_ref(x, weight, 1e-6)
    assert out.dtype == expected.dtype and out.shape == x.shape
    assert_close(out, expected, dtype)

    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual)
    expected, expected_residual = ref.rms_norm_ref(x, weight, 1e-6, residual)
    assert_close(out, expected, dtype)
    assert torch.equal(new_residual, expected_residual)  # same single rounding of x + residual
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_in_place_on_fused_qkv_views(device, dtype, rotary_dim):
    tokens, heads, kv_heads, head_dim = 5, 4, 2, 64
    gen = torch.Generator().manual_seed(0)
    qkv = torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen).to(device, dtype)
    before = qkv.clone()
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    angles = torch.rand(tokens, rotary_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    expected_q, expected_k = ref.rotary_ref(q, cos, sin), ref.rotary_ref(k, cos, sin)
    kernels.apply_rotary_(q, k, cos.unsqueeze(1), sin.unsqueeze(1))  # [T, 1, R/2] like the layer
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # V untouched
    if rotary_dim < head_dim:  # dims past the rotary dim pass through
        assert torch.equal(q[..., rotary_dim:], before[:, :heads * head_dim]
                           .view(tokens, heads, head_dim)[..., rotary_dim:])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rotary_dim", [64, 32], ids=["full", "partial"])
def test_rotary_with_q_k_norms_in_place_on_fused_qkv_views(device, dtype, rotary_dim):
    """Qwen3's order: each head RMS-normalised with its own weight (all head dims, also those
    past the rotary dim), then rotated, in the one launch, on the fused QKV output's views."""
    tokens, heads, kv_heads, head_dim, eps = 5, 4, 2, 64, 1e-6
    gen = torch.Generator().manual_seed(1)
    qkv = (torch.randn(tokens, (heads + 2 * kv_heads) * head_dim, generator=gen) * 3).to(device,
                                                                                          dtype)
    before = qkv.clone()
    q = qkv[:, :heads * head_dim].view(tokens, heads, head_dim)
    k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(tokens, kv_heads, head_dim)
    q_weight, k_weight = (torch.randn(head_dim, generator=gen).to(device, dtype)
                          for _ in range(2))
    angles = torch.rand(tokens, rotary_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    expected_q = ref.rotary_ref(ref.rms_norm_ref(q, q_weight, eps), cos, sin)
    expected_k = ref.rotary_ref(ref.rms_norm_ref(k, k_weight, eps), cos, sin)
    kernels.apply_rotary_(q, k, cos.unsqueeze(1), sin.unsqueeze(1),
                          norm_weights=(q_weight, k_weight), eps=eps)
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    v_start = (heads + kv_heads) * head_dim
    assert torch.equal(qkv[:, v_start:], before[:, v_start:])  # V untouched
    with pytest.raises(ValueError, match="norm_weights: k's weight"):
        kernels.apply_rotary_(q, k, cos, sin, norm_weights=(q_weight, k_weight[:32]))
    with pytest.raises(ValueError, match="norm_weights: q's weight"):
        kernels.apply_rotary_(q, k, cos, sin, norm_weights=(q_weight.double(), k_weight))


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("width", [48, 2500], ids=["narrow", "several-programs"])
def test_silu_and_mul_matches_reference(device, dtype, width):
    gen = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 3, 2 * width, generator=gen) * 4).to(device, dtype)
    before = x.clone()
    out = kernels.silu_and_mul(x)
    expected = ref.silu_and_mul_ref(x)
    assert out.shape == (2, 3, width) and out.dtype == dtype
    assert_close(out, expected, dtype)
    assert torch.equal(x, before)
    assert kernels.silu_and_mul(x[:0]).shape == (0, 3, width)
    with pytest.raises(ValueError, match="x: expected"):
        kernels.silu_and_mul(x[..., :-1])


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("rotary_dim, norm", [(64, False), (32, False), (64, True), (32, True)],
                         ids=["full", "partial", "full-norm", "partial-norm"])
def test_rotary_writes_the_finished_k_and_v_into_the_cache(device, dtype, rotary_dim, norm):
    """`write_kv`: q and k end as without the write (the references' rotation, after the norms);
    the cache holds exactly the finished K and the step's V at each token's slot (the values the
    kernel wrote into k, bit for bit) and nothing else changed; padding slots are skipped."""
    tokens, heads, kv_heads, head_dim, v_head_dim, block_size = 6, 4, 2, 64, 48, 8
    gen = torch.Generator().manual_seed(3)
    qkv = torch.randn(tokens, (heads + kv_heads) * head_dim + kv_heads * v_head_dim,
                      generator=gen).to(device, dtype)
    k_cache = torch.randn(5, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(5, block_size, kv_heads, v_head_dim, generator=gen).to(device, dtype)
    slots = torch.tensor([9, -1, 0, 39, 20, 21], device=device)
    angles = torch.rand(tokens, rotary_dim // 2, generator=gen) * 6.0
    cos, sin = angles.cos().to(device, dtype), angles.sin().to(device, dtype)
    weights = [torch.randn(head_dim, generator=gen).to(device, dtype) for _ in range(2)]
    sections = (heads * head_dim, kv_heads * head_dim, kv_heads * v_head_dim)
    q, k, v = (part.view(tokens, -1, width) for part, width in
               zip(qkv.split(sections, dim=-1), (head_dim, head_dim, v_head_dim)))
    expected_q, expected_k = ((ref.rms_norm_ref(x, w, 1e-6) if norm else x)
                              for x, w in zip((q, k), weights))
    expected_q, expected_k = ref.rotary_ref(expected_q, cos, sin), ref.rotary_ref(expected_k,
                                                                                    cos, sin)
    v_before, k_cache_before, v_cache_before = v.clone(), k_cache.clone(), v_cache.clone()
    kernels.apply_rotary_(q, k, cos, sin, norm_weights=tuple(weights) if norm else None,
                          write_kv=CacheWrite(v, k_cache, v_cache, slots))
    assert_close(q, expected_q, dtype)
    assert_close(k, expected_k, dtype)
    assert torch.equal(v, v_before)
    ref.store_kv_ref(k, v, k_cache_before, v_cache_before, slots)  # what k and v now hold
    assert torch.equal(k_cache, k_cache_before) and torch.equal(v_cache, v_cache_before)
    with pytest.raises(ValueError, match="write_kv: the cache's dtype"):
        kernels.apply_rotary_(q, k, cos, sin, write_kv=CacheWrite(
            v, k_cache.to(torch.float8_e4m3fn), v_cache.to(torch.float8_e4m3fn), slots))
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.apply_rotary_(q, k, cos, sin, write_kv=CacheWrite(v, k_cache, v_cache, slots[:2]))
