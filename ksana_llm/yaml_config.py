"""KsanaLLM-style YAML configuration -> `EngineConfig` plus server-level settings.

KsanaLLM users bring their `ksana_llm.yaml`; we read the keys that mean something to this engine,
translate them to `EngineConfig` field names (see `config.py` for the naming clash around
`max_batch_size`), and refuse everything else with a `ValueError` naming the full dotted key, so
that a typo never silently falls back to a default. CLI flags (`overrides`, already in
`EngineConfig` field names) win over the file.

    config, server = load_engine_config("examples/ksana_llm.yaml", {"device": "cpu"})

Keys and where they go:

| YAML key                                          | destination                               |
|---------------------------------------------------|-------------------------------------------|
| setting.global.tensor_para_size                   | EngineConfig.tensor_parallel_size         |
|                                                   |   (0 = all visible GPUs)                  |
| setting.global.pipeline_para_size                 | EngineConfig.pipeline_parallel_size       |
| setting.global.enable_cuda_graph                  | EngineConfig.enable_cuda_graphs           |
| setting.batch_scheduler.max_batch_size            | EngineConfig.max_num_seqs                 |
| setting.batch_scheduler.max_step_tokens           | EngineConfig.max_step_tokens              |
| setting.batch_scheduler.max_token_len             | EngineConfig.max_model_len (0 -> None;    |
|                                                   |   lowered to the model's context)         |
| setting.batch_scheduler.max_waiting_queue_len     | EngineConfig.max_queue_size               |
| setting.batch_scheduler.waiting_timeout_in_ms     | EngineConfig.waiting_timeout_ms           |
| setting.batch_scheduler.split_fuse_token_num      | EngineConfig.split_fuse_token_num         |
| setting.batch_scheduler.enable_auto_prefix_cache  | EngineConfig.enable_prefix_caching        |
| setting.batch_scheduler.preempt_mode              | EngineConfig.preempt_mode                 |
| setting.batch_scheduler.enable_mtp_module or      | EngineConfig.num_speculative_tokens       |
|   enable_speculative_decoding (either on), with   |   (mtp_step_num, default 1, when enabled; |
|   mtp_step_num                                    |   0 when not)                             |
| setting.batch_scheduler.enable_async              | EngineConfig.async_scheduling             |
| setting.block_manager.block_token_num             | EngineConfig.block_token_num              |
| setting.block_manager.reserved_device_memory_ratio| EngineConfig.reserved_device_memory_ratio |
| setting.block_manager.block_device_memory_ratio   | EngineConfig.block_device_memory_ratio    |
|                                                   |   (< 0 -> None: "all that remains")       |
| setting.block_manager.block_host_memory_factor    | EngineConfig.block_host_memory_factor     |
| model_spec.base_model.model_dir                   | EngineConfig.model                        |
| model_spec.base_model.tokenizer_dir (or           | EngineConfig.tokenizer                    |
|   setting.tokenization.tokenizer_path)            |                                           |
| setting.connector.group_role                      | ServerSettings.kv_role (`serve --kv-role`; |
|                                                   |   "none" -> None)                         |
| setting.connector.task_expire_sec                 | ServerSettings.kv_transfer_ttl_s          |

KsanaLLM keys that change nothing here at the values given (`_INERT`: parallel layouts of 1,
telemetry, swap thresholds, `endpoint_type: python`, ...) are accepted and logged, so that
KsanaLLM's own example file loads; other values of them are refused.
"""

from __future__ import annotations

import logging
import math
import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml
from pydantic import ValidationError

from ksana_llm.config import KV_ROLES, EngineConfig, named_validation_error

__all__ = ["ServerSettings", "load_engine_config", "load_yaml_strictly", "parse_engine_config"]

logger = logging.getLogger("ksana_llm.config")

@dataclass(frozen=True)
class ServerSettings:
    """Settings from the YAML file that the server (not the engine core) acts on; everything
    else lands in `EngineConfig`.

    - `config_file`: the YAML path the settings came from (None for an in-memory mapping).
    - `kv_role`, `kv_transfer_ttl_s`: prefill/decode disaggregation (`serve --kv-role`,
      `--kv-transfer-ttl`); None when not set.
    """

    config_file: str | None = None
    kv_role: str | None = None
    kv_transfer_ttl_s: float | None = None


# ---- schema ----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class _Key:
    """One accepted YAML leaf: its expected type, and where its (converted) value lands."""

    kind: str  # "int" | "float" | "bool" | "str"
    field: str | None = None  # EngineConfig field
    server: str | None = None  # ServerSettings attribute (a key sets one or the other)
    convert: Callable[[Any], Any] | None = None  # YAML value -> EngineConfig value


def _zero_is_none(value: int) -> int | None:
    return None if value == 0 else value


def _negative_is_none(value: float) -> float | None:
    return None if value < 0 else value


def _expand_path(value: str) -> str:
    return os.path.expanduser(value)


def _positive_seconds(value: float) -> float:
    # Checked here, with the key's name, rather than once the model has loaded (build_app).
    if value <= 0:
        raise ValueError(f"setting.connector.task_expire_sec must be > 0, got {value!r}")
    return value


def _kv_role(value: str) -> str | None:
    if value == "none":
        return None
    if value not in KV_ROLES:
        raise ValueError(f"setting.connector.group_role must be none, {', '.join(KV_ROLES)}; "
                         f"got {value!r}")
    return value


def _weight_quant_method(value: str) -> str | None:
    methods = {"auto": None, "fp8_e4m3": "fp8", "fp8": "fp8", "w8a8_int8": "w8a8_int8"}
    if value not in methods:
        raise ValueError("setting.quantization_config.weight.quant_method must be auto, "
                         f"fp8_e4m3 or w8a8_int8, got {value!r}")
    return methods[value]


_BS = "setting.batch_scheduler."
_BM = "setting.block_manager."
_GCC = "setting.global_cache_connector."
_GPTQ_BACKEND = "setting.quantization_config.gptq_backend"
GPTQ_BACKENDS = ("cutlass", "marlin")
_SCHEMA: Mapping[str, _Key] = MappingProxyType({
    "setting.global.tensor_para_size": _Key("int", field="tensor_parallel_size"),
    "setting.global.pipeline_para_size": _Key("int", field="pipeline_parallel_size"),
    "setting.global.enable_cuda_graph": _Key("bool", field="enable_cuda_graphs"),
    _BS + "max_batch_size": _Key("int", field="max_num_seqs"),
    _BS + "max_step_tokens": _Key("int", field="max_step_tokens"),
    _BS + "max_token_len": _Key("int", field="max_model_len", convert=_zero_is_none),
    _BS + "max_waiting_queue_len": _Key("int", field="max_queue_size"),
    _BS + "waiting_timeout_in_ms": _Key("int", field="waiting_timeout_ms"),
    _BS + "split_fuse_token_num": _Key("int", field="split_fuse_token_num"),
    _BS + "enable_auto_prefix_cache": _Key("bool", field="enable_prefix_caching"),
    _BS + "preempt_mode": _Key("int", field="preempt_mode"),
    # Both set num_speculative_tokens together (see `_speculative_tokens`).
    _BS + "enable_speculative_decoding": _Key("bool"),
    _BS + "enable_mtp_module": _Key("bool"),
    _BS + "mtp_step_num": _Key("int"),
    _BS + "enable_async": _Key("bool", field="async_scheduling"),
    _BM + "block_token_num": _Key("int", field="block_token_num"),
    _BM + "reserved_device_memory_ratio": _Key("float", field="reserved_device_memory_ratio"),
    _BM + "block_device_memory_ratio": _Key("float", field="block_device_memory_ratio",
                                            convert=_negative_is_none),
    _BM + "block_host_memory_factor": _Key("float", field="block_host_memory_factor"),
    "model_spec.base_model.model_dir": _Key("str", field="model", convert=_expand_path),
    # A tokenizer other than the model's: KsanaLLM reads either key (both must then agree).
    "model_spec.base_model.tokenizer_dir": _Key("str", field="tokenizer", convert=_expand_path),
    "setting.tokenization.tokenizer_path": _Key("str", field="tokenizer", convert=_expand_path),
    # Prefill/decode disaggregation: the server's role; how long kept KV waits to be fetched.
    "setting.connector.group_role": _Key("str", server="kv_role", convert=_kv_role),
    "setting.connector.task_expire_sec": _Key("float", server="kv_transfer_ttl_s",
                                              convert=_positive_seconds),
    # auto, fp8_e5m2 or fp8_e4m3 (KsanaLLM's values; vLLM's "fp8" is accepted too).
    "setting.quantization_config.kv_cache.dtype": _Key("str", field="kv_cache_dtype"),
    # auto (the checkpoint's weights as they are) or fp8_e4m3 (online FP8 weights).
    "setting.quantization_config.weight.quant_method": _Key("str", field="quantization",
                                                            convert=_weight_quant_method),
    # KsanaLLM's GPTQ / AWQ kernel (cutlass or marlin): checked, and changes nothing here, where
    # GPTQ / AWQ weights are held as their packed 4-bit or int8 codes on one path.
    _GPTQ_BACKEND: _Key("str"),
})

def _equals(*neutral: Any) -> Callable[[Any], bool]:
    # Type-exact: YAML's true is no 1, and 1.0 no 1.
    return lambda value: any(type(value) is type(n) and value == n for n in neutral)


def _any_of(*kinds: type) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, kinds) and not (bool not in kinds
                                                           and isinstance(value, bool))


# KsanaLLM keys that change nothing here at the values given: accepted (and logged), so that
# KsanaLLM's own example file loads. key -> (accepted values, what they are, for the error).
# Values that would change behaviour are refused as unsupported.
_INERT: Mapping[str, tuple[Callable[[Any], bool], str]] = MappingProxyType({
    "setting.global.attn_data_para_size": (_equals(1), "1"),
    "setting.global.expert_world_size": (_equals(1), "1"),
    "setting.global.expert_para_size": (_equals(1), "1"),
    "setting.global.enable_full_shared_expert": (_equals(False), "false"),
    "setting.global.enable_lora_adapter": (_equals(False), "false (use --lora-modules)"),
    # Where tensors live or how ranks talk: never what is computed.
    "setting.global.embed_tokens_use_cpu": (_any_of(bool), "true or false"),
    "setting.global.pipeline_para_comm_type": (_equals("default", "scatter"), "default or scatter"),
    "setting.global.is_version_report": (_any_of(bool), "true or false"),
    _BS + "schedule_strategy": (_equals(0), "0 (continuous batching)"),
    # 1 is the event-driven scheduler KsanaLLM's Global Cache (Mooncake) needs.
    _BS + "scheduler_type": (_equals(0), "0 (the default scheduler)"),
    # Global Cache: an empty service_endpoint leaves the connector off (KsanaLLM's rule); the
    # other keys then configure nothing.
    _GCC + "service_endpoint": (_equals(""), '"" (the Global Cache connector off)'),
    _GCC + "master_server_addr": (_any_of(str), "a string"),
    _GCC + "backend_type": (_any_of(str), "a string"),
    _GCC + "protocol": (_any_of(str), "a string"),
    _GCC + "rdma_devices": (_any_of(str), "a string"),
    # Swap and admission thresholds: this scheduler's own rule decides when to swap and admit.
    _BS + "swapout_block_threshold": (_any_of(int, float), "a number"),
    _BS + "swapin_block_threshold": (_any_of(int, float), "a number"),
    _BS + "launch_block_threshold": (_any_of(int, float), "a number"),
    _BS + "swap_threadpool_size": (_any_of(int), "an integer"),
    _BS + "min_flexible_cache_num": (_equals(0), "0 (no flexible cache)"),
    # Structured output is served whenever xgrammar is installed.
    _BS + "enable_xgrammar": (_any_of(bool), "true or false"),
    _BS + "max_pp_batch_num": (_equals(1), "1"),
    _BS + "pp_multibatch_wb_strategy": (_equals(0), "0"),
    _BS + "max_pretransfer_batch_size": (_any_of(int), "an integer"),
    _BS + "transfer_layer_chunk_size": (_any_of(int), "an integer"),
    _BS + "attention_dp_lb_config.enable_balance": (_equals(False), "false"),
    # (its other keys tune a balancing that is off)
    _BS + "attention_dp_lb_config.min_qps_for_waiting": (_any_of(int, float), "a number"),
    _BS + "attention_dp_lb_config.max_waiting_steps": (_any_of(int), "an integer"),
    _BS + "attention_dp_lb_config.max_waiting_time_in_ms": (_any_of(int, float), "a number"),
    _BM + "dynamic_reusable_memory_ratio": (_any_of(int, float), "a number"),
    _BM + "enable_block_checksum": (_equals(False), "false"),
    "setting.attn_backend.enable_blocked_multi_token_forwarding_kv": (_equals(False), "false"),
    "setting.attn_backend.flash_attn_impl": (_any_of(str), "a kernel name"),
    "setting.attn_backend.use_flashinfer_for_decode": (_equals(False), "false"),
    # pcg's LoRA memory pools ([sic]): adapters are sized by num_lora_slots / max_cpu_loras here.
    _BM + "lora_deivce_memory_ratio": (_any_of(int, float), "a number"),
    _BM + "lora_host_memory_factor": (_any_of(int, float), "a number"),
    "setting.endpoint_type": (_equals("python"), "python (this HTTP server)"),
    "setting.tokenization.add_special_tokens": (_equals(True), "true"),
    "setting.tokenization.skip_special_tokens": (_equals(True), "true"),
})
# Whole sections that change nothing here, whatever they hold: telemetry export, the plugin
# models' TensorRT switch and threads (plugins run on torch here), the performance runner.
_INERT_SECTIONS: tuple[str, ...] = (
    "setting.profiler", "model_spec.plugin_model", "model_performance_runner_config",
    "model_spec.model_performance_runner_config")
_INERT_PARENTS: frozenset[str] = frozenset(
    key.rsplit(".", i)[0] for key in _INERT for i in range(1, key.count(".") + 1))

# KsanaLLM keys (and whole sections) that exist upstream but mean nothing here yet: they get a more
# helpful error than "unknown key", because the user did not make a typo.
_UNSUPPORTED: frozenset[str] = frozenset({
    "setting.kernel_config",
    # The connector's transport and cluster keys: our servers talk HTTP, a router routes.
    *("setting.connector." + key for key in (
        "backend", "router_addr", "inference_addr", "coordinator_addr", "cluster_name",
        "heartbeat_interval_ms", "transfer_batch", "connector_waiting_sec",
        "circular_bucket_size", "circular_bucket_num", "circular_thread_num", "send_thread_num",
        "communication_type", "redis_password", "metadata_addr")),
    "model_spec.lora_models",
})

# Every proper prefix of an accepted key is a section that must be a mapping.
_SECTIONS: frozenset[str] = frozenset(
    key.rsplit(".", i)[0] for key in _SCHEMA for i in range(1, key.count(".") + 1))


# ---- reading ---------------------------------------------------------------------------------------

class _StrictLoader(yaml.SafeLoader):
    """SafeLoader that refuses duplicate keys: PyYAML would silently keep the last one."""


def _construct_mapping(loader: _StrictLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark)
        seen.add(key)
    return loader.construct_mapping(node, deep=deep)


_StrictLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_mapping)


def load_yaml_strictly(text: str) -> Any:
    """`yaml.safe_load`, but a key given twice in one mapping is a yaml.YAMLError (PyYAML
    would keep the last one silently)."""
    return yaml.load(text, Loader=_StrictLoader)  # noqa: S506 - a SafeLoader subclass


def _read_yaml(path: Path) -> Any:
    try:
        return load_yaml_strictly(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8 text: {exc}") from exc
    except yaml.YAMLError as exc:
        raise ValueError(f"{path}: invalid YAML: {exc}") from exc


def _flatten(node: Any, prefix: str, out: dict[str, Any], inert: list[str],
             errors: list[str]) -> None:
    """Collect accepted leaves as dotted keys, and in `inert` the keys that change nothing here;
    in `errors`, what is wrong with each key unknown or misplaced (all of them, so that one
    run names every key to mend)."""
    for key, value in node.items():
        if not isinstance(key, str):
            errors.append(f"{prefix}{key!r}: keys must be strings")
            continue
        dotted = prefix + key
        if dotted in _INERT:
            accepts, neutral = _INERT[dotted]
            if not accepts(value):
                errors.append(f"{dotted}: a KsanaLLM key that ksana_llm does not support yet "
                              f"at {value!r} (accepted: {neutral}, which changes nothing here)")
            else:
                inert.append(dotted)
            continue
        if any(dotted == s or dotted.startswith(s + ".") for s in _INERT_SECTIONS):
            inert.append(dotted)
            continue
        if dotted in _INERT_PARENTS and dotted not in _SECTIONS:
            if value is not None:
                if not isinstance(value, Mapping):
                    errors.append(f"{dotted}: expected a mapping of keys, got {value!r}")
                else:
                    _flatten(value, dotted + ".", out, inert, errors)
            continue
        if any(dotted == u or dotted.startswith(u + ".") for u in _UNSUPPORTED):
            errors.append(f"{dotted}: a KsanaLLM key that ksana_llm does not support yet; "
                          "remove it")
            continue
        if dotted in _SCHEMA:
            out[dotted] = value
        elif dotted in _SECTIONS:
            if value is None:  # a section with every key commented out
                continue
            if not isinstance(value, Mapping):
                errors.append(f"{dotted}: expected a mapping of keys, got {value!r}")
            else:
                _flatten(value, dotted + ".", out, inert, errors)
        else:
            errors.append(f"{dotted}: unknown key")


def _check_type(dotted: str, kind: str, value: Any) -> Any:
    """YAML already typed the scalar; accept it only if it is the kind the key needs."""
    if kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise ValueError(f"{dotted}: expected an integer, got {value!r}")
    elif kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
            raise ValueError(f"{dotted}: expected a number, got {value!r}")
        value = float(value)
    elif kind == "bool":
        if not isinstance(value, bool):
            raise ValueError(f"{dotted}: expected true or false, got {value!r}")
    elif kind == "str":
        if not isinstance(value, str) or not value:
            raise ValueError(f"{dotted}: expected a non-empty string, got {value!r}")
    return value


def parse_engine_config(data: Mapping[str, Any] | None, overrides: Mapping[str, Any] | None = None,
                        *, config_file: str | None = None,
                        override_names: Mapping[str, str] | None = None
                        ) -> tuple[EngineConfig, ServerSettings]:
    """Like `load_engine_config`, for an already-parsed YAML mapping (None = empty file)."""
    if data is None:
        data = {}
    if not isinstance(data, Mapping):
        raise ValueError(f"the top level must be a mapping of keys, got {type(data).__name__}")
    leaves: dict[str, Any] = {}
    inert: list[str] = []
    errors: list[str] = []
    _flatten(data, "", leaves, inert, errors)
    for dotted, raw in leaves.items():
        try:
            leaves[dotted] = _check_type(dotted, _SCHEMA[dotted].kind, raw)
        except ValueError as exc:
            errors.append(str(exc))
    if errors:
        raise ValueError("\n".join(errors))
    if inert:
        logger.warning("%s: KsanaLLM keys that change nothing here, accepted: %s",
                    config_file or "config", ", ".join(inert))

    fields: dict[str, Any] = {}
    sources: dict[str, str] = {}  # EngineConfig field -> the YAML key that set it
    server: dict[str, Any] = {"config_file": config_file}
    for dotted, value in leaves.items():  # (type-checked above)
        spec = _SCHEMA[dotted]
        value = spec.convert(value) if spec.convert else value
        if spec.server is not None:
            server[spec.server] = value
        if spec.field is not None:
            if spec.field in fields and fields[spec.field] != value:  # two keys, one setting
                raise ValueError(f"{sources[spec.field]} ({fields[spec.field]!r}) and {dotted} "
                                 f"({value!r}) set the same thing differently; give one")
            fields[spec.field] = value
            sources[spec.field] = dotted

    if leaves.get(_GPTQ_BACKEND, GPTQ_BACKENDS[0]) not in GPTQ_BACKENDS:
        raise ValueError(f"{_GPTQ_BACKEND} must be {' or '.join(GPTQ_BACKENDS)}, got "
                         f"{leaves[_GPTQ_BACKEND]!r}")
    # MTP drafting: KsanaLLM's enable_mtp_module or its enable_speculative_decoding (its example
    # file carries both, false) with mtp_step_num drafts per step: either one on turns it on.
    switches = [k for k in (_BS + "enable_mtp_module", _BS + "enable_speculative_decoding")
                if k in leaves]
    if switches:
        enabled = any(leaves[k] for k in switches)
        steps = _check_type(_BS + "mtp_step_num", "int", leaves.get(_BS + "mtp_step_num", 1))
        fields["num_speculative_tokens"] = steps if enabled else 0
        # The key an error about it should name: the step count if the file gives one, else
        # the switch that turned drafting on (the user never wrote mtp_step_num).
        sources["num_speculative_tokens"] = (
            _BS + "mtp_step_num" if _BS + "mtp_step_num" in leaves
            else next((k for k in switches if leaves[k]), switches[0]))
    for name, value in (overrides or {}).items():
        if value is None:  # a CLI flag that was not given
            continue
        fields[name] = value
        sources[name] = (override_names or {}).get(name, f"{name} (override)")
    if sources.get("max_model_len") == _BS + "max_token_len" and fields["max_model_len"]:
        # KsanaLLM lowers it to the model's context (a --max-model-len flag is refused past it).
        fields["clamp_max_model_len"] = True
    try:
        config = EngineConfig(**fields)
    except ValidationError as exc:
        raise named_validation_error(exc, sources) from None
    return config, ServerSettings(**server)


def load_engine_config(path: str | os.PathLike[str], overrides: Mapping[str, Any] | None = None,
                       *, override_names: Mapping[str, str] | None = None
                       ) -> tuple[EngineConfig, ServerSettings]:
    """Read a KsanaLLM-style YAML file and return `(EngineConfig, ServerSettings)`.

    `overrides` are CLI flags in `EngineConfig` field names; they win over the file. A value of
    None means "flag not given" and is skipped. `override_names` (field -> flag) names them in
    errors. Raises `ValueError` naming the dotted key for an
    unknown or unsupported key, an ill-typed value, or a value `EngineConfig` rejects;
    `FileNotFoundError` if the file is missing.
    """
    path = Path(path)
    return parse_engine_config(_read_yaml(path), overrides, config_file=str(path),
                               override_names=override_names)
