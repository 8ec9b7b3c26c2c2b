"""Triton kernels vs their torch references, and the references vs dense attention / the layers.

Without CUDA the kernels run in triton's interpreter (TRITON_INTERPRET=1, set by
tests/kernel_harness.py before anything imports triton's kernels) on CPU tensors; with CUDA the
same tests run natively on the GPU, adding bf16. The interpreter cannot test bf16 (its bf16 tl.dot
returns garbage and its fp32->bf16 cast truncates), and accepts code a GPU compile rejects:
`test_kernels_compile_for_hopper` compiles every kernel for sm_90 ahead of time to close that gap.
Prefill / extend attention and the FP8 KV cache tests are in tests/test_kernels_prefill.py; the
per-layer kernels around attention (RMSNorm, rotary with its fused q/k norms and K/V store, the
SiLU-gated activation) in tests/test_kernels_layers.py.
"""

from __future__ import annotations

# First: without CUDA the harness switches triton to its interpreter before triton loads.
from tests.kernel_harness import (DTYPES, WINDOW_ALIBI, assert_close, dense_attention, dtype_id,
                                  make_paged_batch, random_q, slopes_for)
from tests.kernel_harness import device_fixture  # noqa: F401  (the `device` fixture)

# isort: split

import json  # noqa: E402
import os  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from ksana_llm import kernels  # noqa: E402
from ksana_llm.kernels import reference as ref  # noqa: E402

# --------------------------------------------------------------------------------------------
# The references are right: dense attention, and the layers' own norm / rotary.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("window, alibi", WINDOW_ALIBI)
def test_attention_references_match_dense_sdpa(window, alibi):
    heads, kv_heads, head_dim = 4, 2, 16
    batch = make_paged_batch([1, 30, 75], block_size=8, kv_heads=kv_heads, head_dim=head_dim,
                             v_head_dim=12, dtype=torch.float32, device="cpu")
    slopes = slopes_for(heads, "cpu") if alibi else None
    scale = head_dim ** -0.5
    lens = torch.tensor(batch.lens, dtype=torch.int32)
    q = random_q(3, heads, head_dim, torch.float32, "cpu")
    decode = ref.paged_decode_attention_ref(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                            lens, scale, sliding_window=window,
                                            alibi_slopes=slopes)
    for b, n in enumerate(batch.lens):
        expected = dense_attention(q[b:b + 1], batch.dense_k[b], batch.dense_v[b],
                                   torch.tensor([n - 1]), scale, window, slopes)
        torch.testing.assert_close(decode[b:b + 1], expected, atol=1e-5, rtol=1e-5)

    q_lens = [1, 12, 75]  # a decode-like chunk, a chunk after a cached prefix, a full prefill
    starts = torch.tensor([0, 1, 13, 88], dtype=torch.int32)
    qp = random_q(88, heads, head_dim, torch.float32, "cpu")
    prefill = ref.paged_prefill_attention_ref(qp, batch.k_cache, batch.v_cache,
                                              batch.block_tables, starts, lens, scale,
                                              sliding_window=window, alibi_slopes=slopes)
    for b, (n, m) in enumerate(zip(batch.lens, q_lens, strict=True)):
        s = int(starts[b])
        expected = dense_attention(qp[s:s + m], batch.dense_k[b], batch.dense_v[b],
                                   torch.arange(n - m, n), scale, window, slopes)
        torch.testing.assert_close(prefill[s:s + m], expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=dtype_id)
@pytest.mark.parametrize("multiply_fp32", [False, True], ids=["llama-order", "weight-in-fp32"])
def test_rms_norm_reference_matches_layer(dtype, multiply_fp32):
    from ksana_llm.layers.norm import RMSNorm

    gen = torch.Generator().manual_seed(0)
    norm = RMSNorm(48, eps=1e-5).to(dtype)
    norm.weight_in_float32 = multiply_fp32
    with torch.no_grad():
        norm.weight.copy_(torch.randn(48, generator=gen))
    x = torch.randn(5, 48, generator=gen).to(dtype)
    residual = torch.randn(5, 48, generator=gen).to(dtype)
    order = {"weight_in_float32": multiply_fp32}
    with torch.no_grad():
        assert torch.equal(ref.rms_norm_ref(x, norm.weight, 1e-5, **order), norm(x))
        out, new_residual = ref.rms_norm_ref(x, norm.weight, 1e-5, residual, **order)
        layer_out, layer_residual = norm(x, residual)
    assert torch.equal(out, layer_out) and torch.equal(new_residual, layer_residual)


def test_rotary_reference_matches_layer():
    from ksana_llm.layers.rotary import RotaryEmbedding, apply_rotary

    rope = RotaryEmbedding(32, max_positions=64, theta=10000.0)
    positions = torch.tensor([0, 5, 63, 17])
    cos, sin = rope.cos_sin(positions, torch.float32)  # [T, 1, D/2]
    x = torch.randn(4, 3, 32, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(ref.rotary_ref(x, cos, sin), apply_rotary(x, cos, sin),
                               atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize("name", ["silu", "swish"])
def test_silu_and_mul_reference_matches_layer(name):
    """The layer's torch path (fused kernels off), which the kernel replaces under them."""
    from ksana_llm.layers.activation import get_gated_activation

    x = torch.randn(3, 2, 40, generator=torch.Generator().manual_seed(0)) * 4
    assert torch.equal(ref.silu_and_mul_ref(x), get_gated_activation(name)(x))


# --------------------------------------------------------------------------------------------
# KV store
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_store_kv_writes_slots_and_skips_padding(device, dtype):
    kv_heads, head_dim, v_head_dim, block_size = 2, 80, 48, 16
    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(6, block_size, kv_heads, head_dim, generator=gen).to(device, dtype)
    v_cache = torch.randn(6, block_size, kv_heads, v_head_dim, generator=gen).to(device, dtype)
    # k and v as strided views of one fused projection output, as the models produce them.
    fused = torch.randn(7, kv_heads * (head_dim + v_head_dim) + 8, generator=gen).to(device, dtype)
    k = fused[:, :kv_heads * head_dim].view(7, kv_heads, head_dim)
    v = fused[:, kv_heads * head_dim:kv_heads * (head_dim + v_head_dim)].view(7, kv_heads,
                                                                             v_head_dim)
    slots = torch.tensor([17, -1, 0, 95, 40, -1, 63], device=device)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    ref.store_kv_ref(k, v, expected_k, expected_v, slots)
    kernels.store_kv(k, v, k_cache, v_cache, slots)
    assert torch.equal(k_cache, expected_k) and torch.equal(v_cache, expected_v)
    assert torch.equal(k_cache[1, 1], k[0]) and torch.equal(v_cache[5, 15], v[3])  # slot 17, 95


# --------------------------------------------------------------------------------------------
# Decode attention
# --------------------------------------------------------------------------------------------

DECODE_SHAPES = [  # (block_size, q heads per kv head, head_dim)
    pytest.param(8, 1, 64, id="bs8-mha-d64"),
    pytest.param(16, 2, 80, id="bs16-gqa2-d80"),
    pytest.param(32, 4, 64, id="bs32-gqa4-d64"),
    pytest.param(64, 2, 96, id="bs64-gqa2-d96"),
    pytest.param(1, 2, 32, id="bs1-gqa2-d32"),
    pytest.param(256, 4, 128, id="bs256-gqa4-d128"),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("block_size, group, head_dim", DECODE_SHAPES)
def test_decode_matches_reference(device, dtype, block_size, group, head_dim):
    kv_heads = 2
    batch = make_paged_batch([1, 9, 47, 100], block_size=block_size, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=dtype, device=device)
    q = random_q(4, kv_heads * group, head_dim, dtype, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    scale = head_dim ** -0.5
    out = kernels.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                         lens, scale)
    expected = ref.paged_decode_attention_ref(q, batch.k_cache, batch.v_cache,
                                              batch.block_tables, lens, scale)
    assert out.dtype == dtype and out.shape == (4, kv_heads * group, head_dim)
    assert_close(out, expected, dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
@pytest.mark.parametrize("heads", [16, 20, 40])
def test_decode_latent_cache_with_head_blocks(device, dtype, heads):
    """MLA's layout: one latent "head" shared by every query head, values a view of the keys'
    leading columns (no V cache of its own). Groups wider than MAX_HEAD_BLOCK split into head
    blocks (20 heads: a full block and a partial one); long enough to split the context too."""
    from ksana_llm.kernels.decode_attention import MAX_HEAD_BLOCK, head_blocks

    latent, rope_dim = 32, 16
    batch = make_paged_batch([1, 40, 300], block_size=16, kv_heads=1,
                             head_dim=latent + rope_dim, dtype=dtype, device=device)
    values = batch.k_cache[..., :latent]  # a strided view: each row is latent + rope_dim long
    assert values.stride(1) == latent + rope_dim
    q = random_q(3, heads, latent + rope_dim, dtype, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, values, batch.block_tables, lens, 0.1)
    expected = ref.paged_decode_attention_ref(*args)
    assert head_blocks(heads) == -(-heads // MAX_HEAD_BLOCK)
    for num_splits in (None, 3):
        out = kernels.paged_decode_attention(*args, num_splits=num_splits)
        assert out.shape == (3, heads, latent)
        assert_close(out, expected, dtype)


def test_head_dim_tiles_cover_the_head_and_split_only_where_it_saves_work():
    """The attention kernels read a head as a power-of-two tile plus a tail tile (summing their
    products with the keys) where that is smaller than one padded tile."""
    from ksana_llm.kernels._common import MIN_DOT_DIM, dot_tile, head_dim_tiles

    def pow2(n: int) -> bool:
        return n & (n - 1) == 0

    for head_dim in range(1, 1200):
        main, tail = head_dim_tiles(head_dim)
        assert main + tail >= head_dim and main + tail <= dot_tile(head_dim)
        assert pow2(main) and main >= MIN_DOT_DIM
        assert tail == 0 or (pow2(tail) and MIN_DOT_DIM <= tail < main and main < head_dim)
        if tail == 0:
            assert main == dot_tile(head_dim)
    assert head_dim_tiles(576) == (512, 64)  # MLA's latent + rope: not one 1024-wide tile
    assert head_dim_tiles(128) == (128, 0)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_attention_at_mla_dims(device, dtype):
    """DeepSeek V3's own latent (512) and rope (64) widths, read as a 512 tile plus a 64 tail:
    decode (with a split context) and absorbed prefill over the same paged latents."""
    latent, rope_dim, heads = 512, 64, 16
    batch = make_paged_batch([1, 70], block_size=64, kv_heads=1, head_dim=latent + rope_dim,
                             dtype=dtype, device=device)
    values = batch.k_cache[..., :latent]
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    q = random_q(2, heads, latent + rope_dim, dtype, device)
    args = (q, batch.k_cache, values, batch.block_tables, lens, 0.05)
    for num_splits in (None, 2):
        out = kernels.paged_decode_attention(*args, num_splits=num_splits)
        assert out.shape == (2, heads, latent)
        assert_close(out, ref.paged_decode_attention_ref(*args), dtype)

    q_lens = torch.tensor([1, 37], dtype=torch.int32, device=device)  # 33 cached for the second
    starts = torch.nn.functional.pad(q_lens.cumsum(0), (1, 0)).to(torch.int32)
    qp = random_q(int(q_lens.sum()), heads, latent + rope_dim, dtype, device, seed=5)
    prefill_args = (qp, batch.k_cache, values, batch.block_tables, starts, lens, 0.05)
    out = kernels.paged_prefill_attention(*prefill_args)
    assert out.shape == (qp.shape[0], heads, latent)
    assert_close(out, ref.paged_prefill_attention_ref(*prefill_args), dtype)


@pytest.mark.parametrize("window, alibi", WINDOW_ALIBI)
def test_decode_window_and_alibi(device, window, alibi):
    heads, kv_heads, head_dim = 4, 2, 32
    batch = make_paged_batch([3, 24, 25, 90], block_size=16, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=torch.float32, device=device)
    q = random_q(4, heads, head_dim, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    slopes = slopes_for(heads, device) if alibi else None
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.2)
    out = kernels.paged_decode_attention(*args, sliding_window=window, alibi_slopes=slopes)
    expected = ref.paged_decode_attention_ref(*args, sliding_window=window, alibi_slopes=slopes)
    assert_close(out, expected, torch.float32)


def test_choose_num_splits():
    # A full batch already fills the GPU: one split, no reduce pass.
    assert kernels.choose_num_splits(256, 8, 1024, num_sms=132) == 1
    # Short contexts are never split.
    assert kernels.choose_num_splits(1, 8, 200, num_sms=132) == 1
    # One long sequence: split, but never below MIN_SPLIT_TOKENS per split.
    assert kernels.choose_num_splits(1, 8, 4096, num_sms=132) == 4096 // 256
    assert kernels.choose_num_splits(4, 8, 32768, num_sms=132) == 9  # ceil(2 * 132 / 32)
    # (fill, target) programs per SM: 160 programs fill 132 SMs once, not 4 times.
    assert kernels.choose_num_splits(20, 8, 4096, num_sms=132) == 1
    assert kernels.choose_num_splits(20, 8, 4096, num_sms=132, split_fill=(4, 8)) == 7
    assert kernels.choose_num_splits(20, 8, 1024, num_sms=132, split_fill=(4, 8)) == 4  # length


def test_decode_settings_from_the_environment(monkeypatch, device):
    """KSANA_DECODE_TILES / KSANA_DECODE_SPLIT_FILL (what `run.sh engine-qwen3-tuned` sets from
    the tuning sweep) replace the defaults; the result is the reference's; a bad value is a
    ValueError naming the variable."""
    from ksana_llm.kernels.decode_attention import _decode_config

    assert _decode_config(128, torch.bfloat16) == (64, 4, 2)
    monkeypatch.setenv("KSANA_DECODE_TILES", "128,8,3")
    monkeypatch.setenv("KSANA_DECODE_SPLIT_FILL", "4,8")
    assert _decode_config(128, torch.bfloat16) == (128, 8, 3)
    assert _decode_config(128, torch.float32) == (32, 4, 2)  # fp32 keeps its narrow tiles
    assert kernels.choose_num_splits(20, 8, 4096, num_sms=132) == 7
    batch = make_paged_batch([3, 700, 200], block_size=16, kv_heads=2, head_dim=64,
                             dtype=torch.float16, device=device)
    q = random_q(3, 4, 64, torch.float16, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.125)
    assert_close(kernels.paged_decode_attention(*args), ref.paged_decode_attention_ref(*args),
                 torch.float16)
    for name, bad, message in (("KSANA_DECODE_TILES", "48,4,2", "BLOCK_N must be a power"),
                               ("KSANA_DECODE_TILES", "64,4", "expected \\(BLOCK_N"),
                               ("KSANA_DECODE_SPLIT_FILL", "8,4", "0 < fill <= target"),
                               ("KSANA_DECODE_SPLIT_FILL", "x", "fill,target")):
        monkeypatch.setenv(name, bad)
        with pytest.raises(ValueError, match=name):
            kernels.paged_decode_attention(*args)
        with pytest.raises(ValueError, match=message):
            kernels.paged_decode_attention(*args)
        monkeypatch.delenv(name)


@pytest.mark.parametrize("dtype", DTYPES, ids=dtype_id)
def test_decode_long_context_splits(device, dtype):
    """Contexts long enough that the launcher splits them (flash-decoding), plus an empty
    sequence (context 0, a padded batch slot: output zeros)."""
    heads, kv_heads, head_dim, block_size = 4, 2, 32, 16
    batch = make_paged_batch([700, 0, 300], block_size=block_size, kv_heads=kv_heads,
                             head_dim=head_dim, dtype=dtype, device=device)
    capacity = batch.block_tables.shape[1] * block_size
    assert kernels.choose_num_splits(3, kv_heads, capacity, num_sms=132) > 1
    q = random_q(3, heads, head_dim, dtype, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, head_dim ** -0.5)
    expected = ref.paged_decode_attention_ref(*args)
    assert_close(kernels.paged_decode_attention(*args), expected, dtype)
    assert torch.count_nonzero(expected[1]) == 0
    # Split counts that do not divide the context, and more splits than tiles (empty splits).
    for num_splits in (3, 13):
        assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits), expected,
                     dtype)


def test_decode_splits_with_window_and_alibi(device):
    heads, kv_heads, head_dim = 4, 1, 32
    batch = make_paged_batch([650, 130], block_size=32, kv_heads=kv_heads, head_dim=head_dim,
                             dtype=torch.float32, device=device)
    q = random_q(2, heads, head_dim, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.15)
    kw = {"sliding_window": 300, "alibi_slopes": slopes_for(heads, device)}
    expected = ref.paged_decode_attention_ref(*args, **kw)
    assert_close(kernels.paged_decode_attention(*args, num_splits=4, **kw), expected,
                 torch.float32)


@pytest.mark.parametrize("tiles", [(16, 1, 1), (32, 2, 2), (128, 8, 3)])
def test_decode_launch_settings_for_tuning_compute_the_same(device, tiles):
    """`tiles` (the GPU tuning sweep's override): other tile widths, warps and pipeline depths,
    one split and several, over ragged contexts in blocks of 16."""
    batch = make_paged_batch([3, 70, 200], block_size=16, kv_heads=2, head_dim=64,
                             dtype=torch.float32, device=device)
    q = random_q(3, 4, 64, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.125)
    expected = ref.paged_decode_attention_ref(*args)
    for num_splits in (1, 3):
        assert_close(kernels.paged_decode_attention(*args, num_splits=num_splits, tiles=tiles),
                     expected, torch.float32)
    for bad, message in (((48, 4, 2), "BLOCK_N must be a power of two"),
                         ((64, 3, 2), "num_warps must be a power of two"),
                         ((64, 4), "expected \\(BLOCK_N")):
        with pytest.raises(ValueError, match=message):
            kernels.paged_decode_attention(*args, tiles=bad)


def test_decode_program_order_leaves_rows_in_place(device):
    """`order` (the runners' longest-first program order) changes which sequence a program
    takes, never where its output goes: the same rows as without, with one split or several,
    for GQA head blocks; the runners' order is longest context first, padding rows last."""
    from ksana_llm.runner.host_arrays import longest_first

    lens_list = [40, 0, 310, 5, 129]
    batch = make_paged_batch(lens_list, block_size=16, kv_heads=2, head_dim=32,
                             dtype=torch.float32, device=device)
    q = random_q(5, 8, 32, torch.float32, device)
    lens = torch.tensor(lens_list, dtype=torch.int32, device=device)
    args = (q, batch.k_cache, batch.v_cache, batch.block_tables, lens, 0.2)
    expected = ref.paged_decode_attention_ref(*args)
    order = longest_first(lens_list)
    assert order.tolist() == [2, 4, 0, 3, 1]
    assert longest_first([7, 7, 9], 5).tolist() == [2, 0, 1, 3, 4]  # ties keep row order
    for num_splits in (1, 3):
        out = kernels.paged_decode_attention(
            *args, num_splits=num_splits, order=torch.from_numpy(order).to(device))
        assert_close(out, expected, torch.float32)
    for bad in (torch.arange(4, dtype=torch.int32), torch.arange(5)):
        with pytest.raises(ValueError, match="order: expected int32 of shape \\(5,\\)"):
            kernels.paged_decode_attention(*args, order=bad.to(device))


def test_decode_writes_into_out_buffer(device):
    batch = make_paged_batch([5, 33], block_size=16, kv_heads=2, head_dim=32,
                             dtype=torch.float32, device=device)
    q = random_q(2, 4, 32, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    out = torch.full((2, 4, 32), float("nan"), device=device)
    result = kernels.paged_decode_attention(q, batch.k_cache, batch.v_cache, batch.block_tables,
                                            lens, 0.2, out=out)
    assert result is out
    assert_close(out, ref.paged_decode_attention_ref(q, batch.k_cache, batch.v_cache,
                                                     batch.block_tables, lens, 0.2),
                 torch.float32)


# --------------------------------------------------------------------------------------------
# API: input errors, lazy import, real GPU compilation
# --------------------------------------------------------------------------------------------


def test_bad_inputs_raise_value_errors_naming_the_field(device):
    batch = make_paged_batch([5, 9], block_size=8, kv_heads=2, head_dim=32,
                             dtype=torch.float32, device=device)
    q = random_q(2, 4, 32, torch.float32, device)
    lens = torch.tensor(batch.lens, dtype=torch.int32, device=device)
    caches = (batch.k_cache, batch.v_cache, batch.block_tables)
    with pytest.raises(ValueError, match="q:"):
        kernels.paged_decode_attention(q[..., :16], *caches, lens, 0.2)
    with pytest.raises(ValueError, match="q:"):
        kernels.paged_decode_attention(q.half(), *caches, lens, 0.2)
    with pytest.raises(ValueError, match="context_lens"):
        kernels.paged_decode_attention(q, *caches, lens[:1], 0.2)
    with pytest.raises(ValueError, match="alibi_slopes"):
        kernels.paged_decode_attention(q, *caches, lens, 0.2, alibi_slopes=torch.ones(3))
    with pytest.raises(ValueError, match="sliding_window"):
        kernels.paged_decode_attention(q, *caches, lens, 0.2, sliding_window=0)
    with pytest.raises(ValueError, match="softcap"):
        kernels.paged_decode_attention(q, *caches, lens, 0.2, softcap=0.0)
    with pytest.raises(ValueError, match="query_start_loc"):
        kernels.paged_prefill_attention(q, *caches, torch.zeros(2, dtype=torch.int32,
                                                                device=device), lens, 0.2)
    with pytest.raises(ValueError, match="slot_mapping"):
        kernels.store_kv(q[:, :2], q[:, :2], batch.k_cache, batch.v_cache, lens[:1])
    with pytest.raises(ValueError, match="weight"):
        kernels.rms_norm(q, torch.ones(5, device=device), 1e-6)


def test_package_imports_without_triton():
    code = (
        "import sys; sys.modules['triton'] = None\n"  # makes `import triton` fail
        "import ksana_llm.kernels as k, ksana_llm.layers.attention\n"
        "assert not k.triton_available()\n"
        "try:\n    k.paged_decode_attention\nexcept ImportError as e:\n    print('ERR', e)\n"
    )
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            env=env, timeout=120, check=False)
    assert result.returncode == 0, result.stderr
    assert "ERR ksana_llm.kernels.paged_decode_attention needs triton" in result.stdout


def test_triton_available_here():
    assert kernels.triton_available()


def test_kernels_compile_for_hopper():
    """Every kernel variant compiles for sm_90 down to a cubin and fits its shared memory — what
    the interpreter cannot tell (tile sizes tl.dot rejects, loop-carried types, resources)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    result = subprocess.run([sys.executable, "-m", "ksana_llm.kernels.compile_check", "--quick"],
                            capture_output=True, text=True, env=env, timeout=300, check=False)
    assert result.returncode == 0, result.stderr[-3000:]
    compiled = [json.loads(line) for line in result.stdout.splitlines()]
    names = {c["kernel"] for c in compiled}
    assert names == {"_store_kv_kernel", "_decode_kernel", "_reduce_kernel", "_prefill_kernel",
                     "_rms_norm_kernel", "_rotary_kernel", "_silu_mul_kernel", "_fp8_linear_kernel",
                     "_int4_linear_kernel", "_expert_matmul_kernel", "_expert_int4_matmul_kernel"}
    assert all(c["sm"] == 90 for c in compiled)
