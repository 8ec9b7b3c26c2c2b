"""Quantized checkpoints end to end against transformers, which reads the same files on its own
(on a CPU it dequantizes them): hub-format FP8 (tiny Llama with block and per-tensor scales,
DeepSeek-V3 with MLA, MoE and its MTP layer drafting, Qwen3-MoE, Mixtral) and llm-compressor's
compressed-tensors FP8 and int4 -- logits at prefill / decode / a prefix hit and 32 greedy
Engine tokens, with projections and experts FP8 in memory. Over two gloo ranks:
tests/test_quantized_parallel.py.
"""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.layers.linear import QuantizedStorage
from tests.family_harness import ATOL, check_family, check_triton_backend, hf_reference, load_ours
from tests.quantized_checkpoints import (assert_experts_quantized, assert_projections_quantized,
                                         deepseek_full, hf_fp8_model,
                                         with_library_activation_quantization,
                                         write_compressed_tensors, write_fp8_checkpoint)
from tests.tiny_models import build_tiny_model

FP8 = torch.float8_e4m3fn
INT8 = torch.int8
INT4 = torch.uint8  # packed: two 4-bit codes a byte


@pytest.mark.parametrize("block", [(16, 16), None], ids=["block16", "per-tensor"])
def test_fp8_llama_checkpoint_matches_transformers(tmp_path, block):
    build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", block)
    hf = hf_fp8_model(folder, block)
    module = load_ours(folder)
    assert_projections_quantized(module)
    check_family(module, folder, hf_reference(hf), vocab=256)


@pytest.mark.parametrize("family", ["phi3", "glm4"])
def test_fp8_checkpoints_of_families_that_reshape_projections(tmp_path, family):
    """Phi-3's fused qkv_proj / gate_up_proj split into parts, GLM's q/k rows reordered per
    head: on FP8 block-scaled weights as on dense ones."""
    from tests.parallel_models import build

    build(family, tmp_path / "full")
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (16, 16))
    module = load_ours(folder)
    assert_projections_quantized(module)
    check_family(module, folder, hf_reference(hf_fp8_model(folder, (16, 16))), vocab=256)


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
    assert_projections_quantized(module)
    scale = module.model.layers[0].self_attn.o_proj.weight_scale
    assert scale.shape == {"tensor": (64, 1), "channel": (64, 1), "block": (64, 8)}[strategy]
    check_family(module, folder, hf_reference(reference), vocab=256)


@pytest.mark.parametrize("strategy", ["int4", "int4-asym", "int4-channel", "int4-actorder"])
def test_compressed_tensors_int4_checkpoint_matches_transformers(tmp_path, strategy):
    """llm-compressor's W4A16 checkpoints (`pack-quantized`: eight 4-bit codes per int32,
    group or channel scales, zero points when asymmetric), written by the compressed-tensors
    library, held packed two codes a byte with their zero points, the same numbers: logits and
    greedy tokens equal transformers' reading the checkpoint through the library -- or, for
    zero points, which transformers' loader cannot read, transformers' model holding the
    numbers the library says the checkpoint holds."""
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
    assert_projections_quantized(module, INT4)
    scale = module.model.layers[0].self_attn.o_proj.weight_scale
    assert scale.shape == ((64, 1) if strategy == "int4-channel" else (64, 4))  # 128 / 32
    check_family(module, folder, hf_reference(reference), vocab=256)


@pytest.mark.parametrize("strategy", ["int8", "int8-asym", "w8a8", "w8a8-group"])
def test_compressed_tensors_int8_checkpoint_matches_the_library(tmp_path, strategy):
    """llm-compressor's int8 checkpoints, written by the compressed-tensors library: W8A16
    (`pack-quantized`, four 8-bit codes per int32, group scales; with zero points) and W8A8
    (`int-quantized`: an int8 `weight`, one scale per row or group, and each projection's input
    quantized to int8 per token on the fly). transformers cannot read either on a CPU, so the
    reference is transformers' model holding the numbers the library says the checkpoint holds
    (and, for W8A8, quantizing each projection's input with the library's own functions). The
    codes stay int8 in memory: symmetric ones minus their zero point, asymmetric ones (up to 255
    from their zero point) minus 128 with their zero points beside them."""
    full = build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    folder = tmp_path / "ct"
    held = write_compressed_tensors(tmp_path / "full", folder, strategy)
    with torch.no_grad():
        for name, values in held.items():
            full.get_parameter(name).copy_(values)
    module = load_ours(folder)
    o_proj = module.model.layers[0].self_attn.o_proj
    assert_projections_quantized(module, INT8)
    assert (o_proj.weight_zero_point is not None) == (strategy == "int8-asym")
    assert o_proj.weight_scale.shape == ((64, 1) if strategy == "w8a8" else (64, 4))
    w8a8 = strategy.startswith("w8a8")
    assert all(m.int8_activations == w8a8 for m in module.modules()
               if isinstance(m, QuantizedStorage))
    reference = hf_reference(full)
    if w8a8:
        prompt = list(range(3, 40))
        weights_only = reference(prompt)
        reference = hf_reference(with_library_activation_quantization(full, folder))
        # the activations' quantization shows in the logits: a test that tells them apart
        assert (reference(prompt) - weights_only).abs().max() > 4 * ATOL
    check_family(module, folder, reference, vocab=256)


@pytest.mark.parametrize("bits", [4, 8])
def test_packed_int_codes_unpack_as_the_library_packs_them(bits):
    """Every 4- / 8-bit value at every position of a word, and zero points packed along the
    rows, come back as compressed-tensors' own pack_to_int32 put them in; held as int8 (37
    columns in groups of 19 cannot pack two a byte): symmetric codes minus their zero point,
    asymmetric ones with their zero points beside them."""
    from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

    from ksana_llm.loader.fp8_weights import packed_int_weight, unpack_ints
    from ksana_llm.loader.quantized_weight import QuantizedWeight

    torch.manual_seed(6)
    low, high = -(1 << (bits - 1)), 1 << (bits - 1)
    values = torch.randint(low, high, (5, 37), dtype=torch.int8)  # 37: the last word partial
    values[0, :2] = torch.tensor([low, high - 1])
    packed = pack_to_int32(values, bits)
    assert torch.equal(unpack_ints(packed, bits, 37), values.to(torch.int16))
    zero = torch.randint(low, high, (5, 2), dtype=torch.int8)
    scale = torch.rand(5, 2)
    parts = {"weight_packed": packed, "weight_scale": scale,
             "weight_shape": torch.tensor([5, 37])}
    symmetric = packed_int_weight(parts, bits, "w")
    assert isinstance(symmetric, QuantizedWeight) and symmetric.data.dtype == INT8
    torch.testing.assert_close(symmetric.dequantize(),
                               values.float() * scale.repeat_interleave(19, 1)[:, :37])
    weight = packed_int_weight({**parts, "weight_zero_point": pack_to_int32(zero, bits,
                                                                             packed_dim=0)},
                               bits, "w")
    expected = (values.float() - zero.float().repeat_interleave(19, 1)[:, :37]) \
        * scale.repeat_interleave(19, 1)[:, :37]
    # odd groups: int8 either way, the zero points (one per group) kept beside the codes
    assert weight.group_size == 19 and weight.data.dtype == INT8
    assert weight.zero_point is not None
    torch.testing.assert_close(weight.dequantize(), expected, atol=0, rtol=0)


def test_fp8_deepseek_checkpoint_matches_transformers(tmp_path):
    """DeepSeek V3 / R1 ship as FP8: MLA's projections, the shared and the routed experts stay
    FP8; MLA's absorbed kv_b_proj loads dequantized."""
    from tests.deepseek_checkpoint import VOCAB

    deepseek_full(tmp_path / "full")
    # 8x8 blocks: transformers' CPU dequantization needs blocks that divide every dimension.
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (8, 8))
    module = load_ours(folder)
    assert_projections_quantized(module)
    assert assert_experts_quantized(module) == 2
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
    assert assert_experts_quantized(module) == 2
    reference = hf_reference(hf_fp8_model(folder, (16, 16)))
    check_family(module, folder, reference, vocab=256)
    if family == "qwen3_moe":  # the grouped Triton experts widen the FP8 bytes in registers
        check_triton_backend(module, folder, reference, vocab=256)
        assert not module.model.layers[0].mlp.experts.syncs_with_host(True)


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
