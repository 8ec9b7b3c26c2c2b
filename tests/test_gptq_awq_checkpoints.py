"""GPTQ and AWQ checkpoints, written by AutoGPTQ and AutoAWQ, against transformers holding the
weights those libraries dequantize from the same files: logits at prefill (whole and chunked),
16 decode steps and a prefix hit in a mixed batch, 32 greedy Engine tokens, and over two gloo
ranks. Weights are int8 codes in memory (4-bit, and symmetric 8-bit; in activation order with
their input order); asymmetric 8-bit ones dense.
"""

from __future__ import annotations

import json

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.loader import load_hf_config
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.loader.gptq_awq import PackedIntFormat, packed_int_weight, paired_packed_ints
from ksana_llm.loader.quantized import checkpoint_quantization
from ksana_llm.loader.weight_quant import PACKED_INT4_DTYPE
from tests.family_harness import (check_family, check_triton_backend, greedy_trace, hf_reference,
                                  load_ours)
from tests.gptq_awq_checkpoints import (gptq_dequantized, hold, library_modules, write_awq,
                                        write_gptq, write_gptq_from_files, write_held)
from tests.quantized_checkpoints import assert_projections_quantized, check_engine_matches
from tests.tiny_models import build_tiny_model

INT8 = torch.int8
INT4 = PACKED_INT4_DTYPE  # two 4-bit codes a byte

GPTQ_CASES = {  # name: write_gptq settings
    "int4-g32-sym": dict(bits=4, group_size=32, sym=True),
    "int4-g32-asym": dict(bits=4, group_size=32, sym=False),
    "int4-channel": dict(bits=4, group_size=-1, sym=True),
    "int4-act-order": dict(bits=4, group_size=32, sym=False, desc_act=True),
    "int8-g32": dict(bits=8, group_size=32, sym=True),
    "int8-g32-asym": dict(bits=8, group_size=32, sym=False),
    "int8-act-order": dict(bits=8, group_size=32, sym=True, desc_act=True),
}


@pytest.mark.parametrize("case", sorted(GPTQ_CASES))
def test_gptq_checkpoint_matches_the_library(tmp_path, case):
    """AutoGPTQ's checkpoints (its GPTQ algorithm, its packing, v1 zero points) held with the
    same numbers: 4-bit codes packed two a byte with their zero points (group and per-channel
    scales, symmetric and asymmetric, in activation order: columns sorted by group, the
    projection gathering its input in that order), 8-bit as int8 codes: symmetric ones minus
    their zero point, asymmetric ones (up to 255 from their zero point) minus 128 with their
    zero points beside them."""
    settings = GPTQ_CASES[case]
    hf = build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    held = write_gptq(hf, tmp_path / "full", tmp_path / "gptq", **settings)
    module = load_ours(tmp_path / "gptq")
    o_proj = module.model.layers[0].self_attn.o_proj
    assert_projections_quantized(module, INT4 if settings["bits"] == 4 else INT8)
    assert (o_proj.weight_zero_point is not None) == (settings["bits"] == 4
                                                      or not settings["sym"])
    # activation order: every projection gathers its input (q/k/v and gate/up, fused,
    # share theirs: GPTQ ordered them by the same input statistics)
    ordered = [m.input_order is not None for m in module.modules()
               if getattr(m, "weight_scale", None) is not None]
    assert ordered and all(ordered) == bool(settings.get("desc_act")) \
        and any(ordered) == bool(settings.get("desc_act"))
    assert o_proj.weight_scale.shape == ((64, 1) if settings["group_size"] == -1
                                         else (64, 4))  # 128 inputs / 32
    check_family(module, tmp_path / "gptq", hf_reference(hold(hf, held)), vocab=256)


def test_awq_checkpoint_matches_the_library(tmp_path):
    """AutoAWQ's GEMM packing (interleaved order, zero points): packed 4-bit codes with the
    same numbers."""
    hf = build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    held = write_awq(hf, tmp_path / "full", tmp_path / "awq")
    module = load_ours(tmp_path / "awq")
    assert_projections_quantized(module, INT4)
    check_family(module, tmp_path / "awq", hf_reference(hold(hf, held)), vocab=256)


@pytest.mark.parametrize("family, method", [("phi3", "gptq"), ("glm4", "gptq"), ("glm4", "awq")])
def test_checkpoints_of_families_that_reshape_projections(tmp_path, family, method):
    """Phi-3's fused qkv_proj / gate_up_proj come split into parts, GLM's q/k rows reordered
    per head: on packed 4-bit codes (their scales and zero points) as on dense weights."""
    from tests.parallel_models import build

    hf = build(family, tmp_path / "full")
    write = write_gptq if method == "gptq" else write_awq
    held = write(hf, tmp_path / "full", tmp_path / method)
    module = load_ours(tmp_path / method)
    assert_projections_quantized(module, INT4)
    check_family(module, tmp_path / method, hf_reference(hold(hf, held)), vocab=256)


def test_older_checkpoints_keep_settings_beside_config_and_zero_biases(tmp_path):
    """AutoAWQ's quant_config.json (w_bit / q_group_size / "GEMM") read when config.json has no
    quantization_config; AutoGPTQ's all-zero biases of bias-free projections (Llama) skipped."""
    hf = build_tiny_model("llama2", tmp_path / "full")
    held = write_awq(hf, tmp_path / "full", tmp_path / "awq", side_file=True)
    assert "quantization_config" not in json.loads((tmp_path / "awq/config.json").read_text())
    assert checkpoint_quantization(load_hf_config(tmp_path / "awq"),
                                   tmp_path / "awq") == PackedIntFormat("awq", 4, 32)
    module = load_ours(tmp_path / "awq")
    assert_projections_quantized(module, INT4)
    prompt = torch.randint(3, 256, (21,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = greedy_trace(hf_reference(hold(hf, held)), prompt, 12)[0][len(prompt):]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with kt.Engine(Model.from_pretrained(tmp_path / "awq", device="cpu", dtype="float32",
                                         progress=False),
                   generation_config=config, block_token_num=4, num_device_blocks=64) as engine:
        assert engine.generate_outputs([prompt])[0].token_ids == expected

    hf = build_tiny_model("llama2", tmp_path / "full2")
    held = write_gptq(hf, tmp_path / "full2", tmp_path / "gptq", zero_bias=True)
    # a bias that is not zero still has no place
    with pytest.raises(ValueError, match="unexpected checkpoint tensor .bias. for a row-parallel"):
        load_ours(_with_tensor(tmp_path / "gptq", "model.layers.0.mlp.down_proj.bias",
                               torch.ones(64, dtype=torch.float16), tmp_path / "bad"))
    check_family(load_ours(tmp_path / "gptq"), tmp_path / "gptq",
                 hf_reference(hold(hf, held)), vocab=256)


@pytest.mark.parametrize("desc_act,group_size", [(False, 16), (True, 16), (True, 32)],
                         ids=["group-order", "act-order", "act-order-g32"])
def test_gptq_moe_checkpoint_matches_the_library(tmp_path, desc_act, group_size):
    """A Qwen3-MoE GPTQ checkpoint (every expert's projections packed): the experts hold their
    4-bit codes packed two a byte with zero points (in activation order each expert with its
    input order, gate and up sharing one), and the model gives the logits and tokens of
    transformers reading a full-precision copy that holds AutoGPTQ's dequantization. (The tiny
    Mixtral's 48-wide experts do not fit AutoGPTQ's packing, which needs outputs in multiples
    of 32.) In groups of 32 the Triton backend's grouped experts read the packed codes too
    (its 4-bit tiles are 32 columns wide: groups of 16 keep the per-expert path)."""
    from transformers import AutoModelForCausalLM

    from tests.quantized_checkpoints import assert_experts_quantized
    from tests.test_family_moe import FAMILIES, _randomize

    torch.manual_seed(0)
    full = FAMILIES["qwen3_moe"]().eval()
    _randomize(full)
    full.save_pretrained(tmp_path / "full")
    held = write_gptq_from_files(tmp_path / "full", tmp_path / "gptq", desc_act=desc_act,
                                 group_size=group_size)
    assert any(".experts.7." in name for name in held)
    reference = AutoModelForCausalLM.from_pretrained(
        write_held(tmp_path / "full", tmp_path / "held", held), dtype=torch.float32).eval()
    module = load_ours(tmp_path / "gptq")
    assert assert_experts_quantized(module, INT4) == 2
    experts = module.model.layers[0].mlp.experts
    assert (experts.w13_input_order is not None) == desc_act
    # w2's 32 inputs in one group of 32: activation order changes nothing there (none kept)
    assert (experts.w2_input_order is not None) == (desc_act and group_size < 32)
    if desc_act:  # the orders are real permutations, not the plain one
        assert not torch.equal(experts.w13_input_order[3], torch.arange(experts.hidden_size))
    check_family(module, tmp_path / "gptq", hf_reference(reference), vocab=256)
    if group_size == 32:  # grouped Triton experts: packed codes, each expert in its own order
        check_triton_backend(module, tmp_path / "gptq", hf_reference(reference), vocab=256)
        assert not experts.syncs_with_host(True)


def _with_tensor(folder, name, value, target):
    import shutil

    from safetensors.torch import load_file, save_file
    shutil.copytree(folder, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors[name] = value
    save_file(tensors, str(target / "model.safetensors"))
    return target


@pytest.mark.parametrize("method", ["gptq-int4", "gptq-int8", "gptq-act-order", "awq"])
def test_gptq_awq_under_tensor_parallelism(tmp_path, method):
    """Two gloo ranks, each with its rows / group-aligned input columns of the weights held
    packed (4-bit) or as int8 (in activation order a rank's input columns are no whole groups:
    the row-parallel projections take slices of the dequantized weights): transformers' greedy
    tokens and logits."""
    hf = build_tiny_model("llama2", tmp_path / "full")
    if method == "awq":
        held = write_awq(hf, tmp_path / "full", tmp_path / "q")
    elif method == "gptq-int8":
        held = write_gptq(hf, tmp_path / "full", tmp_path / "q", bits=8, sym=True)
    else:
        held = write_gptq(hf, tmp_path / "full", tmp_path / "q", sym=False,
                          desc_act=method == "gptq-act-order")
    reference = hf_reference(hold(hf, held))
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 30, 17)]
    model = Model.from_pretrained(tmp_path / "q", device="cpu", dtype="float32",
                                  progress=False, tensor_parallel_size=2)
    held_as = INT8 if method == "gptq-int8" else INT4
    down = model.module.model.layers[0].mlp.down_proj
    assert down.local_in_features == 64  # half of the 128 inputs each
    assert down.weight.dtype == (torch.float32 if method == "gptq-act-order" else held_as)
    qkv = model.module.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == held_as  # rows split: whole groups, any order
    assert (qkv.input_order is not None) == (method == "gptq-act-order")
    check_engine_matches(model, reference, prompts)


@pytest.mark.parametrize("method", ["gptq", "awq-side-file"])
def test_gptq_mlp_split_in_whole_groups_over_ranks(tmp_path, method):
    """An MLP of 96 intermediate columns in groups of 32 (three groups) over two ranks -- the
    settings in config.json (GPTQ) or beside it (AutoAWQ's quant_config.json) alike:
    64 and 32 columns, packed on both in the checkpoint's groups, where an even split (48)
    would leave rank 1 groups of 16, too small for the packed kernels; transformers' greedy
    tokens and logits."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from ksana_llm.distributed.context import ParallelContext
    from ksana_llm.models.factory import load_model_module
    from tests.tiny_models import COMMON, perturb_biases_and_norms

    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{**COMMON, "intermediate_size": 96},
                                      tie_word_embeddings=False)).eval()
    perturb_biases_and_norms(hf)
    hf.save_pretrained(tmp_path / "full")
    held = write_gptq(hf, tmp_path / "full", tmp_path / "q", sym=False) if method == "gptq" \
        else write_awq(hf, tmp_path / "full", tmp_path / "q", side_file=True)
    whole = load_ours(tmp_path / "q").model.layers[0].mlp
    for rank, (first, columns) in enumerate(((0, 64), (64, 32))):
        module, _ = load_model_module(tmp_path / "q", device=torch.device("cpu"),
                                      dtype="float32", progress=False,
                                      parallel=ParallelContext(tp_size=2, tp_rank=rank))
        mlp = module.model.layers[0].mlp
        assert (mlp.down_proj.in_start, mlp.down_proj.local_in_features) == (first, columns)
        assert mlp.down_proj.weight.dtype == INT4
        assert torch.equal(mlp.down_proj.weight, whole.down_proj.weight[:, first // 2:
                                                                          (first + columns) // 2])
        gate_up = mlp.gate_up_proj.weight
        assert gate_up.dtype == INT4 and gate_up.shape[0] == 2 * columns
        assert torch.equal(gate_up[:columns], whole.gate_up_proj.weight[first:first + columns])
    prompts = [torch.randint(3, 256, (n,), generator=torch.Generator().manual_seed(n)).tolist()
               for n in (9, 30, 17)]
    model = Model.from_pretrained(tmp_path / "q", device="cpu", dtype="float32",
                                  progress=False, tensor_parallel_size=2)
    check_engine_matches(model, hf_reference(hold(hf, held)), prompts)


def _library_gptq_parts(codes: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                        g_idx: torch.Tensor, bits: int) -> dict[str, torch.Tensor]:
    """AutoGPTQ's packing of the given integer codes [out, in] and zero points [groups, out]
    (the weight is built so that its `pack` rounds back to exactly these codes)."""
    (qlinear,) = library_modules("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    out_features, in_features = codes.shape
    group_size = in_features // scales.shape[0]
    layer = qlinear.QuantLinear(bits, group_size, in_features, out_features, False,
                                weight_dtype=torch.float32)
    linear = torch.nn.Linear(in_features, out_features, bias=False)
    gathered_scales, gathered_zeros = scales[g_idx].t(), zeros[g_idx].t()
    linear.weight.data = (codes.float() - gathered_zeros) * gathered_scales
    layer.pack(linear, scales.t(), zeros.t().float(), g_idx)
    return {"qweight": layer.qweight, "qzeros": layer.qzeros, "scales": layer.scales,
            "g_idx": layer.g_idx}


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_codes_unpack_as_the_library_packs_them(bits):
    """Every code value at every position of a word, every zero point including 0 (which v1
    stores as -1 and so spills into its neighbours' bits, as in released asymmetric checkpoints:
    the reading must follow the library, not the intent), activation-order groups: our numbers
    are AutoGPTQ's dequantization of its own packing, exactly."""
    (qlinear,) = library_modules("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    generator = torch.Generator().manual_seed(bits)
    top = 2 ** bits
    # 32 outputs: AutoGPTQ packs zero points in whole words of 32 bits' worth of outputs
    codes = torch.randint(0, top, (32, 64), generator=generator)
    zeros = torch.randint(0, top, (4, 32), generator=generator)
    zeros[0, :3] = 0
    scales = torch.rand(4, 32, generator=generator).half().float() + 0.5
    for g_idx in (torch.arange(64, dtype=torch.int32) // 16,
                  torch.randperm(64, generator=generator).to(torch.int32) // 16):
        parts = _library_gptq_parts(codes, zeros, scales, g_idx, bits)
        expected = gptq_dequantized(qlinear.QuantLinear, parts, bits, 16)
        fmt = PackedIntFormat("gptq", bits, 16, desc_act=True, zero_offset=1)
        ours = packed_int_weight(parts, fmt, "w")
        if isinstance(ours, QuantizedWeight):  # in group order, codes fitting int8
            ours = ours.dequantize()
        torch.testing.assert_close(ours, expected, atol=0, rtol=0)


def test_awq_codes_unpack_as_the_library_packs_them():
    """Every 4-bit code at every one of the 8 interleaved positions, every zero point: our
    numbers are AutoAWQ's `dequantize_gemm` of its own `from_linear` packing, exactly."""
    gemm, packing = library_modules("awq", "modules.linear.gemm", "utils.packing_utils")
    generator = torch.Generator().manual_seed(3)
    codes = torch.randint(0, 16, (32, 64), generator=generator)  # [out, in]
    zeros = torch.randint(0, 16, (2, 32), generator=generator)  # [groups, out]
    scales = torch.rand(2, 32, generator=generator).half() + 0.5
    linear = torch.nn.Linear(64, 32, bias=False)
    linear.weight.data = (codes.float() - zeros.float().repeat_interleave(32, 0).t()) \
        * scales.float().repeat_interleave(32, 0).t()
    packed = gemm.WQLinear_GEMM.from_linear(linear, 4, 32, scales=scales, zeros=zeros.float())
    expected = packing.dequantize_gemm(packed.qweight, packed.qzeros, packed.scales.float(), 4,
                                       32).t()
    ours = packed_int_weight({"qweight": packed.qweight, "qzeros": packed.qzeros,
                              "scales": packed.scales}, PackedIntFormat("awq", 4, 32), "w")
    assert ours.data.dtype == INT4 and ours.data.shape == (32, 32)  # two codes a byte
    torch.testing.assert_close(ours.dequantize(), expected, atol=0, rtol=0)
    torch.testing.assert_close(ours.dequantize(), linear.weight.data, atol=0, rtol=0)
    # the int8 form (MoE experts) holds the same numbers
    assert ours.unpacked().data.dtype == INT8
    torch.testing.assert_close(ours.unpacked().dequantize(), expected, atol=0, rtol=0)


def test_gptq_v2_zero_points_are_stored_as_they_are():
    """checkpoint_format "gptq_v2" keeps zero points without v1's minus one: the same weight
    with its zero points stored one higher reads the same."""
    (qlinear,) = library_modules("auto_gptq", "nn_modules.qlinear.qlinear_cuda")
    codes = torch.randint(0, 16, (32, 32), generator=torch.Generator().manual_seed(4))
    zeros = torch.full((1, 32), 5)
    parts = _library_gptq_parts(codes, zeros, torch.ones(1, 32),
                                torch.zeros(32, dtype=torch.int32), 4)
    v1 = packed_int_weight(parts, PackedIntFormat("gptq", 4, -1, zero_offset=1), "w")
    v2_parts = dict(parts, qzeros=_library_gptq_parts(codes, zeros + 1, torch.ones(1, 32),
                                                      torch.zeros(32, dtype=torch.int32),
                                                      4)["qzeros"])
    v2 = packed_int_weight(v2_parts, PackedIntFormat.from_quantization(
        {"quant_method": "gptq", "bits": 4, "group_size": -1, "checkpoint_format": "gptq_v2"}),
        "w")
    torch.testing.assert_close(v2.dequantize(), v1.dequantize(), atol=0, rtol=0)
    torch.testing.assert_close(v1.dequantize(), (codes - 5).float(), atol=0, rtol=0)


def test_gptq_awq_settings_and_parts_are_checked():
    bad = [({"bits": 3}, "bits 3 is not supported for GPTQ"),
           ({"checkpoint_format": "marlin"}, "checkpoint_format 'marlin' is not supported"),
           ({"is_marlin_format": True}, "checkpoint_format 'marlin' is not supported"),
           ({"dynamic": {"-:.*": {}}}, "dynamic"),
           ({"group_size": 0}, "group_size must be positive or -1")]
    for extra, message in bad:
        with pytest.raises(ValueError, match=message):
            PackedIntFormat.from_quantization({"quant_method": "gptq", "bits": 4, **extra})
    with pytest.raises(ValueError, match="AWQ version 'gemv'"):
        PackedIntFormat.from_quantization({"quant_method": "awq", "version": "gemv"})
    with pytest.raises(ValueError, match="zero_point false"):
        PackedIntFormat.from_quantization({"quant_method": "awq", "zero_point": False})

    fmt = PackedIntFormat("gptq", 4, 16, zero_offset=1)
    parts = _library_gptq_parts(torch.zeros(32, 32, dtype=torch.long), torch.zeros(2, 32),
                                torch.ones(2, 32), torch.arange(32, dtype=torch.int32) // 16, 4)
    stream = [("a.qweight", parts["qweight"]), ("a.qzeros", parts["qzeros"]),
              ("a.scales", parts["scales"]), ("a.g_idx", parts["g_idx"]),
              ("norm.weight", torch.ones(32))]
    assert [name for name, _ in paired_packed_ints(stream, fmt)] == ["a.weight", "norm.weight"]
    with pytest.raises(ValueError, match=r"GPTQ weights missing parts \(have \{'a': \['qweight'"):
        list(paired_packed_ints(stream[:1], fmt))
    shuffled = torch.randperm(32, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    with pytest.raises(ValueError, match="g_idx puts inputs out of group order, but "
                                         "quantization_config.desc_act is false"):
        list(paired_packed_ints([("a.g_idx", shuffled // 16)] + stream[:3], fmt))
    with pytest.raises(ValueError, match="do not cover a \\[32, 32\\] weight in groups of 8"):
        packed_int_weight(parts, PackedIntFormat("gptq", 4, 8, zero_offset=1), "w")
