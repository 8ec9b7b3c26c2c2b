"""FP8 weights as numbers, and online FP8 quantization (`quantization="fp8"`).

- Quantizing to E4M3 with block / per-tensor / per-row scales stays within E4M3's rounding; a
  checkpoint's block scales expand to rows exactly as an independent per-block dequantization;
  slicing rows / columns (tensor parallelism) is slicing the dequantized weight; a column split
  inside a block is a ValueError; the CPU widening is exact for every E4M3 value.
- The checkpoint stream: weights and scales pair in either order, activation scales are dropped,
  a half without its pair is a ValueError naming it; other quantization methods are refused.
- Online quantization: logits and tokens equal transformers' with every projection and expert
  fake-quantized per row by the formula written out in tests/quantized_checkpoints.py; a LoRA
  adapter over FP8 projections equals PEFT's on that base.
Checkpoints end to end: tests/test_quantized_checkpoints.py (two ranks:
tests/test_quantized_parallel.py); the Triton matmul:
tests/test_fp8_matmul.py.
"""

from __future__ import annotations

import math

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.loader.weight_quant import FP8_MAX, quantize_fp8
from ksana_llm.layers.linear import MergedLinear
from ksana_llm.loader.fp8_weights import (QuantizedCheckpoint, paired_weights,
                                          quantized_weight_from_checkpoint)
from ksana_llm.loader.quantized_weight import QuantizedWeight, quantize_fp8_rows
from ksana_llm.loader.quantized import checkpoint_quantization
from tests.family_harness import (check_prefill_and_decode, greedy_trace, hf_reference,
                                  memoized)
from tests.quantized_checkpoints import (assert_experts_quantized, assert_projections_quantized,
                                         block_dequantize, fake_quantize_rows, fake_quantized)
from tests.tiny_models import build_tiny_model

FP8 = torch.float8_e4m3fn


# ---- the numbers ---------------------------------------------------------------------------

@pytest.mark.parametrize("block", [(16, 16), (32, 8), None], ids=["16x16", "32x8", "tensor"])
def test_quantization_error_is_e4m3_rounding(block):
    torch.manual_seed(0)
    weight = torch.randn(70, 52) * torch.logspace(-2, 1, 52)  # columns of very different ranges
    weight[:16, :16] = 0  # an all-zero block stays zero
    data, scale = quantize_fp8(weight, block)
    assert data.dtype == FP8
    rows, cols = weight.shape
    grid = (1, 1) if block is None else (math.ceil(rows / block[0]), math.ceil(cols / block[1]))
    assert scale.shape == grid
    back = block_dequantize(data, scale, block or weight.shape)
    # E4M3 keeps 3 mantissa bits: relative error <= 2^-4 for normal values, absolute error <=
    # half the smallest subnormal step (2^-10 of the scale) near zero.
    step = scale.repeat_interleave((block or weight.shape)[0], 0)[:rows] \
        .repeat_interleave((block or weight.shape)[1], 1)[:, :cols]
    assert torch.all((back - weight).abs() <= weight.abs() / 16 + step * 2.0 ** -10 + 1e-12)
    assert torch.all(back[:16, :16] == 0) if block == (16, 16) else True
    # Each block's largest magnitude lands on E4M3's largest value.
    assert data.float().abs().max() == FP8_MAX


def test_cpu_widening_is_exact_for_every_e4m3_value():
    """The CPU dequantization moves E4M3 bytes into float16 fields (torch's own E4M3 widening is
    ~6x slower there): every finite E4M3 value, subnormals and both zeros included, comes out
    exactly as torch's cast."""
    from ksana_llm.loader.weight_quant import E4M3_AS_HALF_FACTOR, dequantize_weight, e4m3_as_half

    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    exact = every.float()
    finite = ~exact.isnan()
    assert finite.sum() == 254
    widened = e4m3_as_half(every).float() * E4M3_AS_HALF_FACTOR
    assert torch.equal(widened[finite], exact[finite])
    assert torch.equal(widened[finite].signbit(), exact[finite].signbit())  # -0.0 stays -0.0
    data = every[finite].reshape(2, 127)
    scale = torch.tensor([[0.5], [3.0]])
    assert torch.equal(dequantize_weight(data, scale, 127), data.float() * scale)


def test_checkpoint_block_scales_expand_to_rows():
    torch.manual_seed(1)
    weight = torch.randn(40, 56)  # 40 = 2.5 blocks of 16 rows, 56 = 3.5 blocks of 16 columns
    data, scale = quantize_fp8(weight, (16, 16))
    fp8 = quantized_weight_from_checkpoint(data, scale, (16, 16), "w")
    assert fp8.scale.shape == (40, 4) and fp8.group_size == 16
    expected = block_dequantize(data, scale, (16, 16))
    torch.testing.assert_close(fp8.dequantize(), expected, atol=0, rtol=0)
    # Tensor parallelism: any rows; columns from a block boundary in the checkpoint's blocks
    # (the last one may be short), from inside a block in smaller groups, each block's scale
    # repeated over its parts (dequantized below groups of 16): the same numbers every way.
    torch.testing.assert_close(fp8.rows(5, 20).dequantize(), expected[5:25], atol=0, rtol=0)
    torch.testing.assert_close(fp8.columns(32, 24).dequantize(), expected[:, 32:],
                               atol=0, rtol=0)
    parts = fp8.split_rows([24, 16])
    torch.testing.assert_close(parts[1].dequantize(), expected[24:], atol=0, rtol=0)
    for start, count in ((16, 20), (0, 28)):
        part = fp8.columns(start, count)
        assert part.group_size == 16 and part.data.dtype == fp8.data.dtype
        assert part.scale.shape == (40, -(-count // 16))
        torch.testing.assert_close(part.dequantize(), expected[:, start:start + count],
                                   atol=0, rtol=0)
    for start, count in ((8, 16), (12, 40)):  # groups of 8 or 4: plain numbers
        part = fp8.columns(start, count)
        assert isinstance(part, torch.Tensor) and part.dtype == torch.float32
        torch.testing.assert_close(part, expected[:, start:start + count], atol=0, rtol=0)
    data32, scale32 = quantize_fp8(weight, (8, 32))
    fp8_32 = quantized_weight_from_checkpoint(data32, scale32, (8, 32), "w")
    part = fp8_32.columns(16, 40)  # from the middle of a block of 32: groups of 16
    assert part.group_size == 16 and part.scale.shape == (40, 3)
    torch.testing.assert_close(part.dequantize(),
                               block_dequantize(data32, scale32, (8, 32))[:, 16:56],
                               atol=0, rtol=0)
    with pytest.raises(ValueError, match="do not divide"):
        fp8.regrouped(6)
    with pytest.raises(ValueError, match=r"expected \(3, 4\)"):
        quantized_weight_from_checkpoint(data, scale[:2], (16, 16), "w")
    # One scale per tensor (vLLM's `weight_scale`) or per row: any columns.
    per_tensor = quantized_weight_from_checkpoint(data, torch.tensor(0.5), None, "w")
    torch.testing.assert_close(per_tensor.columns(3, 7).dequantize(), data[:, 3:10].float() / 2)
    per_row = quantized_weight_from_checkpoint(data, torch.arange(40.0).reshape(40, 1), None, "w")
    torch.testing.assert_close(per_row.dequantize(), data.float() * torch.arange(40.0)[:, None])
    with pytest.raises(ValueError, match="need quantization_config.weight_block_size"):
        quantized_weight_from_checkpoint(data, scale, None, "w")


def test_checkpoint_pairs_weights_with_scales_in_any_order():
    data, scale = quantize_fp8(torch.randn(16, 16), (16, 16))
    fmt = QuantizedCheckpoint((16, 16))
    stream = [("a.weight", data), ("a.weight_scale_inv", scale),
              ("b.weight_scale_inv", scale), ("b.input_scale", torch.tensor(1.0)),
              ("b.weight", data), ("norm.weight", torch.ones(16))]
    paired = dict(paired_weights(stream, fmt))
    assert list(paired) == ["a.weight", "b.weight", "norm.weight"]
    assert isinstance(paired["a.weight"], QuantizedWeight)
    assert isinstance(paired["b.weight"], QuantizedWeight)
    assert isinstance(paired["norm.weight"], torch.Tensor)
    with pytest.raises(ValueError, match=r"quantized weights without a weight_scale_inv / "
                                         r"weight_scale: \['c'\]"):
        list(paired_weights([("c.weight", data)], fmt))
    with pytest.raises(ValueError, match=r"weight scales without a quantized weight: \['d'\]"):
        list(paired_weights([("d.weight_scale_inv", scale)], fmt))


def test_quantization_configs_other_than_fp8_are_refused_by_name(tmp_path):
    class Config:
        quantization_config = {"quant_method": "bitsandbytes", "load_in_4bit": True}
    with pytest.raises(ValueError, match="quant_method 'bitsandbytes' is not supported"):
        checkpoint_quantization(Config())
    Config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"weights": {
                                      "num_bits": 4, "type": "int", "strategy": "group"}}}}
    with pytest.raises(ValueError, match="int4 with strategy 'group' and actorder 'group'"):
        Config.quantization_config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
        checkpoint_quantization(Config())
    Config.quantization_config["config_groups"]["group_0"]["weights"].update(
        num_bits=2, actorder=None)
    with pytest.raises(ValueError, match="format 'pack-quantized' with 2-bit int weights"):
        checkpoint_quantization(Config())
    Config.quantization_config = {"quant_method": "compressed-tensors", "format": "int-quantized",
                                  "config_groups": {"group_0": {"weights": {
                                      "num_bits": 8, "type": "int", "strategy": "channel",
                                      "symmetric": False}}}}
    with pytest.raises(ValueError, match="int8 with strategy 'channel' and symmetric False"):
        checkpoint_quantization(Config())
    Config.quantization_config["config_groups"]["group_0"]["weights"].update(
        symmetric=True, strategy="group", group_size=None)
    with pytest.raises(ValueError, match="group_size must be a positive integer with strategy "
                                         "'group', got None"):
        checkpoint_quantization(Config())
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128]}
    with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
        checkpoint_quantization(Config())
    build_tiny_model("llama2", tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(
        config.replace('"architectures"', '"quantization_config": {"quant_method": "hqq"},\n'
                       '  "architectures"'))
    with pytest.raises(ValueError, match="quant_method 'hqq' is not supported"):
        Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)
    with pytest.raises(ValueError, match="quantization must be None or one of fp8"):
        Model.from_pretrained(tmp_path, device="cpu", quantization="int4")


def test_fused_projection_with_mixed_parts_stays_dense():
    """A checkpoint that left one part of a fused projection unquantized: both parts load, the
    FP8 one dequantized, in either order."""
    torch.manual_seed(2)
    dense_part, fp8_source = torch.randn(8, 16), torch.randn(24, 16)
    fp8_part = quantize_fp8_rows(fp8_source)
    for order in ([(1, fp8_part), (0, dense_part)], [(0, dense_part), (1, fp8_part)]):
        layer = MergedLinear(16, [8, 24])
        for index, tensor in order:
            layer.load_shard(layer.weight, tensor, index)
        assert layer.weight.dtype == torch.float32 and not layer.is_quantized
        torch.testing.assert_close(layer.weight[:8], dense_part, atol=0, rtol=0)
        torch.testing.assert_close(layer.weight[8:], fp8_part.dequantize(), atol=0, rtol=0)
    both = MergedLinear(16, [8, 24])
    both.load_shard(both.weight, quantize_fp8_rows(dense_part), 0)
    both.load_shard(both.weight, fp8_part, 1)
    assert both.weight.dtype == FP8 and both.weight_scale.shape == (32, 1)
    # FP8 values and int8 codes in one fused weight: both dequantized, not reinterpreted
    codes = QuantizedWeight(torch.randint(-128, 128, (8, 16), dtype=torch.int8),
                            torch.rand(8, 1), 16)
    for order in ([(0, codes), (1, fp8_part)], [(1, fp8_part), (0, codes)]):
        mixed = MergedLinear(16, [8, 24])
        for index, tensor in order:
            mixed.load_shard(mixed.weight, tensor, index)
        assert mixed.weight.dtype == torch.float32 and not mixed.is_quantized
        torch.testing.assert_close(mixed.weight[:8], codes.dequantize(), atol=0, rtol=0)
        torch.testing.assert_close(mixed.weight[8:], fp8_part.dequantize(), atol=0, rtol=0)



def test_activation_order_weights_gather_their_input():
    """A weight stored in activation order (columns sorted by group, `input_order` the input
    each takes) multiplies x as the weight in input order does; fused parts with the same order
    stay int8 with it, parts with different orders load dense; a slice of its inputs (a
    row-parallel rank's) comes dense."""
    torch.manual_seed(5)
    codes = torch.randint(-8, 8, (2, 6, 16), dtype=torch.int8)
    scales = torch.rand(2, 6, 2)
    order, other = torch.randperm(16), torch.randperm(16)
    parts = [QuantizedWeight(codes[i], scales[i], 8, order) for i in range(2)]
    dense = torch.cat([p.dequantize() for p in parts])
    grouped = QuantizedWeight(codes[0], scales[0], 8).dequantize()
    torch.testing.assert_close(dense[:6][:, order], grouped, atol=0, rtol=0)
    x = torch.randn(3, 16)
    layer = MergedLinear(16, [6, 6])
    for index, part in enumerate(parts):
        layer.load_shard(layer.weight, part, index)
    assert layer.weight.dtype == torch.int8 and torch.equal(layer.input_order, order)
    torch.testing.assert_close(layer(x), x @ dense.t())
    mixed = MergedLinear(16, [6, 6])
    mixed.load_shard(mixed.weight, parts[0], 0)
    mixed.load_shard(mixed.weight, QuantizedWeight(codes[1], scales[1], 8, other), 1)
    assert mixed.weight.dtype == torch.float32 and mixed.input_order is None
    torch.testing.assert_close(mixed.weight[:6], dense[:6], atol=0, rtol=0)
    torch.testing.assert_close(mixed.weight[6:],
                               QuantizedWeight(codes[1], scales[1], 8, other).dequantize(),
                               atol=0, rtol=0)
    assert parts[0].columns(0, 16) is parts[0]
    torch.testing.assert_close(parts[0].columns(8, 8), dense[:6, 8:], atol=0, rtol=0)


def test_experts_with_fp8_and_int8_weights_stay_dense():
    """MoE experts whose checkpoint mixes FP8 values and int8 codes (or quantized and dense
    experts): every expert of that stack dequantized, in either order, numbers unchanged."""
    from ksana_llm.layers.moe import FusedExperts

    torch.manual_seed(3)
    codes = QuantizedWeight(torch.randint(-128, 128, (16, 8), dtype=torch.int8),
                            torch.rand(16, 1), 8)
    fp8 = quantize_fp8_rows(torch.randn(16, 8))
    for first, second in ((codes, fp8), (fp8, codes)):
        experts = FusedExperts(2, 8, 16)
        experts.load_checkpoint_tensor("0.gate_proj.weight", first)
        assert experts.w13.dtype == first.data.dtype  # quantized until they disagree
        experts.load_checkpoint_tensor("1.gate_proj.weight", second)
        assert experts.w13.dtype == torch.float32 and experts.w13_scale is None
        torch.testing.assert_close(experts.w13[0, :16], first.dequantize(), atol=0, rtol=0)
        torch.testing.assert_close(experts.w13[1, :16], second.dequantize(), atol=0, rtol=0)


# ---- online quantization -----------------------------------------------------------------


def test_online_fp8_quantizes_moe_experts_too(tmp_path):
    from tests.test_family_moe import FAMILIES, _randomize

    torch.manual_seed(0)
    hf = FAMILIES["qwen3_moe"]().eval()
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    with torch.no_grad():  # transformers 5 keeps the experts stacked: [E, rows, cols]
        for name, param in hf.named_parameters():
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):
                param.copy_(torch.stack([fake_quantize_rows(w) for w in param]))
    fake_quantized(hf)
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                  quantization="fp8")
    assert assert_experts_quantized(model.module) == 2
    check_prefill_and_decode(model.module, memoized(hf_reference(hf)), vocab=256,
                             chunks=[16, 16, 8])


def test_online_fp8_matches_per_row_fake_quantized_transformers(tmp_path):
    hf = fake_quantized(build_tiny_model("llama2", tmp_path))
    reference = memoized(hf_reference(hf))
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                  quantization="fp8")
    assert_projections_quantized(model.module)
    assert model.module.model.embed_tokens.weight.dtype == torch.float32
    assert model.module.lm_head.weight.dtype == torch.float32
    for chunks in ([40], [16, 16, 8]):
        check_prefill_and_decode(model.module, reference, vocab=256, chunks=chunks)
    torch.manual_seed(3)
    prompt = torch.randint(3, 256, (20,)).tolist()
    expected = greedy_trace(reference, prompt, 24)[0][len(prompt):]
    config = GenerationConfig(max_new_tokens=24, ignore_eos=True)
    with kt.Engine(str(tmp_path), generation_config=config, device="cpu", dtype="float32",
                   quantization="fp8", block_token_num=4, num_device_blocks=64) as engine:
        assert engine.model.module.model.layers[1].self_attn.o_proj.weight.dtype == FP8
        assert engine.generate_outputs([prompt])[0].token_ids == expected
    # The loaded model given with the setting it was loaded with: accepted; another: refused.
    with kt.Engine(model, generation_config=config, quantization="fp8", block_token_num=4,
                   num_device_blocks=64) as engine:
        assert engine.generate_outputs([prompt])[0].token_ids == expected
    with pytest.raises(ValueError, match=r"quantization='w8a8_int8' applies while a model "
                                         r"loads; this model is loaded already \(quantization fp8\)"):
        kt.Engine(model, quantization="w8a8_int8")


def test_lora_adapter_on_fp8_base_matches_peft(tmp_path):
    """A LoRA adapter over FP8 projections: the base's FP8 matmul plus the adapter's full-precision
    delta equal PEFT's adapter on transformers' fake-quantized base, mixed with base requests."""
    from tests.lora_adapters import check_adapter_matches_peft

    # The checkpoint stays full precision; the reference base is its fake-quantized copy.
    hf = fake_quantized(build_tiny_model("llama2", tmp_path / "base"))
    check_adapter_matches_peft(hf, tmp_path / "base", tmp_path / "adapter", quantization="fp8")
