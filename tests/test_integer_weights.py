"""Integer weights with zero points: 4-bit codes held packed, two a byte
(`loader.quantized_weight.int4_weight`), and asymmetric 8-bit codes held as int8 beside their
zero points (`int8_weight`): the numbers each view of the record gives (formula written out
here), the projections and MoE experts that store them, and a LoRA adapter over a packed AWQ
base against PEFT. The
checkpoint formats that make them (GPTQ, AWQ, compressed-tensors int4) are proven against their
libraries in tests/test_gptq_awq_checkpoints.py and tests/test_quantized_checkpoints.py; the
Triton W4A16 matmul in tests/test_fp8_matmul.py.
"""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.moe import FusedExperts
from ksana_llm.layers.parallel import RowParallelLinear
from ksana_llm.loader.quantized_weight import QuantizedWeight, int4_weight, int8_weight
from ksana_llm.loader.weight_quant import PACKED_INT4_DTYPE, pack_nibbles, split_nibbles
from tests.tiny_models import build_tiny_model

INT8 = torch.int8


def random_int4(rows: int, cols: int, group: int, seed: int
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(codes 0..15, zero points 0..16 per group, scales) -- 16: GPTQ v1's stored zero point
    0 reads back as 16."""
    generator = torch.Generator().manual_seed(seed)
    groups = -(-cols // group)
    return (torch.randint(0, 16, (rows, cols), generator=generator),
            torch.randint(0, 17, (rows, groups), generator=generator),
            torch.rand(rows, groups, generator=generator) + 0.1)


def dequantized(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor, group: int
                ) -> torch.Tensor:
    """scale * (code - zero point), each group's own."""
    cols = codes.shape[1]
    expand = lambda t: t.repeat_interleave(group, dim=1)[:, :cols]  # noqa: E731
    return (codes.float() - expand(zeros).float()) * expand(scales)


def test_every_byte_splits_into_its_two_codes():
    """All 256 bytes: low nibble first (the order of the checkpoints' words), and packing is
    its inverse."""
    octets = torch.arange(256, dtype=torch.uint8).view(2, 128)
    fields = split_nibbles(octets)
    assert fields.shape == (2, 256)
    assert torch.equal(fields[:, 0::2], octets & 0xF) and torch.equal(fields[:, 1::2], octets >> 4)
    assert torch.equal(pack_nibbles(fields), octets)
    with pytest.raises(ValueError, match="even number of columns"):
        pack_nibbles(torch.zeros(2, 3, dtype=torch.uint8))


def test_packed_weight_views_hold_the_same_numbers():
    """Half a byte per weight; rows, group-aligned columns, per-row columns at any even
    boundary and the int8 form all give slices of scale * (code - zero)."""
    codes, zeros, scales = random_int4(12, 96, 32, seed=1)
    weight = int4_weight(codes, zeros, scales, 32)
    expected = dequantized(codes, zeros, scales, 32)
    assert weight.packed and weight.data.shape == (12, 48) and weight.shape == (12, 96)
    assert weight.zero_point.dtype == INT8
    torch.testing.assert_close(weight.dequantize(), expected, atol=0, rtol=0)
    torch.testing.assert_close(weight.rows(3, 5).dequantize(), expected[3:8], atol=0, rtol=0)
    for part, rows in zip(weight.split_rows([4, 8]), (slice(0, 4), slice(4, 12))):
        assert part.packed
        torch.testing.assert_close(part.dequantize(), expected[rows], atol=0, rtol=0)
    middle = weight.columns(32, 64)
    assert middle.packed and middle.scale.shape == (12, 2)
    torch.testing.assert_close(middle.dequantize(), expected[:, 32:], atol=0, rtol=0)
    inside = weight.columns(16, 48)  # from inside a group: groups of 16, still packed
    assert inside.packed and inside.group_size == 16 and inside.scale.shape == (12, 3)
    torch.testing.assert_close(inside.dequantize(), expected[:, 16:64], atol=0, rtol=0)
    odd = weight.columns(9, 30)  # an odd start: groups of one column would be no saving
    assert isinstance(odd, torch.Tensor) and odd.dtype == torch.float32
    torch.testing.assert_close(odd, expected[:, 9:39], atol=0, rtol=0)
    as_int8 = weight.unpacked()
    assert as_int8.data.dtype == INT8 and as_int8.zero_point is None
    torch.testing.assert_close(as_int8.dequantize(), expected, atol=0, rtol=0)

    # one zero point and scale per row: any even column range stays packed, odd ones as int8
    codes, zeros, scales = random_int4(4, 40, 40, seed=2)
    per_row = int4_weight(codes, zeros, scales, 40)
    expected = dequantized(codes, zeros, scales, 40)
    for start, count, packed in ((10, 20, True), (3, 11, False)):
        part = per_row.columns(start, count)
        assert part.packed == packed
        torch.testing.assert_close(part.dequantize(), expected[:, start:start + count],
                                   atol=0, rtol=0)


def test_what_packing_cannot_hold_comes_as_int8_or_is_refused():
    """An odd number of columns (a byte would hold two rows' codes) comes as int8 codes minus
    zero points; a record that breaks the layout is a ValueError naming what is wrong."""
    codes, zeros, scales = random_int4(3, 37, 19, seed=3)
    odd = int4_weight(codes, zeros, scales, 19)
    assert isinstance(odd, QuantizedWeight) and odd.data.dtype == INT8
    torch.testing.assert_close(odd.dequantize(), dequantized(codes, zeros, scales, 19),
                               atol=0, rtol=0)
    packed = pack_nibbles(torch.zeros(2, 8, dtype=torch.uint8))
    with pytest.raises(ValueError, match="need one int8 zero point per scale"):
        QuantizedWeight(packed, torch.ones(2, 1), 8)
    with pytest.raises(ValueError, match=r"zero points must lie in \(-112, 127\)"):
        QuantizedWeight(packed, torch.ones(2, 1), 8,
                        zero_point=torch.tensor([[-120], [3]], dtype=INT8))
    far = int4_weight(torch.full((2, 8), 15), torch.tensor([[-120], [3]]), torch.ones(2, 1), 8)
    assert far.data.dtype == INT8  # held as int8 codes instead, the same numbers
    torch.testing.assert_close(far.dequantize(), torch.tensor([[135.0] * 8, [12.0] * 8]),
                               atol=0, rtol=0)
    narrow = int4_weight(torch.zeros(2, 64, dtype=torch.long), torch.full((2, 1), 8),
                         torch.ones(2, 1), 64)
    wide_layer = MergedLinear(66, [2])
    with pytest.raises(ValueError, match="shard 0 has 64 columns, expected 66"):
        wide_layer.load_shard(wide_layer.weight, narrow, 0)
    with pytest.raises(ValueError, match="zero points belong to integer codes, one per scale"):
        QuantizedWeight(torch.zeros(2, 8, dtype=torch.float8_e4m3fn), torch.ones(2, 1), 8,
                        zero_point=torch.zeros(2, 1, dtype=INT8))
    with pytest.raises(ValueError, match="zero points belong to integer codes, one per scale"):
        QuantizedWeight(torch.zeros(2, 8, dtype=INT8), torch.ones(2, 1), 8,
                        zero_point=torch.zeros(2, 2, dtype=INT8))


def test_projections_store_packed_codes_and_multiply_by_them():
    """A fused projection keeps its packed parts as uint8 [rows, cols / 2] with their zero
    points and computes x @ W^T; a row-parallel one too; parts that disagree (packed and int8)
    load dense with both parts' numbers."""
    torch.manual_seed(0)
    parts = [random_int4(rows, 64, 32, seed=10 + i) for i, rows in enumerate((16, 8))]
    weights = [int4_weight(c, z, s, 32) for c, z, s in parts]
    dense = torch.cat([dequantized(c, z, s, 32) for c, z, s in parts])
    x = torch.randn(5, 64)
    fused = MergedLinear(64, [16, 8])
    for index, weight in enumerate(weights):
        fused.load_shard(fused.weight, weight, index)
    assert fused.weight.dtype == PACKED_INT4_DTYPE and fused.weight.shape == (24, 32)
    assert fused.local_in_features == 64 and fused.weight_zero_point.shape == (24, 2)
    torch.testing.assert_close(fused(x), x @ dense.t(), atol=1e-5, rtol=1e-5)

    row_parallel = RowParallelLinear(64, 16)
    row_parallel.load_checkpoint_tensor("weight", weights[0])
    assert row_parallel.weight.dtype == PACKED_INT4_DTYPE
    torch.testing.assert_close(row_parallel(x), x @ dense[:16].t(), atol=1e-5, rtol=1e-5)

    for order in ([0, 1], [1, 0]):
        mixed = MergedLinear(64, [16, 8])
        given = [weights[0], weights[1].unpacked()]
        for index in order:
            mixed.load_shard(mixed.weight, given[index], index)
        assert mixed.weight.dtype == torch.float32 and mixed.weight_zero_point is None
        torch.testing.assert_close(mixed.weight, dense, atol=0, rtol=0)


def test_moe_experts_hold_packed_codes_and_multiply_by_them():
    """Experts keep packed codes with their zero points (uint8 [E, rows, cols / 2]) and route
    tokens through them as through the dense experts; an expert given int8 codes after a packed
    one makes the stack dense with both experts' numbers."""
    from ksana_llm.layers.moe_routers import Routing

    hidden, inter = 64, 32
    parts = {(e, part): random_int4(*shape, group=32, seed=20 + 3 * e + i)
             for e in range(2)
             for i, (part, shape) in enumerate((("gate", (inter, hidden)), ("up", (inter, hidden)),
                                                ("down", (hidden, inter))))}
    experts, reference = FusedExperts(2, hidden, inter), FusedExperts(2, hidden, inter)
    for (e, part), (codes, zeros, scales) in parts.items():
        name = f"{e}.{part}_proj.weight"
        experts.load_checkpoint_tensor(name, int4_weight(codes, zeros, scales, 32))
        reference.load_checkpoint_tensor(name, dequantized(codes, zeros, scales, 32))
    assert experts.w13.dtype == PACKED_INT4_DTYPE and experts.w13.shape == (2, 2 * inter, 32)
    assert experts.w2.shape == (2, hidden, 16) and experts.w2_zero_point.shape == (2, hidden, 1)
    torch.manual_seed(1)
    x = torch.randn(6, hidden)
    routing = Routing(weights=torch.rand(6, 2),
                      experts=torch.tensor([[0, 1], [1, 0], [0, 1], [1, 1], [0, 0], [1, 0]]))
    torch.testing.assert_close(experts(x, routing), reference(x, routing), atol=1e-5, rtol=1e-5)

    codes, zeros, scales = parts[(1, "gate")]
    mixed = FusedExperts(2, hidden, inter)
    mixed.load_checkpoint_tensor("0.gate_proj.weight", int4_weight(*parts[(0, "gate")], 32))
    mixed.load_checkpoint_tensor("1.gate_proj.weight",
                                 int4_weight(codes, zeros, scales, 32).unpacked())
    assert mixed.w13.dtype == torch.float32 and mixed.w13_zero_point is None
    torch.testing.assert_close(mixed.w13[0, :inter], dequantized(*parts[(0, "gate")], 32),
                               atol=0, rtol=0)
    torch.testing.assert_close(mixed.w13[1, :inter], dequantized(codes, zeros, scales, 32),
                               atol=0, rtol=0)


def test_moe_experts_in_activation_order_gather_their_input():
    """GPTQ's activation order in MoE experts: each expert keeps its packed codes with its own
    input order (gate and up share one) and routes tokens as the dense experts in input order
    do; an expert whose gate and up disagree makes the stack dense, numbers unchanged."""
    from ksana_llm.layers.moe_routers import Routing

    hidden, inter = 64, 32
    generator = torch.Generator().manual_seed(30)
    orders = {(e, target): torch.randperm(size, generator=generator)
              for e in range(2) for target, size in (("w13", hidden), ("w2", inter))}
    experts, reference = FusedExperts(2, hidden, inter), FusedExperts(2, hidden, inter)
    for e in range(2):
        for i, (part, shape, target) in enumerate((("gate", (inter, hidden), "w13"),
                                                   ("up", (inter, hidden), "w13"),
                                                   ("down", (hidden, inter), "w2"))):
            weight = int4_weight(*random_int4(*shape, group=32, seed=40 + 3 * e + i), 32,
                                 orders[(e, target)])
            experts.load_checkpoint_tensor(f"{e}.{part}_proj.weight", weight)
            reference.load_checkpoint_tensor(f"{e}.{part}_proj.weight", weight.dequantize())
    assert experts.w13.dtype == PACKED_INT4_DTYPE and experts.w2.dtype == PACKED_INT4_DTYPE
    assert torch.equal(experts.w13_input_order[1], orders[(1, "w13")])
    assert torch.equal(experts.w2_input_order[0], orders[(0, "w2")])
    torch.manual_seed(2)
    x = torch.randn(5, hidden)
    routing = Routing(weights=torch.rand(5, 2),
                      experts=torch.tensor([[0, 1], [1, 0], [1, 1], [0, 0], [1, 0]]))
    expected = reference(x, routing)  # ~1e3 in magnitude: fp32 sums in another order differ
    torch.testing.assert_close(experts(x, routing), expected, rtol=1e-4,
                               atol=1e-5 * float(expected.abs().max()))

    gate = int4_weight(*random_int4(inter, hidden, 32, seed=50), 32, orders[(0, "w13")])
    up = int4_weight(*random_int4(inter, hidden, 32, seed=51), 32, orders[(1, "w13")])
    mixed = FusedExperts(2, hidden, inter)
    mixed.load_checkpoint_tensor("0.gate_proj.weight", gate)
    mixed.load_checkpoint_tensor("0.up_proj.weight", up)
    assert mixed.w13.dtype == torch.float32 and mixed.w13_input_order is None
    torch.testing.assert_close(mixed.w13[0], torch.cat([gate.dequantize(), up.dequantize()]),
                               atol=0, rtol=0)


def test_asymmetric_int8_codes_keep_their_zero_points():
    """8-bit codes up to 255 from their zero points (0..256: GPTQ v1 reads a stored 255 as 256)
    are held as codes - 128 (int8) with zero points - 128 (int16): slices and the projections
    that store them give scale * (code - zero); a symmetric part fused with them (no zero
    points) makes the projection dense, both parts' numbers kept."""
    generator = torch.Generator().manual_seed(7)
    codes = torch.randint(0, 256, (16, 64), generator=generator)
    zeros = torch.randint(0, 257, (16, 2), generator=generator)
    zeros[0, 0], codes[0, :2] = 256, torch.tensor([0, 255])
    scales = torch.rand(16, 2, generator=generator) + 0.1
    weight = int8_weight(codes, zeros, scales, 32)
    expected = dequantized(codes, zeros, scales, 32)
    assert weight.data.dtype == INT8 and weight.zero_point.dtype == torch.int16
    torch.testing.assert_close(weight.dequantize(), expected, atol=0, rtol=0)
    torch.testing.assert_close(weight.columns(32, 32).dequantize(), expected[:, 32:],
                               atol=0, rtol=0)
    torch.testing.assert_close(weight.rows(4, 8).dequantize(), expected[4:12], atol=0, rtol=0)
    symmetric = int8_weight(torch.randint(0, 256, (8, 64), generator=generator),
                            torch.full((8, 2), 128), scales[:8], 32)
    assert symmetric.zero_point is None  # the codes minus 128 are the numbers
    # an asymmetric weight whose differences happen to fit int8 keeps the asymmetric form, so
    # the experts of one stack (or parts of one projection) never mix forms and go dense
    fits = int8_weight(torch.randint(100, 156, (16, 64), generator=generator),
                       torch.randint(120, 136, (16, 2), generator=generator), scales, 32)
    assert fits.zero_point is not None
    experts = FusedExperts(2, 64, 16)
    experts.load_checkpoint_tensor("0.gate_proj.weight", weight)
    experts.load_checkpoint_tensor("1.gate_proj.weight", fits)
    assert experts.w13.dtype == INT8 and experts.w13_zero_point.dtype == torch.int16
    torch.testing.assert_close(
        (experts.w13[1, :16].float() - experts.w13_zero_point[1, :16].float().repeat_interleave(
            32, 1)) * scales.repeat_interleave(32, 1), fits.dequantize(), atol=0, rtol=0)

    x = torch.randn(3, 64)
    layer = MergedLinear(64, [16])
    layer.load_shard(layer.weight, weight, 0)
    assert layer.weight.dtype == INT8 and layer.weight_zero_point.dtype == torch.int16
    torch.testing.assert_close(layer(x), x @ expected.t(), atol=1e-4, rtol=1e-5)
    mixed = MergedLinear(64, [16, 8])
    mixed.load_shard(mixed.weight, weight, 0)
    mixed.load_shard(mixed.weight, symmetric, 1)
    assert mixed.weight.dtype == torch.float32 and mixed.weight_zero_point is None
    torch.testing.assert_close(mixed.weight, torch.cat([expected, symmetric.dequantize()]),
                               atol=0, rtol=0)


def test_lora_adapter_on_packed_awq_base_matches_peft(tmp_path):
    """A LoRA adapter over an AWQ base held packed: the adapter's A stacks take the
    projections' real input width (two codes a byte), and the tokens equal PEFT's adapter on
    transformers holding AutoAWQ's dequantization, mixed with base requests."""
    from tests.gptq_awq_checkpoints import hold, write_awq
    from tests.lora_adapters import check_adapter_matches_peft

    def holds_packed(model: kt.Model) -> None:
        o_proj = model.module.model.layers[0].self_attn.o_proj
        assert o_proj.weight.dtype == PACKED_INT4_DTYPE

    hf = build_tiny_model("llama2", tmp_path / "full")
    base = hold(hf, write_awq(hf, tmp_path / "full", tmp_path / "awq"))
    check_adapter_matches_peft(base, tmp_path / "awq", tmp_path / "adapter", holds_packed)
