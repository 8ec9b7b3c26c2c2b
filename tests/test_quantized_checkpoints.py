"""Quantized checkpoints end to end against transformers, which reads the same files on its own
(on a CPU it dequantizes them): hub-format FP8 (tiny Llama with block and per-tensor scales,
DeepSeek-V3 with MLA, MoE and its MTP layer drafting, Qwen3-MoE, Mixtral) and llm-compressor's
compressed-tensors FP8 and int4 -- logits at prefill / decode / a prefix hit and 32 greedy
Engine tokens, with projections and experts FP8 in memory; and over two gloo ranks.
"""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.layers.linear import QuantizedStorage
from ksana_llm.models.factory import load_model_module
from tests.family_harness import ATOL, check_family, check_triton_backend, hf_reference, load_ours
from tests.quantized_checkpoints import (assert_experts_quantized, assert_projections_quantized,
                                         check_engine_matches, deepseek_full, fake_quantized,
                                         hf_fp8_model, with_library_activation_quantization,
                                         write_compressed_tensors, write_fp8_checkpoint,
                                         write_w8a8_by_rows)
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
    from tests.test_tensor_parallel import build

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
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=2,
                                  quantization="fp8" if source == "online" else None)
    down = model.module.model.layers[0].mlp.down_proj.weight
    assert down.dtype == FP8
    assert down.shape == ((64, 48) if source.startswith("deepseek") else (64, 64))  # 1/2 each
    if source.startswith("deepseek"):
        assert model.module.model.layers[1].mlp.experts.w2.shape == (8, 64, 16)
        assert assert_experts_quantized(model.module) == 2
    check_engine_matches(model, reference, prompts)


def test_online_w8a8_is_the_librarys_w8a8(tmp_path):
    """`quantization="w8a8_int8"` on a full-precision checkpoint holds the int8 codes and row
    scales the library's W8A8 preset writes (rounding to nearest), and quantizes the inputs as
    that checkpoint asks: the library reference's logits and greedy tokens. Embeddings, the LM
    head and norms stay as they are."""
    full = build_tiny_model("yi-gqa4-bias", tmp_path / "full")
    written = load_ours(tmp_path / "full")  # before the library's numbers replace full's
    held = write_compressed_tensors(tmp_path / "full", tmp_path / "w8a8", "w8a8")
    checkpoint = load_ours(tmp_path / "w8a8")
    online = Model.from_pretrained(tmp_path / "full", device="cpu", dtype="float32",
                                   progress=False, quantization="w8a8_int8").module
    for name, tensor in checkpoint.named_parameters():
        assert torch.equal(online.get_parameter(name), tensor), name
    for name, tensor in checkpoint.named_buffers():
        if name.endswith("weight_scale"):
            torch.testing.assert_close(online.get_buffer(name), tensor, atol=0, rtol=1e-6)
    assert online.lm_head.weight.dtype == torch.float32
    assert torch.equal(online.model.embed_tokens.weight, written.model.embed_tokens.weight)
    with torch.no_grad():
        for name, values in held.items():
            full.get_parameter(name).copy_(values)
    reference = hf_reference(with_library_activation_quantization(full, tmp_path / "w8a8"))
    check_family(online, tmp_path / "full", reference, vocab=256)


@pytest.mark.parametrize("source", ["checkpoint", "online"])
def test_w8a8_under_tensor_parallelism(tmp_path, source):
    """Two gloo ranks holding a W8A8 checkpoint written by the library (or quantizing the
    full-precision one as it loads): a row-parallel rank sees a slice of each token's input,
    and scales it by the whole token's largest magnitude (one all-reduce), so the greedy
    tokens and logits are the library reference's."""
    full = build_tiny_model("llama2", tmp_path / "full")
    folder = tmp_path / "w8a8"
    held = write_compressed_tensors(tmp_path / "full", folder, "w8a8")
    with torch.no_grad():
        for name, values in held.items():
            full.get_parameter(name).copy_(values)
    reference = hf_reference(with_library_activation_quantization(full, folder))
    torch.manual_seed(1)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (9, 30, 17)]
    online = source == "online"
    model = Model.from_pretrained(tmp_path / "full" if online else folder, device="cpu",
                                  dtype="float32", progress=False, tensor_parallel_size=2,
                                  quantization="w8a8_int8" if online else None)
    down = model.module.model.layers[0].mlp.down_proj
    assert down.weight.dtype == INT8 and down.weight.shape == (64, 64)  # half the inputs
    assert down.int8_activations
    check_engine_matches(model, reference, prompts)


@pytest.mark.parametrize("source", ["checkpoint", "online"])
def test_w8a8_moe_under_tensor_parallelism(tmp_path, source):
    """A Qwen3-MoE W8A8 checkpoint (or the full-precision one quantized as it loads) over two
    gloo ranks: each rank holds half of every expert's intermediate columns, and the experts'
    down inputs are scaled by each token's whole hidden row over both ranks, so the tokens and
    logits are those of one rank holding the checkpoint."""
    from tests.test_family_moe import FAMILIES, _randomize

    torch.manual_seed(0)
    full = FAMILIES["qwen3_moe"]().eval()
    _randomize(full)
    full.save_pretrained(tmp_path / "full")
    folder = write_w8a8_by_rows(tmp_path / "full", tmp_path / "w8a8")
    torch.manual_seed(1)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (9, 30, 17)]
    single = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    assert assert_experts_quantized(single.module, INT8) == 2
    with kt.Engine(single, block_token_num=4, num_device_blocks=96) as one_rank:
        def reference(ids: list[int]) -> torch.Tensor:
            return one_rank.forward(ids, [{"target_name": "logits"}]).targets[0].tensor

        online = source == "online"
        model = Model.from_pretrained(tmp_path / "full" if online else folder, device="cpu",
                                      dtype="float32", progress=False, tensor_parallel_size=2,
                                      quantization="w8a8_int8" if online else None)
        experts = model.module.model.layers[0].mlp.experts
        assert experts.w2.dtype == INT8 and experts.int8_activations["w2"]
        assert experts.w2.shape[2] * 2 == single.module.model.layers[0].mlp.experts.w2.shape[2]
        check_engine_matches(model, reference, prompts)


def test_fp8_experts_split_in_whole_blocks_over_ranks(tmp_path):
    """A Qwen3-MoE FP8 checkpoint whose experts' 48 intermediate columns are three blocks of 16:
    two ranks take 32 and 16 of them (an even split, 24 each, would leave rank 1 groups of 8,
    too small for the kernels), every expert stays FP8 with the checkpoint's own block scales,
    and the engine's tokens and logits are transformers' reading of the checkpoint."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    from tests.test_family_moe import COMMON, _randomize

    torch.manual_seed(0)
    full = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, head_dim=32, intermediate_size=96, moe_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True)).eval()
    _randomize(full)
    full.save_pretrained(tmp_path / "full")
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (16, 16))
    whole = load_ours(folder).model.layers[0].mlp.experts
    for rank, (first, columns) in enumerate(((0, 32), (32, 16))):
        module, _ = load_model_module(folder, device=torch.device("cpu"), dtype="float32",
                                      parallel=ParallelContext(tp_size=2, tp_rank=rank),
                                      progress=False)
        experts = module.model.layers[0].mlp.experts
        assert experts.w2.dtype == FP8 and tuple(experts.w2.shape) == (8, 64, columns)
        assert torch.equal(experts.w2.view(torch.uint8),
                           whole.w2[:, :, first:first + columns].view(torch.uint8))
        assert torch.equal(experts.w2_scale, whole.w2_scale[:, :, first // 16:
                                                            (first + columns) // 16])
    torch.manual_seed(1)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (9, 30, 17)]
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=2)
    check_engine_matches(model, hf_reference(hf_fp8_model(folder, (16, 16))), prompts)


def test_tensor_parallel_split_inside_a_block_keeps_the_numbers(tmp_path):
    """Blocks of 48 that no rank's slice follows (o_proj's 64 inputs split by heads at 32;
    down_proj's 128, no whole number of blocks, at 64): a rank starting inside a block holds
    its columns in groups of 16, each block's scale repeated over them, still FP8, and the
    engine gives the tokens and logits of transformers holding the checkpoint's numbers (its
    own FP8 loader wants blocks that divide every weight)."""
    from safetensors.torch import load_file

    from tests.gptq_awq_checkpoints import hold
    from tests.quantized_checkpoints import block_dequantize

    hf = build_tiny_model("llama2", tmp_path / "full")  # o_proj / down_proj inputs 64 / 128
    folder = write_fp8_checkpoint(tmp_path / "full", tmp_path / "fp8", (48, 48))
    tensors = load_file(str(folder / "model.safetensors"))
    held = {name: block_dequantize(tensors[name], scale, (48, 48))
            for name, scale in ((name.replace("_scale_inv", ""), scale)
                                for name, scale in tensors.items()
                                if name.endswith("weight_scale_inv"))}
    assert len(held) == 2 * 7  # every projection of both layers
    module, _ = load_model_module(folder, device=torch.device("cpu"), dtype="float32",
                                  parallel=ParallelContext(tp_size=2, tp_rank=1),
                                  progress=False)
    layer = module.model.layers[0]
    for projection in (layer.self_attn.o_proj, layer.mlp.down_proj):
        assert projection.weight.dtype == FP8 and projection.weight_group_size == 16
    torch.manual_seed(1)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (9, 30, 17)]
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=2)
    check_engine_matches(model, hf_reference(hold(hf, held)), prompts)


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
