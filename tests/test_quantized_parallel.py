"""Quantized checkpoints over two gloo ranks, against transformers reading the same files (or
the library's own numbers): FP8 checkpoints and online FP8, W8A8 dense and MoE, FP8 experts split
in whole blocks, and a split inside a scale block that keeps the numbers. Single-rank loading is
in tests/test_quantized_checkpoints.py.
"""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.models.factory import load_model_module
from tests.family_harness import check_family, hf_reference, load_ours
from tests.quantized_checkpoints import (assert_experts_quantized, check_engine_matches,
                                         deepseek_full, fake_quantized, hf_fp8_model,
                                         with_library_activation_quantization,
                                         write_compressed_tensors, write_fp8_checkpoint,
                                         write_w8a8_by_rows)
from tests.tiny_models import build_tiny_model

FP8 = torch.float8_e4m3fn
INT8 = torch.int8
INT4 = torch.uint8  # packed: two 4-bit codes a byte


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
