"""OpenAI GPT-OSS (`GptOssForCausalLM`) end to end against transformers (fp32).

A tiny random model saved by transformers, its weights moved where each GPT-OSS part shows: sink
logits of either sign and up to ~3 (a lost sink moves every logit), a router spread wide enough
that tokens pick different experts, biases, and a SwiGLU limit low enough that the clamps cut.
Logits at prefill (whole and chunked), 16 decode steps and on a prefix-cache hit, greedy tokens
through the Engine (tests/family_harness.py), the Triton kernels (their interpreter on CPU), a
checkpoint whose experts are MXFP4 blocks and scales (the reference: the same model with
transformers' own dequantization of them), and the norms' float32 weight multiply in bfloat16.
Tensor parallelism is in tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import GptOssConfig, GptOssForCausalLM
from transformers.integrations.mxfp4 import convert_moe_packed_tensors
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.norm import RMSNorm
from ksana_llm.models.factory import load_model_module
from ksana_llm.loader.mxfp4 import dequantize_mxfp4, mxfp4_weight
from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.loader.weight_quant import dequantize_weight, e8m0_scales, quantize_mxfp4
from ksana_llm.models.gpt_oss import GptOssForCausalLM as OurGptOss, keeps_mxfp4_codes
from tests.family_harness import (check_engine_greedy, check_family, check_prefill_and_decode,
                                  check_triton_backend, greedy_trace, hf_reference, load_ours,
                                  memoized)

VOCAB = 256
CONFIG = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
              num_experts_per_tok=2, sliding_window=8, max_position_embeddings=512,
              swiglu_limit=1.0, bos_token_id=1, eos_token_id=2, pad_token_id=0,
              rope_parameters={"rope_type": "yarn", "factor": 8.0, "beta_fast": 32.0,
                               "beta_slow": 1.0, "truncate": False, "rope_theta": 150000.0,
                               "original_max_position_embeddings": 64})


def build_model(**overrides) -> GptOssForCausalLM:
    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**{**CONFIG, **overrides}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0, 1.5)
            elif "norm" in name:
                param.normal_(1.0, 0.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
            elif "router" in name or "experts" in name:
                param.normal_(0, 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    model = build_model()
    folder = tmp_path_factory.mktemp("gpt_oss")
    model.save_pretrained(folder)
    return model, folder


def test_family_matches_transformers(saved):
    hf, folder = saved
    ours = load_ours(folder)
    assert isinstance(ours, OurGptOss)
    assert [layer.self_attn.layer_window for layer in ours.model.layers] == [8, None]
    assert ours.layer_sliding_window == 8 and ours.sliding_window is None
    check_family(ours, folder, hf_reference(hf), vocab=VOCAB)


def test_through_the_triton_kernels(saved):
    hf, folder = saved
    check_triton_backend(load_ours(folder), folder, memoized(hf_reference(hf)), vocab=VOCAB)


@pytest.mark.parametrize("part", ["sinks", "clamp"])
def test_each_gpt_oss_part_matters(saved, part):
    """Without the sinks, or with the SwiGLU unclamped, transformers' logits are out of reach:
    the model's weights exercise both."""
    hf, folder = saved
    ours = load_ours(folder)
    for layer in ours.model.layers:
        if part == "sinks":
            layer.self_attn.sinks = None
        else:
            from ksana_llm.layers.activation import clamped_swiglu

            layer.mlp.experts.act = clamped_swiglu(1.702, 1e4)
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(ours, memoized(hf_reference(hf)), vocab=VOCAB, chunks=[40])


def _mxfp4_checkpoint(hf: GptOssForCausalLM, folder, target):
    """`folder`'s checkpoint with every expert stack replaced by random MXFP4 blocks and scales
    (in the released checkpoints' layout: [E, out, in / 32, 16], rows not transposed), and `hf`
    given transformers' own dequantization of them: the reference for that checkpoint."""
    shutil.copytree(folder, target)
    tensors = load_file(target / "model.safetensors")
    generator = torch.Generator().manual_seed(5)
    config = hf.config
    shapes = {"gate_up_proj": (2 * config.intermediate_size, config.hidden_size),
              "down_proj": (config.hidden_size, config.intermediate_size)}
    for i, layer in enumerate(hf.model.layers):
        for proj, (rows, inputs) in shapes.items():
            name = f"model.layers.{i}.mlp.experts.{proj}"
            experts = config.num_local_experts
            blocks = torch.randint(0, 256, (experts, rows, inputs // 32, 16), dtype=torch.uint8,
                                   generator=generator)
            scales = torch.randint(120, 125, (experts, rows, inputs // 32), dtype=torch.uint8,
                                   generator=generator)
            del tensors[name]
            tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
            with torch.no_grad():
                getattr(layer.mlp.experts, proj).copy_(
                    convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
    save_file(tensors, target / "model.safetensors")
    config_file = target / "config.json"
    raw = json.loads(config_file.read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4",
                                  "modules_to_not_convert": ["model.layers.*.self_attn",
                                                             "model.layers.*.mlp.router",
                                                             "model.embed_tokens", "lm_head"]}
    config_file.write_text(json.dumps(raw))
    return target


@pytest.fixture(scope="module")
def mxfp4_saved(saved, tmp_path_factory):
    _, folder = saved
    hf = build_model()
    return hf, _mxfp4_checkpoint(hf, folder, tmp_path_factory.mktemp("gpt_oss") / "mxfp4")


def test_mxfp4_experts_stay_packed(mxfp4_saved):
    """The experts keep the checkpoint's codes, half a byte a number (with a float32 scale per
    block of 32), and the logits match transformers' on its own dequantization, on the torch
    path and through the grouped Triton kernel."""
    hf, mxfp4 = mxfp4_saved
    ours = load_ours(mxfp4, dtype="bfloat16")
    experts = ours.model.layers[0].mlp.experts
    hidden, inter, count = CONFIG["hidden_size"], CONFIG["intermediate_size"], 4
    assert experts.w13.dtype == experts.w2.dtype == torch.uint8
    assert experts.fp4 == {"w13": True, "w2": True}
    assert tuple(experts.w13.shape) == (count, 2 * inter, hidden // 2)
    assert tuple(experts.w13_scale.shape) == (count, 2 * inter, hidden // 32)
    assert tuple(experts.w2_scale.shape) == (count, hidden, inter // 32)
    assert experts.group_sizes == {"w13": 32, "w2": 32}
    reference = memoized(hf_reference(hf))
    check_prefill_and_decode(load_ours(mxfp4), reference, vocab=VOCAB, chunks=[16, 16, 8])
    check_triton_backend(load_ours(mxfp4), mxfp4, reference, vocab=VOCAB)


def test_mxfp4_under_tensor_parallelism(mxfp4_saved):
    """Two ranks each keep the FP4 codes of their half of the intermediate columns (one block
    of 32 each) and give transformers' greedy tokens; four ranks would have fewer than a block
    each, so there the experts load dequantized."""
    hf, mxfp4 = mxfp4_saved
    check_engine_greedy(mxfp4, memoized(hf_reference(hf)), vocab=VOCAB, tensor_parallel_size=2)
    keeps = {tp: keeps_mxfp4_codes(CONFIG["intermediate_size"], ParallelContext(
        tp_size=tp, tp_rank=tp - 1)) for tp in (1, 2, 4)}
    assert keeps == {1: True, 2: True, 4: False}
    # gpt-oss's 2880 columns (90 blocks) over 4 and 8 ranks: whole blocks on every rank
    for tp in (4, 8):
        assert all(keeps_mxfp4_codes(2880, ParallelContext(tp_size=tp, tp_rank=rank))
                   for rank in range(tp))


def test_mxfp4_experts_split_unevenly_in_whole_blocks(saved, tmp_path):
    """Three blocks of intermediate columns over two ranks: 64 and 32 columns, both kept as
    FP4 codes (an even split, 48 each, would cut a block and load dequantized), with each
    rank's biases and scales its own; the engine's greedy tokens are transformers'."""
    hf = build_model(intermediate_size=96)
    hf.save_pretrained(tmp_path / "full")
    mxfp4 = _mxfp4_checkpoint(hf, tmp_path / "full", tmp_path / "mxfp4")
    whole = load_ours(mxfp4).model.layers[0].mlp.experts
    starts = {0: 0, 1: 64}
    for rank, columns in ((0, 64), (1, 32)):
        module, _ = load_model_module(mxfp4, device=torch.device("cpu"), dtype="float32",
                                      parallel=ParallelContext(tp_size=2, tp_rank=rank),
                                      progress=False)
        experts = module.model.layers[0].mlp.experts
        assert experts.fp4 == {"w13": True, "w2": True}
        assert tuple(experts.w2.shape) == (4, 64, columns // 2)
        assert tuple(experts.w2_scale.shape) == (4, 64, columns // 32)
        first = starts[rank]
        assert torch.equal(experts.w2, whole.w2[:, :, first // 2:(first + columns) // 2])
        assert torch.equal(experts.w2_scale, whole.w2_scale[:, :, first // 32:
                                                            (first + columns) // 32])
        gate = slice(first, first + columns)
        assert torch.equal(experts.w13_bias, torch.cat([whole.w13_bias[:, gate],
                                                        whole.w13_bias[:, 96:][:, gate]], 1))
    check_engine_greedy(mxfp4, memoized(hf_reference(hf)), vocab=VOCAB, tensor_parallel_size=2)


def test_mxfp4_dequantization_equals_transformers():
    torch.manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 2, 16), dtype=torch.uint8)
    scales = torch.randint(110, 140, (3, 8, 2), dtype=torch.uint8)
    expected = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # [3, 64, 8]
    assert torch.equal(dequantize_mxfp4(blocks, scales, torch.float32), expected.transpose(1, 2))
    for expert in range(3):  # kept packed, and as int8 codes: the same numbers
        codes = mxfp4_weight(blocks[expert], scales[expert])
        assert codes.data.dtype == torch.uint8 and codes.fp4 and codes.group_size == 32
        assert torch.equal(codes.dequantize(), expected[expert].T)
        unpacked = codes.unpacked()
        assert unpacked.data.dtype == torch.int8 and not unpacked.fp4
        assert torch.equal(unpacked.dequantize(), expected[expert].T)
        assert torch.equal(codes.columns(32, 32).dequantize(), expected[expert].T[:, 32:])
    with pytest.raises(ValueError, match="one weight's"):
        mxfp4_weight(blocks, scales)
    # and back: MXFP4 numbers quantize to themselves; ties go to the even code; past 6
    # times the scale saturates
    values = expected.transpose(1, 2).reshape(-1, 64)
    codes, scale = quantize_mxfp4(values)
    assert torch.equal(dequantize_weight(codes, scale, 32, fp4=True), values)
    ties = torch.tensor([[0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0, 7.9, -0.75] + [0.0] * 23])
    codes, scale = quantize_mxfp4(ties)
    assert scale.dtype == torch.uint8 and scale.tolist() == [[127]]  # E8M0: 2 ** 0
    assert dequantize_weight(codes, scale, 32, fp4=True)[0, :9].tolist() == \
        [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0, 6.0, -1.0]
    with pytest.raises(ValueError, match="multiple of 32"):
        quantize_mxfp4(torch.ones(2, 48))
    diverged = torch.linspace(-1, 1, 64).reshape(1, 64)  # NaN / inf: its block reads back NaN
    diverged[0, 3], diverged[0, 40] = float("nan"), float("inf")
    codes, scale = quantize_mxfp4(diverged)
    assert dequantize_weight(codes, scale, 32, fp4=True).isnan().all()
    with pytest.raises(ValueError, match="MXFP4 blocks"):
        dequantize_mxfp4(blocks[..., :8], scales)


def test_e8m0_scale_bytes_are_powers_of_two_and_nan():
    """Every scale byte as the OCP format defines it, written out: 2 ** (byte - 127), the
    byte 255 NaN (transformers' dequantization reads it as 2 ** 128, an infinity)."""
    exponents = torch.arange(256, dtype=torch.uint8)
    decoded = e8m0_scales(exponents)
    assert decoded.dtype == torch.float32 and decoded[255].isnan()
    assert decoded[:255].tolist() == [2.0 ** (byte - 127) for byte in range(255)]
    with pytest.raises(ValueError, match="uint8"):
        e8m0_scales(torch.ones(3))
    codes = torch.zeros(2, 16, dtype=torch.uint8)
    with pytest.raises(ValueError, match="E8M0"):  # FP4 weights keep their scales as bytes
        QuantizedWeight(codes, torch.ones(2, 1), 32, fp4=True)
    weight = QuantizedWeight(codes | 0x22, torch.tensor([[0], [254]], dtype=torch.uint8), 32,
                             fp4=True)  # every value 1.0 times the scale
    assert weight.dequantize()[:, 0].tolist() == [2.0 ** -127, 2.0 ** 127]
    unpacked = weight.unpacked()  # int8 codes twice the values, float32 scales half as large
    assert unpacked.scale.dtype == torch.float32 and not unpacked.fp4
    assert torch.equal(unpacked.dequantize(), weight.dequantize())


def test_mxfp4_blocks_without_scales_are_named(saved, tmp_path):
    _, folder = saved
    mxfp4 = _mxfp4_checkpoint(build_model(), folder, tmp_path / "mxfp4")
    tensors = load_file(mxfp4 / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.down_proj_scales"]
    save_file(tensors, mxfp4 / "model.safetensors")
    with pytest.raises(ValueError, match=r"model\.layers\.1\.mlp\.experts\.down_proj_blocks"):
        load_ours(mxfp4)


def test_norm_multiplies_its_weight_in_float32():
    """In bfloat16 the weight multiply before the cast back rounds as transformers' GPT-OSS
    (and OLMo 2) norm does, which Llama's order would not."""
    torch.manual_seed(0)
    reference = GptOssRMSNorm(256, eps=1e-5).to(torch.bfloat16)
    torch.nn.init.normal_(reference.weight, 1.0, 0.5)
    ours = RMSNorm(256, 1e-5).to(torch.bfloat16)
    ours.weight.data.copy_(reference.weight)
    ours.weight_in_float32 = True
    x = torch.randn(64, 256, dtype=torch.bfloat16) * 3
    assert torch.equal(ours(x), reference(x))
    ours.weight_in_float32 = False
    assert not torch.equal(ours(x), reference(x))


def test_an_expert_stack_of_the_wrong_size_is_named(saved, tmp_path):
    _, folder = saved
    broken = shutil.copytree(folder, tmp_path / "broken")
    tensors = load_file(broken / "model.safetensors")
    name = "model.layers.1.mlp.experts.gate_up_proj"
    tensors[name] = tensors[name][:3].contiguous()
    save_file(tensors, broken / "model.safetensors")
    with pytest.raises(ValueError, match=name.replace(".", r"\.") + ".*one per expert"):
        load_ours(broken)


def test_sinks_convert_to_float32_once_and_follow_the_parameter():
    """The attention reads float32 sinks: a bfloat16 model's are copied once, not per layer
    per step, into one buffer (captured CUDA graphs read it there) that follows the parameter:
    refreshed in place after a cast, and when asked -- by `prepare_for_inference`, which every
    load and weight update ends with (a graph replay runs no Python to notice)."""
    from ksana_llm.models.llama_attention import LlamaAttention

    attention = LlamaAttention(GptOssConfig(**CONFIG), sinks=True).to(torch.bfloat16)
    with torch.no_grad():
        attention.sinks.copy_(torch.tensor([0.5, -1.25, 2.0, 3.0]))
    first = attention.sinks_in_float32()
    assert first.dtype == torch.float32 and first.tolist() == [0.5, -1.25, 2.0, 3.0]
    assert attention.sinks_in_float32() is first
    with torch.no_grad():
        attention.sinks.copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))  # updated in place
    assert attention.sinks_in_float32(refresh=True) is first
    assert first.tolist() == [1.0, 2.0, 3.0, 4.0]
    attention.to(torch.float16)  # a new parameter tensor: noticed without being asked
    with torch.no_grad():
        attention.sinks.mul_(2)
    assert attention.sinks_in_float32() is first and first.tolist() == [2.0, 4.0, 6.0, 8.0]
    attention.to(torch.float32)  # already float32: the parameter itself
    assert attention.sinks_in_float32() is attention.sinks


def test_weight_updates_reach_the_float32_sinks(saved):
    """A weight update (`load_weights`, which `update_weights` runs) copies new sinks into the
    bfloat16 parameter in place; the float32 copy the attention reads (and a captured graph
    would) holds them before any forward."""
    _, folder = saved
    ours = load_ours(folder, dtype="bfloat16")
    attention = ours.model.layers[1].self_attn
    copy = attention.sinks_in_float32()
    new_sinks = (attention.sinks.detach().float() + 1).to(torch.bfloat16)
    ours.load_weights([("model.layers.1.self_attn.sinks", new_sinks)], require_all=False)
    assert attention._float_sinks is copy  # the same buffer, refreshed in place
    assert torch.equal(copy, new_sinks.float())


def test_an_fp4_weight_reaching_a_projection_becomes_int8_codes():
    """A projection keeps 8-bit codes (its kernels read no FP4): an MXFP4 weight reaching one
    is held as int8 codes, twice the e2m1 values under half the scales -- the same numbers."""
    from ksana_llm.layers.parallel import RowParallelLinear

    gen = torch.Generator().manual_seed(4)
    blocks = torch.randint(0, 256, (16, 2, 16), dtype=torch.uint8, generator=gen)
    scales = torch.randint(120, 126, (16, 2), dtype=torch.uint8, generator=gen)
    projection = RowParallelLinear(64, 16)
    projection.load_checkpoint_tensor("weight", mxfp4_weight(blocks, scales))
    assert projection.weight.dtype == torch.int8
    x = torch.randn(3, 64, generator=gen)
    expected = x @ dequantize_mxfp4(blocks, scales, torch.float32).T
    torch.testing.assert_close(projection(x), expected)


def test_a_bf16_update_of_mxfp4_experts_keeps_them_packed(mxfp4_saved, saved):
    """A trainer's weights (bf16 stacks, transformers' layout) into a model serving the MXFP4
    checkpoint: the experts are quantized to MXFP4 as they load (keeping the model's format,
    rather than being refused); values that are MXFP4 numbers already come back exactly, so
    the greedy tokens stay transformers' own, and another model's weights switch them."""
    import ksana_llm as kt
    from ksana_llm.generation_config import GenerationConfig

    hf, mxfp4 = mxfp4_saved
    other_hf, _ = saved  # the dense model: other experts, not MXFP4 numbers
    prompt = torch.randint(3, VOCAB, (12,), generator=torch.Generator().manual_seed(8)).tolist()
    expected = {name: greedy_trace(memoized(hf_reference(model)), prompt, 8)[0][len(prompt):]
                for name, model in (("mxfp4", hf), ("other", other_hf))}
    assert expected["mxfp4"] != expected["other"]
    model = kt.Model.from_pretrained(mxfp4, device="cpu", dtype="float32", progress=False)
    experts = model.module.model.layers[0].mlp.experts
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with kt.Engine(model, generation_config=config, num_device_blocks=32) as engine:
        for name, source in (("other", other_hf), ("mxfp4", hf)):
            stacks = {k: v.to(torch.bfloat16) for k, v in source.state_dict().items()
                      if ".mlp.experts." in k}
            engine.update_weights(stacks.items())
            assert experts.w13.dtype == torch.uint8 and experts.fp4 == {"w13": True, "w2": True}
            tokens = engine.generate_outputs([prompt])[0].token_ids
            if name == "mxfp4":  # exact: the MXFP4 values are bf16 numbers too
                assert tokens == expected[name]
            else:  # rounded to MXFP4: near the other model's, and surely not the first's
                assert tokens != expected["mxfp4"]
