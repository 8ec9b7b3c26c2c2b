"""FP8 weights: checkpoints in the hub's FP8 format, llm-compressor's FP8 and int4 checkpoints
(held as FP8), and online FP8 quantization.

- The numbers: quantizing to E4M3 with block / per-tensor / per-row scales stays within E4M3's
  rounding; a checkpoint's block scales expand to rows exactly as an independent per-block
  dequantization in this file; slicing rows / columns (tensor parallelism) is slicing the
  dequantized weight; a column split inside a block is a ValueError.
- The checkpoint stream: weights and scales pair in either order, activation scales are dropped,
  a half without its pair is a ValueError naming it.
- End to end against transformers, which reads the same FP8 checkpoint on its own (its CPU path
  dequantizes it): tiny Llama with block and per-tensor scales, DeepSeek-V3 (MLA + MoE, and its
  MTP layer drafting), Qwen3-MoE and Mixtral -- logits at prefill / decode / a prefix hit and 32
  greedy Engine tokens; projections and experts stay FP8 in memory. Tensor parallelism over gloo
  gives the same tokens.
- Online quantization (`quantization="fp8"`): logits equal transformers' with every projection
  and expert fake-quantized per row by the formula written out here.
- The Triton W8A16 matmul against its torch reference (interpreter on CPU; natively, with bf16,
  on a GPU).
"""

from __future__ import annotations

import math
import os
from pathlib import Path

import pytest
import torch

ON_GPU = torch.cuda.is_available()
if not ON_GPU:
    os.environ.setdefault("TRITON_INTERPRET", "1")

import ksana_llm as kt  # noqa: E402
from ksana_llm.api.model import Model  # noqa: E402
from ksana_llm.generation_config import GenerationConfig  # noqa: E402
from ksana_llm.kernels.reference import fp8_linear_ref  # noqa: E402
from ksana_llm.kernels.weight_quant import FP8_MAX, quantize_fp8  # noqa: E402
from ksana_llm.layers.linear import MergedLinear  # noqa: E402
from ksana_llm.loader.fp8_weights import (QuantizedCheckpoint, Fp8Weight,  # noqa: E402
                                          fp8_weight_from_checkpoint, paired_weights,
                                          quantize_fp8_rows)
from tests.family_harness import (check_family, check_prefill_and_decode,  # noqa: E402
                                  greedy_trace, hf_reference, load_ours, memoized)
from tests.quantized_checkpoints import (QUANTIZED, write_compressed_tensors,  # noqa: E402
                                  write_fp8_checkpoint)
from tests.tiny_models import build_tiny_model  # noqa: E402

DEVICE = "cuda" if ON_GPU else "cpu"
FP8 = torch.float8_e4m3fn


def block_dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
                     ) -> torch.Tensor:
    """Each [block] tile of the FP8 values times its own scale, tile by tile (the format's
    definition, written independently of the code under test)."""
    out = data.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
    return out


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
    from ksana_llm.kernels.weight_quant import E4M3_AS_HALF_FACTOR, dequantize_fp8, e4m3_as_half

    every = torch.arange(256, dtype=torch.uint8).view(FP8)
    exact = every.float()
    finite = ~exact.isnan()
    assert finite.sum() == 254
    widened = e4m3_as_half(every).float() * E4M3_AS_HALF_FACTOR
    assert torch.equal(widened[finite], exact[finite])
    assert torch.equal(widened[finite].signbit(), exact[finite].signbit())  # -0.0 stays -0.0
    data = every[finite].reshape(2, 127)
    scale = torch.tensor([[0.5], [3.0]])
    assert torch.equal(dequantize_fp8(data, scale, 127), data.float() * scale)


def test_checkpoint_block_scales_expand_to_rows():
    torch.manual_seed(1)
    weight = torch.randn(40, 56)  # 40 = 2.5 blocks of 16 rows, 56 = 3.5 blocks of 16 columns
    data, scale = quantize_fp8(weight, (16, 16))
    fp8 = fp8_weight_from_checkpoint(data, scale, (16, 16), "w")
    assert fp8.scale.shape == (40, 4) and fp8.group_size == 16
    expected = block_dequantize(data, scale, (16, 16))
    torch.testing.assert_close(fp8.dequantize(), expected, atol=0, rtol=0)
    # Tensor parallelism: any rows; columns at block boundaries (the last block may be short).
    torch.testing.assert_close(fp8.rows(5, 20).dequantize(), expected[5:25], atol=0, rtol=0)
    torch.testing.assert_close(fp8.columns(32, 24).dequantize(), expected[:, 32:],
                               atol=0, rtol=0)
    parts = fp8.split_rows([24, 16])
    torch.testing.assert_close(parts[1].dequantize(), expected[24:], atol=0, rtol=0)
    with pytest.raises(ValueError, match="split its scale blocks of 16 columns"):
        fp8.columns(8, 16)
    with pytest.raises(ValueError, match=r"expected \(3, 4\)"):
        fp8_weight_from_checkpoint(data, scale[:2], (16, 16), "w")
    # One scale per tensor (vLLM's `weight_scale`) or per row: any columns.
    per_tensor = fp8_weight_from_checkpoint(data, torch.tensor(0.5), None, "w")
    torch.testing.assert_close(per_tensor.columns(3, 7).dequantize(), data[:, 3:10].float() / 2)
    per_row = fp8_weight_from_checkpoint(data, torch.arange(40.0).reshape(40, 1), None, "w")
    torch.testing.assert_close(per_row.dequantize(), data.float() * torch.arange(40.0)[:, None])
    with pytest.raises(ValueError, match="need quantization_config.weight_block_size"):
        fp8_weight_from_checkpoint(data, scale, None, "w")


def test_checkpoint_pairs_weights_with_scales_in_any_order():
    data, scale = quantize_fp8(torch.randn(16, 16), (16, 16))
    fmt = QuantizedCheckpoint((16, 16))
    stream = [("a.weight", data), ("a.weight_scale_inv", scale),
              ("b.weight_scale_inv", scale), ("b.input_scale", torch.tensor(1.0)),
              ("b.weight", data), ("norm.weight", torch.ones(16))]
    paired = dict(paired_weights(stream, fmt))
    assert list(paired) == ["a.weight", "b.weight", "norm.weight"]
    assert isinstance(paired["a.weight"], Fp8Weight) and isinstance(paired["b.weight"], Fp8Weight)
    assert isinstance(paired["norm.weight"], torch.Tensor)
    with pytest.raises(ValueError, match=r"FP8 weights without a weight_scale_inv: \['c'\]"):
        list(paired_weights([("c.weight", data)], fmt))
    with pytest.raises(ValueError, match=r"weight scales without an FP8 weight: \['d'\]"):
        list(paired_weights([("d.weight_scale_inv", scale)], fmt))


def test_quantization_configs_other_than_fp8_are_refused_by_name(tmp_path):
    class Config:
        quantization_config = {"quant_method": "gptq", "bits": 4}
    with pytest.raises(ValueError, match="quant_method 'gptq' is not supported"):
        QuantizedCheckpoint.from_hf_config(Config())
    Config.quantization_config = {"quant_method": "compressed-tensors", "format": "pack-quantized",
                                  "config_groups": {"group_0": {"weights": {
                                      "num_bits": 4, "type": "int", "strategy": "group"}}}}
    with pytest.raises(ValueError, match="int4 with strategy 'group' and actorder 'group'"):
        Config.quantization_config["config_groups"]["group_0"]["weights"]["actorder"] = "group"
        QuantizedCheckpoint.from_hf_config(Config())
    Config.quantization_config["config_groups"]["group_0"]["weights"].update(
        num_bits=8, actorder=None)
    with pytest.raises(ValueError, match="format 'pack-quantized' with 8-bit int weights"):
        QuantizedCheckpoint.from_hf_config(Config())
    Config.quantization_config = {"quant_method": "fp8", "weight_block_size": [128]}
    with pytest.raises(ValueError, match="weight_block_size must be two positive integers"):
        QuantizedCheckpoint.from_hf_config(Config())
    build_tiny_model("llama2", tmp_path)
    config = (tmp_path / "config.json").read_text()
    (tmp_path / "config.json").write_text(
        config.replace('"architectures"', '"quantization_config": {"quant_method": "awq"},\n'
                       '  "architectures"'))
    with pytest.raises(ValueError, match="quant_method 'awq' is not supported"):
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
        assert layer.weight.dtype == torch.float32 and not layer.is_fp8
        torch.testing.assert_close(layer.weight[:8], dense_part, atol=0, rtol=0)
        torch.testing.assert_close(layer.weight[8:], fp8_part.dequantize(), atol=0, rtol=0)
    both = MergedLinear(16, [8, 24])
    both.load_shard(both.weight, quantize_fp8_rows(dense_part), 0)
    both.load_shard(both.weight, fp8_part, 1)
    assert both.weight.dtype == FP8 and both.weight_scale.shape == (32, 1)


# ---- FP8 checkpoints against transformers ------------------------------------------------

def hf_fp8_model(folder: Path, block: tuple[int, int] | None) -> torch.nn.Module:
    """transformers' own reading of the FP8 checkpoint (on CPU it dequantizes the weights),
    checked to hold the dequantized values rather than, say, the raw FP8 numbers."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    tensors = load_file(str(folder / "model.safetensors"))
    name = "model.layers.0.self_attn.o_proj.weight"
    data, scale = tensors[name], tensors[name.replace("weight", "weight_scale_inv")]
    expected = block_dequantize(data, scale.reshape(1, 1) if block is None else scale,
                                block or tuple(data.shape))
    torch.testing.assert_close(model.get_parameter(name), expected, atol=0, rtol=0)
    return model


def assert_projections_fp8(module: torch.nn.Module) -> None:
    projections = [name for name, p in module.named_parameters()
                   if QUANTIZED.match(name.replace("qkv_proj", "q_proj")
                                      .replace("gate_up_proj", "gate_proj")
                                      .replace("qkv_a_proj", "q_a_proj"))]
    assert projections
    for name in projections:
        if "kv_b_proj" in name:  # MLA multiplies by views of it: kept dense
            assert module.get_parameter(name).dtype == torch.float32, name
        else:
            assert module.get_parameter(name).dtype == FP8, name


@pytest.mark.parametrize("block", [(16, 16), None], ids=["block16", "per-tensor"])
def test_fp8_llama_checkpoint_matches_transformers(tmp_path, block):
    build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", block)
    hf = hf_fp8_model(folder, block)
    module = load_ours(folder)
    assert_projections_fp8(module)
    check_family(module, folder, hf_reference(hf), vocab=256)


def assert_experts_fp8(module: torch.nn.Module) -> int:
    """Every MoE expert stack holds FP8 values with one scale per row and group; how many."""
    from ksana_llm.layers.moe import FusedExperts

    stacks = [m for m in module.modules() if isinstance(m, FusedExperts)]
    for experts in stacks:
        assert experts.w13.dtype == FP8 and experts.w2.dtype == FP8
        assert experts.w13_scale.shape[:2] == experts.w13.shape[:2]
        assert experts.w2_scale.shape[:2] == experts.w2.shape[:2]
    return len(stacks)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block"])
def test_compressed_tensors_fp8_checkpoint_matches_transformers(tmp_path, strategy):
    """llm-compressor's FP8 checkpoints (`quant_method: compressed-tensors`, float-quantized),
    written by the compressed-tensors library: per-tensor, per-channel and 16x16 block
    scales."""
    build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    folder = tmp_path / "ct"
    write_compressed_tensors(tmp_path / "full", folder, strategy)
    from transformers import AutoModelForCausalLM

    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module = load_ours(folder)
    assert_projections_fp8(module)
    scale = module.model.layers[0].self_attn.o_proj.weight_scale
    assert scale.shape == {"tensor": (64, 1), "channel": (64, 1), "block": (64, 8)}[strategy]
    check_family(module, folder, hf_reference(reference), vocab=256)


@pytest.mark.parametrize("strategy", ["int4", "int4-asym", "int4-channel"])
def test_compressed_tensors_int4_checkpoint_matches_transformers(tmp_path, strategy):
    """llm-compressor's W4A16 checkpoints (`pack-quantized`: eight 4-bit codes per int32,
    group or channel scales, zero points when asymmetric), written by the compressed-tensors
    library, held as FP8 with the same numbers: logits and greedy tokens equal transformers'
    reading the checkpoint through the library -- or, for zero points, which transformers'
    loader cannot read, transformers' model holding the numbers the library says the
    checkpoint holds."""
    from transformers import AutoModelForCausalLM

    full = build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    folder = tmp_path / "ct"
    held = write_compressed_tensors(tmp_path / "full", folder, strategy)
    if strategy == "int4-asym":
        with torch.no_grad():
            for name, values in held.items():
                full.get_parameter(name).copy_(values)
        reference = full
    else:
        reference = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    module = load_ours(folder)
    assert_projections_fp8(module)
    scale = module.model.layers[0].self_attn.o_proj.weight_scale
    assert scale.shape == ((64, 1) if strategy == "int4-channel" else (64, 4))  # 128 / 32
    check_family(module, folder, hf_reference(reference), vocab=256)


def test_int4_codes_unpack_as_the_library_packs_them():
    """Every 4-bit value at every position of a word, and zero points packed along the rows,
    come back as compressed-tensors' own pack_to_int32 put them in."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from ksana_llm.loader.fp8_weights import int4_as_fp8, unpack_int4

    torch.manual_seed(6)
    values = torch.randint(-8, 8, (5, 37), dtype=torch.int8)  # 37: the last word half full
    packed = pack_to_int32(values, 4)
    assert torch.equal(unpack_int4(packed, 37), values)
    zero = torch.randint(-8, 8, (5, 2), dtype=torch.int8)
    scale = torch.rand(5, 2)
    weight = int4_as_fp8({"weight_packed": packed, "weight_scale": scale,
                          "weight_shape": torch.tensor([5, 37]),
                          "weight_zero_point": pack_to_int32(zero, 4, packed_dim=0)}, "w")
    expected = (values.float() - zero.float().repeat_interleave(19, 1)[:, :37]) \
        * scale.repeat_interleave(19, 1)[:, :37]
    assert weight.group_size == 19
    torch.testing.assert_close(weight.dequantize(), expected, atol=0, rtol=0)


def test_fp8_deepseek_checkpoint_matches_transformers(tmp_path):
    """DeepSeek V3 / R1 ship as FP8: MLA's projections, the shared and the routed experts stay
    FP8; MLA's absorbed kv_b_proj loads dequantized."""
    from tests.deepseek_checkpoint import VOCAB

    deepseek_full(tmp_path / "full")
    # 8x8 blocks: transformers' CPU dequantization needs blocks that divide every dimension.
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (8, 8))
    module = load_ours(folder)
    assert_projections_fp8(module)
    assert assert_experts_fp8(module) == 2
    check_family(module, folder, hf_reference(hf_fp8_model(folder, (8, 8))), vocab=VOCAB)


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_fp8_moe_checkpoint_matches_transformers(tmp_path, family):
    """Qwen3-MoE (`experts.N.{gate,up,down}_proj`) and Mixtral (`experts.N.w1/w3/w2`) FP8
    checkpoints: the experts stay FP8 and the model gives transformers' logits and tokens."""
    from tests.test_family_moe import FAMILIES, _randomize

    torch.manual_seed(0)
    full = FAMILIES[family]().eval()
    _randomize(full)
    full.save_pretrained(tmp_path / "full")
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (16, 16))
    module = load_ours(folder)
    assert assert_experts_fp8(module) == 2
    check_family(module, folder, hf_reference(hf_fp8_model(folder, (16, 16))), vocab=256)


def deepseek_full(folder: Path) -> torch.nn.Module:
    from transformers import DeepseekV3ForCausalLM

    from tests.deepseek_checkpoint import deepseek_config, randomize

    torch.manual_seed(0)
    full = DeepseekV3ForCausalLM(deepseek_config(num_nextn_predict_layers=0)).eval()
    randomize(full)
    full.save_pretrained(folder)
    return full


@pytest.mark.parametrize("source", ["checkpoint", "online", "deepseek-checkpoint"])
def test_fp8_under_tensor_parallelism(tmp_path, source):
    """Two gloo ranks, each holding its rows / block-aligned columns of the FP8 weights (MLA
    heads and expert columns split for DeepSeek): the same greedy tokens and logits as
    transformers reading the FP8 checkpoint, or (online quantization, row scales taken over
    whole rows) as transformers with fake-quantized rows."""
    if source == "deepseek-checkpoint":
        deepseek_full(tmp_path / "full")
        folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (8, 8))
        reference = hf_reference(hf_fp8_model(folder, (8, 8)))
    else:
        hf = build_tiny_model("llama2", tmp_path / "full")
        if source == "checkpoint":
            folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (16, 16))
            reference = hf_reference(hf_fp8_model(folder, (16, 16)))
        else:
            folder = tmp_path / "full"
            reference = hf_reference(fake_quantized(hf))
    torch.manual_seed(1)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (9, 30, 17)]
    expected = [greedy_trace(reference, p, 12)[0][len(p):] for p in prompts]
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=2,
                                  quantization="fp8" if source == "online" else None)
    down = model.module.model.layers[0].mlp.down_proj.weight
    assert down.dtype == FP8
    assert down.shape == ((64, 48) if source.startswith("deepseek") else (64, 64))  # 1/2 each
    if source.startswith("deepseek"):
        assert model.module.model.layers[1].mlp.experts.w2.shape == (8, 64, 16)
        assert assert_experts_fp8(model.module) == 2
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4,
                   num_device_blocks=96) as engine:
        outputs = engine.generate_outputs(prompts)
        logits = engine.forward(prompts[1], [{"target_name": "logits"}]).targets[0].tensor
    assert [o.token_ids for o in outputs] == expected
    torch.testing.assert_close(logits, reference(prompts[1]), atol=2e-4, rtol=1e-4)


def test_tensor_parallel_split_inside_a_block_is_refused(tmp_path):
    build_tiny_model("llama2", tmp_path / "full")  # o_proj / down_proj inputs 64 / 128
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (48, 48))
    with pytest.raises(ValueError, match="split its scale blocks of 48 columns"):
        Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                              tensor_parallel_size=2)


# ---- online quantization -----------------------------------------------------------------

def fake_quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """Per-row E4M3 with the row's largest magnitude at 448, back to float32."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (weight / scale).clamp(-448.0, 448.0).to(FP8).float() * scale


def fake_quantized(hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` with every decoder projection's weight replaced by its per-row FP8 values."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if QUANTIZED.match(name):
                param.copy_(fake_quantize_rows(param))
    return hf


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
    assert assert_experts_fp8(model.module) == 2
    check_prefill_and_decode(model.module, memoized(hf_reference(hf)), vocab=256,
                             chunks=[16, 16, 8])


def test_online_fp8_matches_per_row_fake_quantized_transformers(tmp_path):
    hf = fake_quantized(build_tiny_model("llama2", tmp_path))
    reference = memoized(hf_reference(hf))
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                  quantization="fp8")
    assert_projections_fp8(model.module)
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


# ---- the Triton matmul -------------------------------------------------------------------

KERNEL_DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
TOL = {torch.float32: (1e-4, 1e-4), torch.float16: (2e-2, 2e-2), torch.bfloat16: (6e-2, 4e-2)}


@pytest.mark.parametrize("dtype", KERNEL_DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("rows, n, k, layout", [
    (1, 64, 128, (16, 16)),    # one decode row, group scales
    (5, 70, 96, (32, 32)),     # N not a tile multiple
    (17, 48, 80, (16, 32)),    # K ends inside a group
    (33, 40, 64, "row"),       # per-row scales (online quantization)
    (3, 32, 48, None),         # one scale per tensor
])
def test_fp8_matmul_kernel_matches_reference(dtype, rows, n, k, layout):
    from ksana_llm.kernels import fp8_linear

    torch.manual_seed(4)
    weight = torch.randn(n, k)
    if layout == "row":
        fp8 = quantize_fp8_rows(weight)
    else:
        data, scale = quantize_fp8(weight, layout)
        fp8 = fp8_weight_from_checkpoint(data, scale, layout, "w")
    fp8 = fp8.to(DEVICE)
    x = torch.randn(rows, k, device=DEVICE).to(dtype)
    bias = torch.randn(n, device=DEVICE).to(dtype)
    for b in (None, bias):
        out = fp8_linear(x, fp8.data, fp8.scale, fp8.group_size, b)
        expected = fp8_linear_ref(x.float(), fp8.data, fp8.scale, fp8.group_size,
                                  None if b is None else b.float())
        assert out.dtype == dtype and out.shape == (rows, n)
        atol, rtol = TOL[dtype]
        torch.testing.assert_close(out.float(), expected, atol=atol * k ** 0.5, rtol=rtol)
    batched = fp8_linear(x.view(1, rows, k), fp8.data, fp8.scale, fp8.group_size)
    assert batched.shape == (1, rows, n)


def test_fp8_matmul_kernel_refuses_bad_inputs():
    from ksana_llm.kernels import fp8_linear

    fp8 = quantize_fp8_rows(torch.randn(16, 32)).to(DEVICE)
    x = torch.randn(2, 32, device=DEVICE)
    with pytest.raises(ValueError, match="weight: expected a 2-D"):
        fp8_linear(x, fp8.data.float(), fp8.scale, fp8.group_size)
    with pytest.raises(ValueError, match="does not match the weight's 32 columns"):
        fp8_linear(x[:, :16], fp8.data, fp8.scale, fp8.group_size)
    with pytest.raises(ValueError, match="group_size 24"):
        fp8_linear(x, fp8.data, torch.ones(16, 2, device=DEVICE), 24)


def test_fp8_deepseek_mtp_layer_drafts_keep_greedy_tokens(tmp_path):
    """DeepSeek's released MTP layer is FP8 too: it loads (projections FP8, `eh_proj`
    dequantized), drafts that get accepted, and speculative decoding leaves the greedy tokens
    unchanged."""
    from tests.test_speculative_decoding import NUM_TOKENS, Setup

    setup = Setup(tmp_path)
    folder = write_fp8_checkpoint(setup.folder, tmp_path / "fp8", (8, 8))
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    mtp_params = {name: p.dtype for name, p in model.module.named_parameters()
                  if name.startswith("mtp.")}
    assert FP8 in mtp_params.values() and torch.float32 in mtp_params.values()
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    outputs = {}
    for drafts in (0, 2):
        with kt.Engine(model, generation_config=config, block_token_num=4,
                       num_device_blocks=128, num_speculative_tokens=drafts) as engine:
            outputs[drafts] = [o.token_ids for o in engine.generate_outputs(setup.prompts)]
            stats = engine.stats()
    assert outputs[2] == outputs[0]
    assert 0 < stats.num_accepted_draft_tokens


def test_lora_adapter_on_fp8_base_matches_peft(tmp_path):
    """A LoRA adapter over FP8 projections: the base's FP8 matmul plus the adapter's full-precision
    delta equal PEFT's adapter on transformers' fake-quantized base, mixed with base requests."""
    from tests.lora_adapters import ALL_TARGETS, make_adapter

    # The checkpoint stays full precision; the reference base is its fake-quantized copy.
    hf = fake_quantized(build_tiny_model("llama2", tmp_path / "base"))
    peft = make_adapter(hf, tmp_path / "adapter", seed=1, targets=ALL_TARGETS, rank=4)
    torch.manual_seed(5)
    prompt = torch.randint(3, 256, (14,)).tolist()
    expected = {lora: greedy_trace(hf_reference(model), prompt, 12)[0][len(prompt):]
                for lora, model in ((None, hf), ("sql", peft))}
    assert expected["sql"] != expected[None]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with kt.Engine(str(tmp_path / "base"), generation_config=config, device="cpu",
                   dtype="float32", quantization="fp8", block_token_num=4, num_device_blocks=64,
                   lora_modules={"sql": str(tmp_path / "adapter")}) as engine:
        handles = {lora: engine.submit(kt.Request(prompt, lora=lora)) for lora in expected}
        got = {lora: handle.result().token_ids for lora, handle in handles.items()}
    assert got == expected
