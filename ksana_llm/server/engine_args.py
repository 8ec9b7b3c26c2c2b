"""The server's engine settings from the command line: `serve` / `run-batch` flags (and a
KsanaLLM YAML config) into an EngineConfig, the model to load, the served name and the KV
transfer role. No FastAPI here: the parsing is checked before any model loads."""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from ksana_llm import yaml_config
from ksana_llm.loader.hub import names_a_hub_repo

logger = logging.getLogger("ksana_llm.server")


def default_served_model_name(model: str | None) -> str:
    if model is None:
        from ksana_llm.loader.default_model import DEFAULT_MODEL_FILENAME

        return DEFAULT_MODEL_FILENAME.split(".")[0]  # SmolLM2-135M-Instruct
    path = Path(model.rstrip("/"))
    if names_a_hub_repo(model):
        return model  # a hub id, as vLLM names it: "Qwen/Qwen3-0.6B"
    return path.stem if path.suffix == ".gguf" else path.name


# CLI flag -> EngineConfig field, applied only when given (so a YAML file keeps the rest).
ENGINE_FLAGS = ("tokenizer", "skip_tokenizer_init", "trust_remote_code", "device", "dtype", "quantization", "num_device_blocks", "block_token_num", "max_num_seqs",
                "max_step_tokens", "split_fuse_token_num", "block_device_memory_ratio",
                "reserved_device_memory_ratio", "block_host_memory_factor", "swap_space",
                "enable_prefix_caching", "preempt_mode", "waiting_timeout_ms",
                "cuda_graph_max_batch_size", "cuda_graph_sizes", "attention_backend",
                "scheduler_policy",
                "max_queue_size", "max_model_len", "seed",
                "tensor_parallel_size", "pipeline_parallel_size", "enable_cuda_graphs",
                "async_scheduling", "overlap_output_processing", "num_speculative_tokens",
                "speculative_method", "speculative_disable_by_batch_size", "prompt_lookup_min",
                "prompt_lookup_max", "kv_cache_dtype", "lora_modules", "max_loras",
                "max_cpu_loras", "max_lora_rank", "lora_max_wait_steps", "hf_overrides",
                "enable_sleep_mode", "logits_processors", "kv_cache_memory_bytes",
                "logprobs_mode", "load_format", "disable_sliding_window", "revision",
                "download_dir", "reasoning_config", "profiler_config", "max_logprobs",
                "tokenizer_revision", "hf_token")


def model_from_args(args: argparse.Namespace) -> str | None:
    """`serve MODEL` (vLLM's positional form) or `--model`; both only when they agree."""
    positional = getattr(args, "model_tag", None)
    if positional is not None and args.model is not None \
            and _same_path(positional) != _same_path(args.model):
        raise ValueError(f"the model is given twice, as {positional} and as --model "
                         f"{args.model}; give one")
    names = getattr(args, "served_model_name", None) or []
    if hasattr(args, "model_tag") and positional is None and args.model is None \
            and len(names) > 1 and os.path.exists(names[-1]):
        # `serve --served-model-name foo /models/x`: the name list swallowed the model.
        raise ValueError(f"--served-model-name took {names[-1]} as a name, but it is a path: "
                         "give the model first (serve MODEL --served-model-name NAME) or as "
                         "--model")
    return positional if positional is not None else args.model


def _same_path(path: str) -> str:
    return os.path.abspath(os.path.expanduser(path))


def reasoning_config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--reasoning-config`, else the tags of `--reasoning-parser`'s thinking block (vLLM's
    default too). With both, the parser's end tag is what ends the block when the model writes
    it, so the config's end string may lead into the tag with a phrase."""
    given = getattr(args, "reasoning_config", None)
    derived = None
    name = getattr(args, "reasoning_parser", None)
    if name is not None and not getattr(args, "skip_tokenizer_init", False):
        # (Without a tokenizer, the parser is refused with the settings that read text.)
        from ksana_llm.server.reasoning_parsers import get_reasoning_parser

        try:
            derived = get_reasoning_parser(name).reasoning_config()
        except ValueError:
            derived = None  # an unknown name: refused with the other parsing flags
    if given is None:
        return derived
    if derived is not None and "reasoning_end_tag" not in given:
        return {**given, "reasoning_end_tag": derived.get("reasoning_end_tag")
                or derived["reasoning_end_str"]}
    return given


def profiler_config_from_args(args: argparse.Namespace) -> dict[str, Any] | None:
    """`--profiler-config`, else (as older vLLM) a torch profiler writing to
    $VLLM_TORCH_PROFILER_DIR when that is set."""
    given = getattr(args, "profiler_config", None)
    if given is not None:
        return given
    directory = os.environ.get("VLLM_TORCH_PROFILER_DIR")
    return {"torch_profiler_dir": directory} if directory else None


def configs_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(EngineConfig, the YAML's ServerSettings or None) from --config_file (when given) with the
    engine flags given on top."""
    from ksana_llm.config import EngineConfig, named_validation_error

    overrides: dict[str, Any] = {name: getattr(args, name, None) for name in ENGINE_FLAGS}
    overrides["model"] = model_from_args(args)
    overrides["reasoning_config"] = reasoning_config_from_args(args)
    overrides["profiler_config"] = profiler_config_from_args(args)
    flags = {name: _flag_of(name) for name in overrides}
    compilation = getattr(args, "compilation_config", None)
    if compilation is not None and compilation.ignored:
        logger.warning("--compilation-config %s changes nothing: this engine compiles nothing "
                       "(eager modules, Triton kernels, CUDA graphs of decode steps)",
                       ", ".join(compilation.ignored))
    for flag, fields in (("--speculative-config", getattr(args, "speculative_config", None)),
                         ("--compilation-config",
                          compilation.fields if compilation is not None else None)):
        for name, value in (fields or {}).items():
            if overrides[name] is not None and overrides[name] != value:
                raise ValueError(f"{flag} sets {name} to {value!r} and "
                                 f"{flags[name]} to {overrides[name]!r}; give one")
            overrides[name], flags[name] = value, flag
    if overrides["lora_modules"] is not None:
        names = [name for name, _ in overrides["lora_modules"]]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-modules names each adapter once, got {names}")
        overrides["lora_modules"] = dict(overrides["lora_modules"])
    if (getattr(args, "allow_runtime_lora_updating", False) and overrides["max_loras"] is None
            and not overrides["lora_modules"]):
        # Adapters loaded later need a slot (vLLM's max_loras is 1 by default, too).
        overrides["max_loras"], flags["max_loras"] = 1, "--allow-runtime-lora-updating"
    if args.config_file is not None:
        # Everything the engine acts on (including max_token_len and waiting_timeout_in_ms) is
        # in the EngineConfig; the ServerSettings add what only the server does (KV transfer).
        return yaml_config.load_engine_config(args.config_file, overrides, override_names=flags)
    given = {k: v for k, v in overrides.items() if v is not None}
    try:
        return EngineConfig(**given), None
    except ValidationError as exc:
        raise named_validation_error(exc, {name: flags[name] for name in given}) from None


# Engine settings whose command-line flag is not the field's name with dashes.
_FLAGS = MappingProxyType({"block_device_memory_ratio": "--gpu-memory-utilization",
                           "preempt_mode": "--preemption-mode",
                           "scheduler_policy": "--scheduling-policy",
                           "max_step_tokens": "--max-num-batched-tokens"})


def _flag_of(field: str) -> str:
    return _FLAGS.get(field, "--" + field.replace("_", "-"))


# vLLM's KVTransferConfig roles -> ours.
_VLLM_KV_ROLES = MappingProxyType({"kv_producer": "prefill", "kv_consumer": "decode",
                                   "kv_both": "both"})
# KVTransferConfig keys that only tune vLLM's connectors' own transports (buffers, addresses,
# ranks): accepted, as the KV moves over this server's HTTP transfer instead.
_VLLM_TRANSPORT_KEYS = frozenset({
    "kv_connector", "engine_id", "kv_buffer_device", "kv_buffer_size", "kv_rank",
    "kv_parallel_size", "kv_ip", "kv_port", "kv_connector_extra_config",
    "kv_connector_module_path", "kv_load_failure_policy", "enable_permute_local_kv"})


def kv_role_from_vllm_config(config: dict[str, Any]) -> str:
    """vLLM's `--kv-transfer-config` as our KV role; ValueError naming the flag otherwise."""
    unknown = sorted(set(config) - _VLLM_TRANSPORT_KEYS - {"kv_role"})
    if unknown:
        raise ValueError(f"--kv-transfer-config: unknown key(s) {', '.join(unknown)} (vLLM's "
                         "KVTransferConfig keys are accepted)")
    role = config.get("kv_role")
    if role not in _VLLM_KV_ROLES:
        raise ValueError(f"--kv-transfer-config: kv_role must be one of "
                         f"{', '.join(_VLLM_KV_ROLES)}, got {role!r}")
    if "kv_connector" in config:
        logger.info("--kv-transfer-config: KV moves over ksana-llm's HTTP transfer (kv_connector "
                    "%r's transport settings are not used)", config["kv_connector"])
    return _VLLM_KV_ROLES[role]


def kv_transfer_from_args(args: argparse.Namespace, settings: Any) -> tuple[str | None, float | None]:
    """(--kv-role, --kv-transfer-ttl), each from the YAML's connector section when not given
    (--kv-role none: no role, whatever the YAML says). vLLM's --kv-transfer-config gives the
    role too; it must agree with --kv-role when both are given."""
    kv_role = getattr(args, "kv_role", None)
    vllm_config = getattr(args, "kv_transfer_config", None)
    if vllm_config is not None:
        vllm_role = kv_role_from_vllm_config(vllm_config)
        if kv_role is not None and kv_role != vllm_role:
            raise ValueError(f"--kv-role {kv_role} and --kv-transfer-config's kv_role "
                             f"{vllm_config['kv_role']} (= {vllm_role}) disagree; give one")
        kv_role = vllm_role
    kv_role = kv_role or (settings.kv_role if settings else None)
    if kv_role == "none":
        kv_role = None
    kv_ttl = getattr(args, "kv_transfer_ttl", None)
    if kv_ttl is None and settings is not None and kv_role is not None:
        kv_ttl = settings.kv_transfer_ttl_s  # (meaningless, and ignored, without a role)
    return kv_role, kv_ttl
