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
@pytest.mark.parametrize("multiply_fp32", [False, True], ids=["llama-order", "weight-in-fp32"])
def test_rms_norm_matches_reference(device, dtype, weight_fp32, multiply_fp32):
    """`multiply_fp32`: OLMo 2's / GPT-OSS's order (weight times the fp32 row, then the cast)."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 100, generator=gen).to(device, dtype)  # non-power-of-two hidden
    residual = torch.randn(3, 5, 100, generator=gen).to(device, dtype)
    weight = torch.randn(100, generator=gen).to(device, torch.float32 if weight_fp32 else dtype)
    x_before, residual_before = x.clone(), residual.clone()
    order = {"weight_in_float32": multiply_fp32}

    out = kernels.rms_norm(x, weight, 1e-6, **order)
    expected = ref.rms_norm_ref(x, weight, 1e-6, **order)
    assert out.dtype == expected.dtype and out.shape == x.shape
    assert out.dtype == (dtype if multiply_fp32 else torch.promote_types(weight.dtype, dtype))
    assert_close(out, expected, dtype)

    out, new_residual = kernels.rms_norm(x, weight, 1e-6, residual, **order)
    expected, expected_residual = ref.rms_norm_ref(x, weight, 1e-6, residual, **order)
    assert_close(out, expected, dtype)
    assert torch.equal(new_residual, expected_residual)  # same single rounding of x + residual
    assert torch.equal(x, x_before) and torch.equal(residual, residual_before)


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d != torch.float32], ids=dtype_id)
@pytest.mark.parametrize("multiply_fp32", [False, True], ids=["llama-order", "weight-in-fp32"])
def test_rms_norm_rounds_in_the_order_asked(device, dtype, multiply_fp32):
    """The two orders differ by one rounding, under the tolerance above: count bit-equal
    elements instead. The kernel's own order matches nearly everywhere, the other one far less."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(64, 256, generator=gen).to(device, dtype)
    weight = (1 + torch.rand(256, generator=gen)).to(device, dtype)
    out = kernels.rms_norm(x, weight, 1e-6, weight_in_float32=multiply_fp32)

    def equal_fraction(order: bool) -> float:
        expected = ref.rms_norm_ref(x, weight, 1e-6, weight_in_float32=order)
        return (out == expected).float().mean().item()

    assert equal_fraction(multiply_fp32) > 0.97
    assert equal_fraction(not multiply_fp32) < 0.9


@pytest.mark.parametrize("multiply_fp32", [False, True], ids=["llama-order", "weight-in-fp32"])
def test_rms_norm_layer_keeps_its_order_on_the_kernel(device, multiply_fp32):
    """`RMSNorm(weight_in_float32=...)` (GPT-OSS, OLMo 2) takes the fused kernel too, and rounds
    as its torch path does (bit-equal nearly everywhere in float16, where the orders differ)."""
    from ksana_llm.layers.fused_kernels import use_fused_kernels
    from ksana_llm.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(2)
    norm = RMSNorm(256, 1e-5).to(device, torch.float16)
    norm.weight_in_float32 = multiply_fp32
    with torch.no_grad():
        norm.weight.copy_(1 + torch.rand(256, generator=gen))
    x = torch.randn(64, 256, generator=gen).to(device, torch.float16)
    residual = torch.randn(64, 256, generator=gen).to(device, torch.float16)
    calls = []
    real = kernels.rms_norm

    def counted(*args, **kwargs):
        calls.append(kwargs)
        return real(*args, **kwargs)

    with torch.no_grad():
        torch_out, torch_residual = norm(x, residual)
        kernels.rms_norm = counted
        try:
            with use_fused_kernels(True):
                fused_out, fused_residual = norm(x, residual)
        finally:
            kernels.rms_norm = real
    assert calls == [{"weight_in_float32": multiply_fp32}]
    assert torch.equal(fused_residual, torch_residual)
    assert (fused_out == torch_out).float().mean().item() > 0.97


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
