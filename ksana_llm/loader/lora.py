"""Reading a LoRA adapter saved by PEFT (`adapter_config.json` plus `adapter_model.safetensors`
or `adapter_model.bin`), checked strictly: anything this engine would apply differently from
PEFT is refused with a ValueError naming it, rather than served wrong."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

import torch

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = ("adapter_model.safetensors", "adapter_model.bin")

# PEFT saves `base_model.model.<module>.lora_A.weight`; older versions keep the adapter's name
# (`lora_A.default.weight`).
_TENSOR_NAME = re.compile(r"^(?:base_model\.model\.)?(?P<module>.+)\.lora_(?P<ab>[AB])"
                          r"(?:\.[^.]+)?\.weight$")

# Config fields that change what the adapter computes, with the value we implement.
_REQUIRED_VALUES: Mapping[str, Any] = MappingProxyType({
    "use_dora": False, "fan_in_fan_out": False, "lora_bias": False,
})
# PEFT's other LoRA variants and options that change the forward pass or the base model
# (activated LoRA, Arrow routing, block-diagonal LoRA, KaSA, layer replication, QA-LoRA,
# Megatron layers, MonteCLoRA, VeLoRA, LoRA on raw parameters, trainable token rows): refused
# when set, rather than applied as plain LoRA. Initialisations that only set A and B (EVA,
# orthogonal, MiCA, NoRA) leave plain LoRA behind and are fine; those in
# _BASE_CHANGING_INITS are not (below).
_VARIANT_KEYS: tuple[str, ...] = (
    "alora_invocation_tokens", "arrow_config", "use_bdlora", "kasa_config", "layer_replication",
    "use_qalora", "megatron_config", "monteclora_config", "velora_config", "target_parameters",
    "trainable_token_indices",
)

# `init_lora_weights` values (prefixes: "pissa_niter_4") whose initialisation also rewrites the
# base weights (PiSSA, CorDA and ASTRA subtract the initial A B, OLoRA its QR part, LoftQ and
# LoRA-GA replace them): PEFT runs it again when it loads the folder, so the adapter's A and B
# belong to a base model this engine does not serve. PEFT converts such an adapter to plain
# LoRA on saving (`path_initial_model_for_weight_conversion`): that folder loads.
_BASE_CHANGING_INITS: tuple[str, ...] = ("pissa", "corda", "astra", "olora", "loftq", "lora_ga")


@dataclass(frozen=True)
class LoraModuleWeights:
    """One adapted module: A [r, in] and B [out, r] with the scaling already folded into B."""

    a: torch.Tensor
    b: torch.Tensor

    @property
    def rank(self) -> int:
        return int(self.a.shape[0])


@dataclass(frozen=True)
class LoraAdapter:
    path: str
    modules: Mapping[str, LoraModuleWeights]  # checkpoint module name -> weights

    @property
    def max_rank(self) -> int:
        return max(m.rank for m in self.modules.values())


def _pattern_value(patterns: Mapping[str, Any], module: str, default: Any) -> Any:
    """PEFT's `rank_pattern` / `alpha_pattern` lookup: a key (a regular expression, alternations
    included) matches a module name it ends on whole dotted components."""
    for pattern, value in (patterns or {}).items():
        if re.fullmatch(rf"(.*\.)?(?:{pattern})", module):
            return value
    return default


def _read_config(path: str) -> dict[str, Any]:
    config_path = os.path.join(path, ADAPTER_CONFIG)
    if not os.path.isfile(config_path):
        raise ValueError(f"LoRA adapter {path!r}: no {ADAPTER_CONFIG} (is it a PEFT adapter "
                         "folder?)")
    try:
        with open(config_path, encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"LoRA adapter {path!r}: cannot read {ADAPTER_CONFIG}: {exc}") from None
    if not isinstance(config, dict):
        raise ValueError(f"LoRA adapter {path!r}: {ADAPTER_CONFIG} must hold an object")
    if config.get("peft_type", "LORA") != "LORA":
        raise ValueError(f"LoRA adapter {path!r}: peft_type {config.get('peft_type')!r} is not "
                         "supported (only LORA)")
    for key, wanted in _REQUIRED_VALUES.items():
        if bool(config.get(key, wanted)) != wanted:
            raise ValueError(f"LoRA adapter {path!r}: {key}={config.get(key)!r} is not supported")
    for key in _VARIANT_KEYS:
        if config.get(key):
            raise ValueError(f"LoRA adapter {path!r}: {key}={config[key]!r} is not supported "
                             "(only plain LoRA)")
    init = config.get("init_lora_weights")
    if isinstance(init, str) and init.lower().startswith(_BASE_CHANGING_INITS):
        raise ValueError(f"LoRA adapter {path!r}: init_lora_weights={init!r} changes the base "
                         "weights, which this engine serves unchanged; save the adapter "
                         "converted to plain LoRA (PEFT's "
                         "path_initial_model_for_weight_conversion)")
    if config.get("bias", "none") != "none":
        raise ValueError(f"LoRA adapter {path!r}: bias={config['bias']!r} is not supported "
                         "(only 'none')")
    if config.get("modules_to_save"):
        raise ValueError(f"LoRA adapter {path!r}: modules_to_save {config['modules_to_save']} "
                         "(fully trained modules) are not supported")
    return config


def _read_tensors(path: str) -> dict[str, torch.Tensor]:
    for filename in ADAPTER_WEIGHTS:
        file = os.path.join(path, filename)
        if not os.path.isfile(file):
            continue
        try:
            if filename.endswith(".safetensors"):
                from safetensors.torch import load_file

                tensors = load_file(file)
            else:
                tensors = torch.load(file, map_location="cpu", weights_only=True)
        except Exception as exc:  # noqa: BLE001 - safetensors / pickle / zip errors alike
            raise ValueError(f"LoRA adapter {path!r}: {filename} cannot be read (corrupt or "
                             f"truncated?): {str(exc).splitlines()[0] if str(exc) else type(exc).__name__}"
                             ) from exc
        if not isinstance(tensors, dict):
            raise ValueError(f"LoRA adapter {path!r}: {filename} does not hold a state dict")
        return tensors
    raise ValueError(f"LoRA adapter {path!r}: none of {', '.join(ADAPTER_WEIGHTS)} found")


def load_lora_adapter(path: str) -> LoraAdapter:
    """Read and check the adapter in folder `path` (on the CPU, float32)."""
    path = os.path.abspath(os.path.expanduser(str(path)))
    if not os.path.isdir(path):
        raise ValueError(f"LoRA adapter {path!r} is not a folder")
    config = _read_config(path)
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in _read_tensors(path).items():
        match = _TENSOR_NAME.match(name)
        if match is None:
            raise ValueError(f"LoRA adapter {path!r}: tensor {name!r} is not a LoRA A/B weight "
                             "(embedding and bias adapters are not supported)")
        pairs.setdefault(match["module"], {})[match["ab"]] = tensor
    if not pairs:
        raise ValueError(f"LoRA adapter {path!r} holds no LoRA weights")
    alpha = config.get("lora_alpha", 8)
    modules = {}
    for module, ab in sorted(pairs.items()):
        if set(ab) != {"A", "B"}:
            raise ValueError(f"LoRA adapter {path!r}: {module} lacks its lora_"
                             f"{'B' if 'A' in ab else 'A'} weight")
        a, b = ab["A"].float(), ab["B"].float()
        rank = a.shape[0]
        if a.dim() != 2 or b.dim() != 2 or b.shape[1] != rank or rank == 0:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)}, which do not form a rank-r product")
        module_alpha = float(_pattern_value(config.get("alpha_pattern"), module, alpha))
        scaling = module_alpha / (math.sqrt(rank) if config.get("use_rslora") else rank)
        modules[module] = LoraModuleWeights(a, b * scaling)
    return LoraAdapter(path, modules)


def save_lora_adapter(folder: str | os.PathLike[str],
                      modules: Mapping[str, tuple[torch.Tensor, torch.Tensor]], *,
                      lora_alpha: float) -> None:
    """Write a LoRA adapter in PEFT's format (what `load_lora_adapter` and PEFT read):
    `modules` maps a checkpoint module name (`model.layers.0.self_attn.q_proj`) to its
    (A [r, in], B [out, r]); one rank for all modules."""
    from safetensors.torch import save_file

    ranks = {int(a.shape[0]) for a, _ in modules.values()}
    if len(ranks) != 1:
        raise ValueError(f"save_lora_adapter: one rank for every module, got {sorted(ranks)}")
    os.makedirs(folder, exist_ok=True)
    tensors = {}
    for name, (a, b) in modules.items():
        tensors[f"base_model.model.{name}.lora_A.weight"] = a.contiguous()
        tensors[f"base_model.model.{name}.lora_B.weight"] = b.contiguous()
    save_file(tensors, os.path.join(folder, ADAPTER_WEIGHTS[0]))
    targets = sorted({name.rsplit(".", 1)[-1] for name in modules})
    with open(os.path.join(folder, ADAPTER_CONFIG), "w", encoding="utf-8") as f:
        json.dump({"peft_type": "LORA", "r": ranks.pop(), "lora_alpha": lora_alpha,
                   "target_modules": targets, "bias": "none"}, f, indent=2)
