"""Quantized checkpoints written from a full-precision folder, for tests that load them with
ksana-llm and transformers: FP8 in the hub's layout (DeepSeek V3 / Qwen3-FP8 / transformers'
FineGrainedFP8), and llm-compressor's compressed-tensors formats (FP8, int4).

transformers only quantizes on a GPU, so the tests write the checkpoint themselves (with
`loader.weight_quant.quantize_fp8`, which is also what online quantization uses); transformers
reads it back on its own (its dequantizing CPU path), which is the independent check of the
format.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from ksana_llm.loader.weight_quant import FP8_WEIGHT_DTYPE, quantize_fp8

# The projections transformers' FP8 loader replaces with FP8Linear: every nn.Linear inside the
# decoder layers (attention, MLP, MLA, per-expert MLPs), not the router gate, embeddings, norms
# or the LM head.
QUANTIZED = re.compile(r"model\.layers\.\d+\..*(?:_proj|_proj_with_mqa|\.w[123])\.weight$")


def copy_all_but_weights(source: Path, target: Path) -> None:
    """`source`'s files into `target` but its safetensors and config.json (which a writer of a
    quantized checkpoint writes anew): the tokenizer's and generation config's files."""
    target.mkdir(parents=True, exist_ok=True)
    for item in source.iterdir():
        if item.suffix != ".safetensors" and item.name != "config.json":
            shutil.copy(item, target / item.name)


def write_fp8_checkpoint(source: Path, target: Path,
                         block_size: tuple[int, int] | None = (16, 16)) -> Path:
    """`target` = `source` with every decoder projection stored as FP8 + `weight_scale_inv`
    (one scale per block, or per tensor with `block_size` None) and the config saying so."""
    copy_all_but_weights(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        if QUANTIZED.match(name) and tensor.dim() == 2:
            data, scale = quantize_fp8(tensor, block_size)
            out[name] = data
            out[name.removesuffix("weight") + "weight_scale_inv"] = \
                scale.reshape(()) if block_size is None else scale
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                     "fmt": "e4m3"}
    if block_size is not None:
        config["quantization_config"]["weight_block_size"] = list(block_size)
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target


# compressed-tensors presets by the strategy the tests name them after.
COMPRESSED_TENSORS_PRESETS = {"tensor": "FP8", "channel": "FP8_DYNAMIC", "block": "FP8_BLOCK",
                              "int4": "W4A16", "int4-asym": "W4A16_ASYM",
                              "int4-channel": "W4A16", "int4-actorder": "W4A16",
                              "int8": "W8A16", "int8-asym": "W8A16", "w8a8": "W8A8",
                              "w8a8-group": "W8A8"}


def write_compressed_tensors(source: Path, target: Path, strategy: str,
                             block_size: tuple[int, int] = (16, 16),
                             group_size: int = 32) -> dict[str, torch.Tensor]:
    """`source` quantized by the compressed-tensors library itself, as llm-compressor saves it,
    every decoder Linear but the LM head: FP8 weights with per-`strategy` ("tensor", "channel"
    or "block") scales in `weight_scale`, or int4 / int8 weights packed in int32 ("int4" /
    "int8": symmetric, groups of `group_size` columns; "-asym": with zero points;
    "int4-actorder": as "int4", the config saying GPTQ ran in "static" activation order;
    "int4-channel": one scale per row), or "w8a8": int8 weights unpacked ("int-quantized"),
    one scale per row ("w8a8-group": per group), with the preset's dynamic per-token int8
    activations in the config;
    scales computed from each tile's range by the library's own `calculate_qparams`; the
    config's `quantization_config` written by its compressor. Otherwise weight-only: the FP8
    preset's static activation scales would make transformers quantize activations too, which
    ksana-llm does not (it drops `input_scale`).

    Returns the numbers the checkpoint holds, as the library computes them (its
    `fake_quantize` with the same scales and zero points), by weight name: the reference
    where transformers cannot read the checkpoint (asymmetric int4: its loader expects the
    zero points unpacked)."""
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.quantization import (QuantizationConfig, apply_quantization_config,
                                                 preset_name_to_scheme)
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32).eval()
    scheme = preset_name_to_scheme(COMPRESSED_TENSORS_PRESETS[strategy], ["Linear"])
    if not strategy.startswith("w8a8"):
        scheme.input_activations = None
    if strategy == "block":
        scheme.weights.block_structure = list(block_size)
    elif strategy == "int4-channel":
        scheme.weights.strategy, scheme.weights.group_size = "channel", None
    elif strategy == "w8a8-group":
        scheme.weights.strategy, scheme.weights.group_size = "group", group_size
    elif strategy.startswith("int"):
        scheme.weights.group_size = group_size
        scheme.weights.symmetric = not strategy.endswith("-asym")
        if strategy == "int4-actorder":  # GPTQ's "static" order: the plain format on disk
            scheme.weights.actorder = "static"
    apply_quantization_config(model, QuantizationConfig(config_groups={"group_0": scheme},
                                                        ignore=["lm_head"]))
    held: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for module_name, module in model.named_modules():
            if not hasattr(module, "weight_scale"):
                continue
            weight = module.weight.float()
            rows, cols = weight.shape
            if strategy == "tensor":
                low, high = weight.amin().reshape(1), weight.amax().reshape(1)
            elif strategy in ("channel", "int4-channel", "w8a8"):
                low, high = weight.amin(1, keepdim=True), weight.amax(1, keepdim=True)
            elif strategy == "block":
                tiles = weight.reshape(rows // block_size[0], block_size[0],
                                       cols // block_size[1], block_size[1])
                low, high = tiles.amin((1, 3)), tiles.amax((1, 3))
            else:
                groups = weight.reshape(rows, cols // group_size, group_size)
                low, high = groups.amin(-1), groups.amax(-1)
            scale, zero = calculate_qparams(low, high, module.quantization_scheme.weights)
            module.weight_scale.copy_(scale.reshape(module.weight_scale.shape))
            zero_point = getattr(module, "weight_zero_point", None)
            if zero_point is not None:
                zero_point.copy_(zero.reshape(zero_point.shape))
            held[f"{module_name}.weight"] = fake_quantize(
                weight, module.weight_scale, zero_point, module.quantization_scheme.weights)
    compressor = ModelCompressor.from_pretrained_model(model, None)
    compressor.compress_model(model)
    model.save_pretrained(target)
    compressor.update_config(str(target))
    return held


# ---- references and checks the FP8 tests share ------------------------------------------

def block_dequantize(data: torch.Tensor, scale: torch.Tensor, block: tuple[int, int]
                     ) -> torch.Tensor:
    """Each [block] tile of the FP8 values times its own scale, tile by tile (the format's
    definition, written independently of the code under test)."""
    out = data.float().clone()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block[0]:(i + 1) * block[0], j * block[1]:(j + 1) * block[1]] *= scale[i, j]
    return out


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


def check_engine_matches(model, reference, prompts: list[list[int]]) -> None:
    """12 greedy tokens per prompt through the `Engine` (e.g. over two gloo ranks) equal the
    reference's, and so do the second prompt's logits."""
    import ksana_llm as kt
    from ksana_llm.generation_config import GenerationConfig
    from tests.family_harness import greedy_trace

    expected = [greedy_trace(reference, p, 12)[0][len(p):] for p in prompts]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    with kt.Engine(model, generation_config=config, block_token_num=4,
                   num_device_blocks=96) as engine:
        outputs = engine.generate_outputs(prompts)
        logits = engine.forward(prompts[1], [{"target_name": "logits"}]).targets[0].tensor
    assert [o.token_ids for o in outputs] == expected
    torch.testing.assert_close(logits, reference(prompts[1]), atol=2e-4, rtol=1e-4)


def assert_projections_quantized(module: torch.nn.Module, dtype: torch.dtype = FP8_WEIGHT_DTYPE
                                 ) -> None:
    """Every quantized projection holds `dtype` values (MLA's kv_b_proj: dense)."""
    projections = [name for name, p in module.named_parameters()
                   if QUANTIZED.match(name.replace("qkv_proj", "q_proj")
                                      .replace("gate_up_proj", "gate_proj")
                                      .replace("qkv_a_proj", "q_a_proj"))]
    assert projections
    for name in projections:
        if "kv_b_proj" in name:  # MLA multiplies by views of it: kept dense
            assert module.get_parameter(name).dtype == torch.float32, name
        else:
            assert module.get_parameter(name).dtype == dtype, name


def assert_experts_quantized(module: torch.nn.Module, dtype: torch.dtype = FP8_WEIGHT_DTYPE
                             ) -> int:
    """Every MoE expert stack holds `dtype` values with one scale per row and group; how
    many."""
    from ksana_llm.layers.moe import FusedExperts

    stacks = [m for m in module.modules() if isinstance(m, FusedExperts)]
    for experts in stacks:
        assert experts.w13.dtype == dtype and experts.w2.dtype == dtype
        assert experts.w13_scale.shape[:2] == experts.w13.shape[:2]
        assert experts.w2_scale.shape[:2] == experts.w2.shape[:2]
        packed = dtype == torch.uint8  # two 4-bit codes a byte, zero points beside the scales
        for name in ("w13", "w2"):
            zero = getattr(experts, f"{name}_zero_point")
            assert (zero is not None) == packed
            if packed:
                assert zero.shape == getattr(experts, f"{name}_scale").shape
    return len(stacks)


def deepseek_full(folder: Path) -> torch.nn.Module:
    from transformers import DeepseekV3ForCausalLM

    from tests.deepseek_checkpoint import deepseek_config, randomize

    torch.manual_seed(0)
    full = DeepseekV3ForCausalLM(deepseek_config(num_nextn_predict_layers=0)).eval()
    randomize(full)
    full.save_pretrained(folder)
    return full


def fake_quantize_rows(weight: torch.Tensor) -> torch.Tensor:
    """Per-row E4M3 with the row's largest magnitude at 448, back to float32."""
    scale = weight.abs().amax(dim=1, keepdim=True).clamp_min(1e-12) / 448.0
    return (weight / scale).clamp(-448.0, 448.0).to(FP8_WEIGHT_DTYPE).float() * scale


def fake_quantized(hf: torch.nn.Module) -> torch.nn.Module:
    """`hf` with every decoder projection's weight replaced by its per-row FP8 values."""
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if QUANTIZED.match(name):
                param.copy_(fake_quantize_rows(param))
    return hf


def with_library_activation_quantization(hf: torch.nn.Module, folder: Path) -> torch.nn.Module:
    """`hf` with every decoder projection's input quantized as the checkpoint in `folder` says
    (its config's `input_activations`: W8A8's dynamic int8 per token) by compressed-tensors'
    own functions, as the library's forward does where transformers runs these checkpoints."""
    from compressed_tensors.quantization import QuantizationConfig
    from compressed_tensors.quantization.lifecycle.forward import fake_quantize
    from compressed_tensors.quantization.utils.helpers import compute_dynamic_scales_and_zp

    config = QuantizationConfig.model_validate(
        json.loads((folder / "config.json").read_text())["quantization_config"])
    (scheme,) = config.config_groups.values()
    args = scheme.input_activations

    def quantize_input(module: torch.nn.Module, inputs: tuple[torch.Tensor]
                       ) -> tuple[torch.Tensor]:
        (x,) = inputs
        scale, zero_point = compute_dynamic_scales_and_zp(x, args, module)
        return (fake_quantize(x, scale, zero_point, args),)

    for name, module in hf.named_modules():
        if isinstance(module, torch.nn.Linear) and QUANTIZED.match(f"{name}.weight"):
            module.register_forward_pre_hook(quantize_input)
    return hf


# llm-compressor's W8A8 preset as its compressor writes it into config.json.
W8A8_QUANTIZATION_CONFIG = {
    "quant_method": "compressed-tensors", "format": "int-quantized",
    "quantization_status": "compressed", "ignore": ["lm_head"],
    "config_groups": {"group_0": {
        "targets": ["Linear"], "format": "int-quantized",
        "weights": {"num_bits": 8, "type": "int", "symmetric": True, "strategy": "channel",
                    "dynamic": False},
        "input_activations": {"num_bits": 8, "type": "int", "symmetric": True,
                              "strategy": "token", "dynamic": True}}}}


def write_w8a8_by_rows(source: Path, target: Path) -> Path:
    """`target` = `source` with every decoder projection (MoE experts' too, which transformers
    5 does not keep as Linear modules for the library to quantize) as W8A8 writes it: an int8
    `weight` and one float32 `weight_scale` per row, computed by compressed-tensors'
    `calculate_qparams` / `quantize`, and the preset's config."""
    from compressed_tensors.quantization import QuantizationArgs
    from compressed_tensors.quantization.lifecycle.forward import quantize
    from compressed_tensors.quantization.utils.helpers import calculate_qparams

    args = QuantizationArgs.model_validate(
        W8A8_QUANTIZATION_CONFIG["config_groups"]["group_0"]["weights"])
    copy_all_but_weights(source, target)
    out: dict[str, torch.Tensor] = {}
    for name, tensor in load_file(str(source / "model.safetensors")).items():
        if QUANTIZED.match(name) and tensor.dim() == 2:
            scale, zero_point = calculate_qparams(tensor.amin(1, keepdim=True),
                                                  tensor.amax(1, keepdim=True), args)
            out[name] = quantize(tensor, scale, zero_point, args, dtype=torch.int8)
            out[name.removesuffix("weight") + "weight_scale"] = scale
        else:
            out[name] = tensor.contiguous()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = W8A8_QUANTIZATION_CONFIG
    (target / "config.json").write_text(json.dumps(config, indent=2))
    return target
