"""Int8 activations, one scale per token (W8A8 checkpoints, `layers.int8_activations`): the
codes and scales against compressed-tensors' own functions, the int8 matmul against the
dequantized product, and the projections and MoE experts that quantize their inputs so. The
checkpoint end to end is in tests/test_quantized_checkpoints.py, over two gloo ranks in
tests/test_quantized_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

from ksana_llm.layers.int8_activations import (dequantize_tokens, int8_codes_matmul,
                                               quantize_tokens, token_absmax)
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.moe import FusedExperts
from ksana_llm.layers.moe_routers import Routing
from ksana_llm.layers.parallel import RowParallelLinear
from ksana_llm.loader.quantized_weight import QuantizedWeight

INT8 = torch.int8


def library_token_args():
    """compressed-tensors' W8A8 preset's activation settings (int8, symmetric, dynamic, per
    token)."""
    from compressed_tensors.quantization import preset_name_to_scheme

    return preset_name_to_scheme("W8A8", ["Linear"]).input_activations


def library_fake_quantized(x: torch.Tensor) -> torch.Tensor:
    """x quantized per token and back by compressed-tensors (tokens along every dim but the
    last, as the library treats a [batch, tokens, features] input)."""
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    args = library_token_args()
    batched = x.reshape(1, -1, x.shape[-1])
    scale, zero_point = compute_dynamic_scales_and_zp(batched, args, module=None)
    return fake_quantize(batched, scale, zero_point, args).reshape(x.shape)


def int8_rows(rows: int, cols: int, seed: int, group_size: int | None = None,
              int8_activations: bool = True) -> QuantizedWeight:
    """Random int8 codes with positive scales, per row (or per group of `group_size`)."""
    generator = torch.Generator().manual_seed(seed)
    group = group_size or cols
    codes = torch.randint(-128, 128, (rows, cols), generator=generator, dtype=INT8)
    scale = torch.rand(rows, -(-cols // group), generator=generator) / 100 + 1e-3
    return QuantizedWeight(codes, scale, group, int8_activations=int8_activations)


def test_token_codes_and_scales_are_the_librarys():
    """Each token's scale (largest magnitude / 127.5) and codes (rounded, clamped to
    [-128, 127]) equal compressed-tensors'; an all-zero token gets codes 0."""
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    torch.manual_seed(0)
    x = torch.randn(1, 9, 96) * torch.logspace(-3, 2, 9).reshape(1, 9, 1)
    x[0, 4] = 0.0
    x[0, 6, 5] = 1e4  # one large value: the rest of the token rounds near zero
    args = library_token_args()
    scale, zero_point = compute_dynamic_scales_and_zp(x, args, module=None)
    expected_codes = quantize(x, scale, zero_point, args, dtype=INT8)
    codes, ours = quantize_tokens(x)
    assert codes.dtype == INT8
    assert torch.equal(codes, expected_codes)
    nonzero = torch.arange(9) != 4
    torch.testing.assert_close(ours[0, nonzero], scale[0, nonzero], atol=0, rtol=0)
    assert int(codes.min()) == -128 or int(codes.max()) == 127
    torch.testing.assert_close(dequantize_tokens(codes, ours, x.dtype),
                               library_fake_quantized(x), atol=0, rtol=0)


def test_int8_codes_matmul_equals_the_dequantized_product():
    """int32 sums of code products, scaled per token and per row, + bias: the product of the
    dequantized operands, for float32 and bfloat16 outputs and batched inputs."""
    torch.manual_seed(1)
    x = torch.randn(2, 5, 200)
    codes, token_scale = quantize_tokens(x)
    weight = int8_rows(48, 200, seed=2)
    bias = torch.randn(48)
    out = int8_codes_matmul(codes, token_scale, weight.data, weight.scale, bias, torch.float32)
    expected = dequantize_tokens(codes, token_scale, torch.float64) \
        @ weight.dequantize(torch.float64).t() + bias.double()
    assert out.shape == (2, 5, 48)
    torch.testing.assert_close(out.double(), expected, atol=1e-5, rtol=1e-5)
    half = int8_codes_matmul(codes, token_scale, weight.data, weight.scale, bias.bfloat16(),
                             torch.bfloat16)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.double(), expected, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("group_size", [None, 32], ids=["per-row", "group"])
def test_projections_quantize_their_input_to_int8(group_size):
    """A fused projection and a row-parallel one holding W8A8 weights multiply the input
    quantized per token (per-row scales: on the int8 codes; group scales: dequantized into the
    W8A16 path), as the library's forward does; parts that disagree load dense, the
    activations then unquantized."""
    torch.manual_seed(3)
    parts = [int8_rows(rows, 64, seed=10 + i, group_size=group_size)
             for i, rows in enumerate((16, 8))]
    dense = torch.cat([p.dequantize() for p in parts])
    x = torch.randn(2, 5, 64)
    expected = library_fake_quantized(x) @ dense.t()
    fused = MergedLinear(64, [16, 8])
    for index, weight in enumerate(parts):
        fused.load_shard(fused.weight, weight, index)
    assert fused.weight.dtype == INT8 and fused.int8_activations
    torch.testing.assert_close(fused(x), expected, atol=1e-5, rtol=1e-5)
    # the test tells quantized inputs from unquantized ones
    assert (x @ dense.t() - expected).abs().max() > 1e-3

    row_parallel = RowParallelLinear(64, 16)
    row_parallel.load_checkpoint_tensor("weight", parts[0])
    assert row_parallel.int8_activations
    torch.testing.assert_close(row_parallel(x), expected[..., :16], atol=1e-5, rtol=1e-5)

    mixed = MergedLinear(64, [16, 8])
    mixed.load_shard(mixed.weight, parts[0], 0)
    mixed.load_shard(mixed.weight, int8_rows(8, 64, seed=11, group_size=group_size,
                                             int8_activations=False), 1)
    assert mixed.weight.dtype == torch.float32 and not mixed.int8_activations
    torch.testing.assert_close(mixed(x), x @ dense.t(), atol=1e-5, rtol=1e-5)


def test_a_row_parallel_slice_is_scaled_by_the_whole_token():
    """Given each token's largest magnitude over the whole input (what the ranks' all-reduce
    gives), a projection holding the slice of the input columns quantizes the slice as the
    whole input quantizes, so the partial sums add up to the one-rank product."""
    torch.manual_seed(4)
    weight = int8_rows(16, 64, seed=5)
    x = torch.randn(7, 64)
    whole = RowParallelLinear(64, 16)
    whole.load_checkpoint_tensor("weight", weight)
    halves = []
    for start in (0, 32):
        half = MergedLinear(32, [16])
        half.load_shard(half.weight, weight.columns(start, 32), 0)
        halves.append(half.project(x[:, start:start + 32], None, token_absmax(x)))
    torch.testing.assert_close(halves[0] + halves[1], whole(x), atol=1e-5, rtol=1e-5)
    unscaled = MergedLinear(32, [16])
    unscaled.load_shard(unscaled.weight, weight.columns(0, 32), 0)
    assert not torch.allclose(unscaled(x[:, :32]), halves[0], atol=1e-4)


def test_moe_experts_quantize_their_inputs_to_int8():
    """W8A8 experts: each active expert's gate/up input and down input quantized per token, as
    a reference written out here with the library's quantization computes. Group scales: the
    experts then dequantize into the same float matmuls as the reference, so the comparison is
    exact. (With per-row scales the int8 matmul's exact sums differ from float ones by an ulp,
    enough to move a token's negative extreme, which lands on the tie -127.5, by one step;
    projections prove that path above.)"""
    hidden, inter, num_experts = 64, 32, 3
    parts = {(e, part): int8_rows(*shape, seed=30 + 3 * e + i, group_size=16)
             for e in range(num_experts)
             for i, (part, shape) in enumerate((("gate", (inter, hidden)),
                                                ("up", (inter, hidden)),
                                                ("down", (hidden, inter))))}
    experts = FusedExperts(num_experts, hidden, inter)
    for (e, part), weight in parts.items():
        experts.load_checkpoint_tensor(f"{e}.{part}_proj.weight", weight)
    assert experts.w13.dtype == INT8 and experts.int8_activations == {"w13": True, "w2": True}
    torch.manual_seed(6)
    x = torch.randn(6, hidden)
    routing = Routing(weights=torch.rand(6, 2),
                      experts=torch.tensor([[0, 2], [2, 0], [0, 2], [2, 2], [0, 0], [2, 0]]))
    expected = torch.zeros(6, hidden)
    for token in range(6):
        for k in range(2):
            e = int(routing.experts[token, k])
            inputs = library_fake_quantized(x[token:token + 1])
            gate = inputs @ parts[(e, "gate")].dequantize().t()
            up = inputs @ parts[(e, "up")].dequantize().t()
            hidden_row = library_fake_quantized(torch.nn.functional.silu(gate) * up)
            expected[token] += routing.weights[token, k] * \
                (hidden_row @ parts[(e, "down")].dequantize().t())[0]
    torch.testing.assert_close(experts(x, routing), expected, atol=1e-5, rtol=1e-5)
