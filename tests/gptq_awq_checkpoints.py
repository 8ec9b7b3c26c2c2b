"""GPTQ and AWQ checkpoints written by the libraries that define the formats, and the numbers
those libraries say the checkpoints hold.

- GPTQ: AutoGPTQ (`auto_gptq`, 0.7.1): its GPTQ algorithm (`GPTQ.fasterquant`, with activation
  order when asked) picks each layer's codes, scales, zero points and `g_idx` from calibration
  inputs, and its `QuantLinear.pack` writes `qweight` / `qzeros` / `scales` / `g_idx` as released
  GPTQ models hold them (checkpoint format v1: zero points stored minus one).
- AWQ: AutoAWQ (`awq`, 0.2.9): its `WQLinear_GEMM.from_linear` packs (interleaved order), with
  round-to-nearest group scales and zero points computed as its quantizer does.

The reference for a checkpoint is transformers' model holding the library's own dequantization
of every packed layer (AutoGPTQ's `QuantLinear.forward` on its CPU path, AutoAWQ's
`dequantize_gemm`). transformers cannot read these checkpoints itself on a CPU (its GPTQ and
AWQ loaders need GPTQModel, which needs a newer torch than this project pins).

Both libraries are installed without their dependencies (scripts/test.sh): only their
pure-torch packing and dequantization code runs. Their package `__init__`s import model code
that no longer matches transformers, so `library_modules` imports the needed submodules with a
bare parent package instead.
"""

from __future__ import annotations

import importlib
import importlib.util
import json
import re
import shutil
import sys
import types
from pathlib import Path
from unittest import mock

import torch
from safetensors.torch import load_file, save_file

from tests.quantized_checkpoints import QUANTIZED, copy_all_but_weights


def library_modules(package: str, *modules: str) -> list[types.ModuleType]:
    """`package.module` for each module, imported without running `package/__init__.py`: the
    package is registered bare (its path only), once per process."""
    if package not in sys.modules:
        spec = importlib.util.find_spec(package)
        if spec is None or spec.submodule_search_locations is None:
            raise ImportError(f"{package} is not installed (scripts/test.sh installs it)")
        bare = types.ModuleType(package)
        bare.__path__ = list(spec.submodule_search_locations)
        sys.modules[package] = bare
    return [importlib.import_module(f"{package}.{module}") for module in modules]


def _calibration_inputs(model: torch.nn.Module, names: list[str], vocab: int,
                        prompts: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """Each projection's inputs over `prompts` (default: four of random ids), all from the
    full-precision model (GPTQ proper feeds each layer the quantized layers' outputs: this is
    about the format, not about the best codes)."""
    inputs: dict[str, list[torch.Tensor]] = {name: [] for name in names}
    hooks = [model.get_submodule(name).register_forward_hook(
        lambda module, args, out, name=name: inputs[name].append(args[0].detach().reshape(
            -1, args[0].shape[-1]))) for name in names]
    generator = torch.Generator().manual_seed(0)
    if prompts is None:
        prompts = [torch.randint(3, vocab, (48,), generator=generator).tolist()
                   for _ in range(4)]
    with torch.no_grad():
        for ids in prompts:
            model(torch.tensor([ids]))
    for hook in hooks:
        hook.remove()
    return {name: torch.cat(chunks) for name, chunks in inputs.items()}


def _write(source: Path, target: Path, replaced: dict[str, dict[str, torch.Tensor]],
           config_key: str | None, settings: dict, side_file: str | None = None) -> None:
    copy_all_but_weights(source, target)
    tensors = load_file(str(source / "model.safetensors"))
    out: dict[str, torch.Tensor] = {}
    for name, tensor in tensors.items():
        base = name.removesuffix(".weight")
        if base in replaced:
            out.update({f"{base}.{part}": value.contiguous()
                        for part, value in replaced[base].items()})
        elif name.removesuffix(".bias") not in replaced:
            out[name] = tensor.contiguous()
    save_file(out, str(target / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((source / "config.json").read_text())
    if config_key is not None:
        config[config_key] = settings
    (target / "config.json").write_text(json.dumps(config, indent=2))
    if side_file is not None:
        (target / side_file).write_text(json.dumps(settings, indent=2))


def projection_names(model: torch.nn.Module) -> list[str]:
    return [name.removesuffix(".weight") for name, _ in model.named_parameters()
            if QUANTIZED.match(name)]


def write_gptq(model: torch.nn.Module, source: Path, target: Path, *, bits: int = 4,
               group_size: int = 32, desc_act: bool = False, sym: bool = True,
               zero_bias: bool = False, vocab: int = 256,
               calibration: list[list[int]] | None = None) -> dict[str, torch.Tensor]:
    """`source` (saved from `model`) quantized by AutoGPTQ into `target` as a GPTQ checkpoint;
    every decoder projection, not the LM head. `zero_bias`: bias-free projections get an
    all-zero `bias`, as older AutoGPTQ versions wrote; `calibration`: the prompts whose
    inputs GPTQ fits the codes to (default: random ids). Returns each projection's weight as
    AutoGPTQ dequantizes the checkpoint, by weight name (fp32)."""
    names = projection_names(model)
    inputs = _calibration_inputs(model, names, vocab, calibration)
    replaced: dict[str, dict[str, torch.Tensor]] = {}
    held: dict[str, torch.Tensor] = {}
    for name in names:
        linear = model.get_submodule(name)
        parts, held[f"{name}.weight"] = gptq_layer(linear, inputs[name], bits=bits,
                                                   group_size=group_size, desc_act=desc_act,
                                                   sym=sym)
        if linear.bias is None and zero_bias:
            parts["bias"] = torch.zeros(linear.out_features, dtype=torch.float16)
        replaced[name] = parts
    _write(source, target, replaced, "quantization_config",
           gptq_settings(bits, group_size, desc_act, sym))
    return held


def write_gptq_from_files(source: Path, target: Path, *, group_size: int = 16,
                          desc_act: bool = False) -> dict[str, torch.Tensor]:
    """Every decoder projection of the checkpoint in `source` (the per-expert tensors of an MoE
    model included, which transformers' model holds fused) quantized by AutoGPTQ to 4 bits,
    fitted to random inputs -- the same inputs for projections that share one (q / k / v, gate /
    up), as in a real model, so that in activation order (`desc_act`) they share their order;
    the library's dequantization by weight name."""
    replaced: dict[str, dict[str, torch.Tensor]] = {}
    held: dict[str, torch.Tensor] = {}
    generator = torch.Generator().manual_seed(0)
    shared_inputs: dict[str, torch.Tensor] = {}
    for name, weight in load_file(str(source / "model.safetensors")).items():
        if not QUANTIZED.match(name) or weight.dim() != 2:
            continue
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        linear.weight.data = weight.float().clone()
        reader = re.sub(r"\.(k_proj|v_proj)\.", ".q_proj.",
                        name.replace(".up_proj.", ".gate_proj."))
        if reader not in shared_inputs:
            shared_inputs[reader] = torch.randn(64, weight.shape[1], generator=generator)
        replaced[name.removesuffix(".weight")], held[name] = gptq_layer(
            linear, shared_inputs[reader], bits=4, group_size=group_size, desc_act=desc_act,
            sym=True)
    _write(source, target, replaced, "quantization_config",
           gptq_settings(4, group_size, desc_act, True))
    return held


def write_held(source: Path, target: Path, held: dict[str, torch.Tensor]) -> Path:
    """A full-precision copy of `source` holding the given weights: what transformers loads as
    the reference where its model stores them differently (fused MoE experts)."""
    shutil.copytree(source, target)
    tensors = load_file(str(target / "model.safetensors"))
    tensors.update({name: value.contiguous() for name, value in held.items()})
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})
    return target


def gptq_settings(bits: int, group_size: int, desc_act: bool, sym: bool) -> dict:
    return {"quant_method": "gptq", "bits": bits, "group_size": group_size,
            "desc_act": desc_act, "sym": sym, "checkpoint_format": "gptq"}


def gptq_layer(linear: torch.nn.Linear, inputs: torch.Tensor, *, bits: int, group_size: int,
               desc_act: bool, sym: bool) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One layer through AutoGPTQ: GPTQ fitted to `inputs` [n, in], packed as a checkpoint
    stores it (fp16 scales); (its parts, bias included, and the library's dequantization)."""
    gptq, qlinear = library_modules("auto_gptq", "quantization.gptq",
                                    "nn_modules.qlinear.qlinear_cuda")
    quantizer = gptq.GPTQ(linear)
    quantizer.quantizer.configure(bits, perchannel=True, sym=sym)
    quantizer.add_batch(inputs[None], None)
    # fasterquant only times itself with torch.cuda.synchronize: no CUDA here.
    with mock.patch("torch.cuda.synchronize"):
        scale, zero, g_idx = quantizer.fasterquant(group_size=group_size, actorder=desc_act)
    packed = qlinear.QuantLinear(bits, group_size, linear.in_features, linear.out_features,
                                 linear.bias is not None, weight_dtype=torch.float16)
    packed.pack(linear.half(), scale, zero, g_idx)
    linear.float()
    parts = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales,
             "g_idx": packed.g_idx}
    if linear.bias is not None:
        parts["bias"] = linear.bias.detach().half()
    return parts, gptq_dequantized(qlinear.QuantLinear, parts, bits, group_size)


def gptq_dequantized(quant_linear: type, parts: dict[str, torch.Tensor], bits: int,
                     group_size: int) -> torch.Tensor:
    """AutoGPTQ's own reading of a packed layer: its forward (CPU path) on the identity, in
    fp32, gives the weight's transpose."""
    in_features = parts["g_idx"].numel()
    out_features = parts["scales"].shape[1]
    layer = quant_linear(bits, group_size, in_features, out_features, False,
                         weight_dtype=torch.float32)
    layer.qweight, layer.qzeros, layer.g_idx = parts["qweight"], parts["qzeros"], parts["g_idx"]
    layer.scales = parts["scales"].float()
    with torch.no_grad():
        return layer(torch.eye(in_features)).t().contiguous()


def write_awq(model: torch.nn.Module, source: Path, target: Path, *, group_size: int = 32,
              side_file: bool = False) -> dict[str, torch.Tensor]:
    """`source` (saved from `model`) quantized to 4 bits with zero points and packed by AutoAWQ
    into `target`; the settings in config.json's `quantization_config`, or (`side_file`) only in
    the `quant_config.json` older AutoAWQ checkpoints keep beside it. Returns each projection's
    weight as AutoAWQ dequantizes the checkpoint."""
    gemm, packing = library_modules("awq", "modules.linear.gemm", "utils.packing_utils")
    replaced: dict[str, dict[str, torch.Tensor]] = {}
    held: dict[str, torch.Tensor] = {}
    for name in projection_names(model):
        linear = model.get_submodule(name)
        scales, zeros = _awq_round_to_nearest(linear.weight.detach(), group_size)
        packed = gemm.WQLinear_GEMM.from_linear(linear, 4, group_size, scales=scales,
                                                zeros=zeros)
        parts = {"qweight": packed.qweight, "qzeros": packed.qzeros, "scales": packed.scales}
        if linear.bias is not None:
            parts["bias"] = linear.bias.detach().half()
        replaced[name] = parts
        held[f"{name}.weight"] = packing.dequantize_gemm(
            packed.qweight, packed.qzeros, packed.scales.float(), 4, group_size).t().contiguous()
    settings = {"quant_method": "awq", "bits": 4, "group_size": group_size, "version": "gemm",
                "zero_point": True}
    if side_file:  # AutoAWQ's own names for the same settings
        settings = {"w_bit": 4, "q_group_size": group_size, "version": "GEMM",
                    "zero_point": True}
    _write(source, target, replaced, None if side_file else "quantization_config", settings,
           "quant_config.json" if side_file else None)
    return held


def _awq_round_to_nearest(weight: torch.Tensor, group_size: int
                          ) -> tuple[torch.Tensor, torch.Tensor]:
    """AutoAWQ's asymmetric group scales and zero points ([groups, out], fp16 scales) as its
    `pseudo_quantize_tensor` computes them."""
    out_features, in_features = weight.shape
    groups = weight.float().reshape(-1, group_size)
    high, low = groups.amax(dim=1, keepdim=True), groups.amin(dim=1, keepdim=True)
    scales = (high - low).clamp(min=1e-5) / 15
    zeros = (-torch.round(low / scales)).clamp(0, 15)
    shape = (out_features, in_features // group_size)
    return (scales.reshape(shape).t().contiguous().half(),
            zeros.reshape(shape).t().contiguous())


def hold(model: torch.nn.Module, weights: dict[str, torch.Tensor]) -> torch.nn.Module:
    """`model` with the given weights copied in (the reference for a quantized checkpoint)."""
    with torch.no_grad():
        for name, value in weights.items():
            model.get_parameter(name).copy_(value)
    return model

