"""vLLM flags that change nothing here, taken so that a vLLM command line runs as it is, each
with a warning that says why (and `--trust-remote-code`, which does, taken by the same commands);
and vLLM's --runner / --convert / --task, which switch nothing either but are checked against
the model once it loads."""

from __future__ import annotations

import argparse
import json
import logging
from dataclasses import dataclass
from typing import Any


class _FlagWithoutEffect(argparse.Action):
    """A vLLM flag that means nothing here, taken (so a vLLM command line runs as it is) with a
    warning that says why. `takes_value`: a flag with a value (read and dropped); `allowed`: the
    values that mean nothing here (another one is refused: it would ask for what this engine
    does not do)."""

    def __init__(self, option_strings: list[str], dest: str, why: str,
                 takes_value: bool = False, allowed: tuple[str, ...] | None = None,
                 **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=None if takes_value else 0,
                         default=argparse.SUPPRESS, **kwargs)
        self.why = why
        self.allowed = allowed

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
        if self.allowed is not None and values not in self.allowed:
            parser.error(f"{option_string} {values}: not supported here ({self.why}); "
                         f"accepted: {', '.join(self.allowed)}")
        # Once per parser: a command line with `--config FILE` is parsed twice (cli.main).
        warned = parser.__dict__.setdefault("_ksana_flags_warned", set())
        if option_string in warned:
            return
        warned.add(option_string)
        logging.getLogger("ksana_llm.cli").warning("%s changes nothing: %s", option_string,
                                                    self.why)


def add_vllm_flags_without_effect(parser: argparse.ArgumentParser, *, serve: bool) -> None:
    # (Not without effect: vLLM's flag, grouped here so generate and serve both take it.)
    parser.add_argument("--trust-remote-code", action="store_true", default=None,
                        help="run the ksana_plugin.py a Hugging Face hub repository ships (its "
                             "own Python code; a local folder's plugin runs either way); "
                             "ksana-llm never imports a checkpoint's modelling code")
    if not serve:
        return
    for flag, why in (
            ("--disable-log-requests", "requests are logged only with --enable-log-requests"),
            ("--enable-chunked-prefill", "long prompts are always split across steps by the "
                                         "token budget (--max-num-batched-tokens)"),
            ("--enable-request-id-headers", "every response carries X-Request-Id already"),
            ("--enable-prompt-tokens-details", "usage always has prompt_tokens_details "
                                               "(cached_tokens)"),
            ("--enable-lora", "LoRA is on with --lora-modules or "
                              "--allow-runtime-lora-updating"),
            ("--enable-server-load-tracking", "GET /load always counts the requests being "
                                              "answered"),
            ("--disable-custom-all-reduce", "all-reduces are torch.distributed's (NCCL on "
                                            "GPUs, gloo on CPUs)"),
            ("--disable-frontend-multiprocessing", "the server and the engine share one "
                                                   "process (the engine steps on its own "
                                                   "thread)"),
            ("--disable-cascade-attn", "there is no cascade attention here"),
            ("--enable-expert-parallel", "MoE experts are split across ranks by tensor "
                                         "parallelism"),
            ("--enable-eplb", "MoE experts are split across ranks by tensor parallelism, "
                              "not placed by load"),
            ("--enable-reasoning", "--reasoning-parser alone turns reasoning output on")):
        parser.add_argument(flag, action=_FlagWithoutEffect, why=why,
                            help=f"accepted for vLLM's command lines: {why}")
    for flag, why, allowed in (
            ("--max-parallel-loading-workers", "the weights load in one pass", None),
            ("--max-seq-len-to-capture", "decode CUDA graphs serve every context length up to "
                                         "--max-model-len", None),
            ("--tokenizer-mode", "the tokenizer is the Hugging Face one the model folder (or "
                                 "--tokenizer) holds", ("auto", "hf")),
            ("--distributed-executor-backend", "the ranks are torch.distributed processes "
                                               "the server starts", ("mp", "uni")),
            ("--guided-decoding-backend", "structured output is xgrammar's",
             ("auto", "xgrammar")),
            ("--api-server-count", "one process serves the API (the engine steps on its own "
                                   "thread; --data-parallel-size starts more engines)", None),
            ("--limit-mm-per-prompt", "text models take no images or audio (a ksana_plugin.py "
                                      "decides its own inputs)", None),
            ("--model-impl", "the models are this engine's own modules",
             ("auto", "vllm")),
            ("--config-format", "config.json is read as Hugging Face writes it", ("auto", "hf")),
            ("--safetensors-load-strategy", "safetensors files are memory-mapped and read "
                                            "tensor by tensor", None),
            ("--code-revision", "no checkpoint modelling code is ever imported", None)):
        parser.add_argument(flag, action=_FlagWithoutEffect, why=why, takes_value=True,
                            allowed=allowed, metavar="VALUE",
                            help=f"accepted for vLLM's command lines: {why}"
                                 + (f" (values: {', '.join(allowed)})" if allowed else ""))
    why = ("structured output is xgrammar's (backend auto or xgrammar), JSON in one canonical "
           "layout, no properties a schema does not declare; with a reasoning parser it "
           "constrains the answer after the thinking (enable_in_reasoning true is refused)")
    parser.add_argument("--structured-outputs-config", action=_FlagWithoutEffect, why=why,
                        takes_value=True, type=structured_outputs_config, metavar="JSON",
                        help=f"accepted for vLLM's command lines: {why}")


# vLLM's StructuredOutputsConfig keys, and the values that describe this engine.
_STRUCTURED_OUTPUTS_KEYS = {"backend": ("auto", "xgrammar"), "disable_fallback": (True, False),
                            "disable_any_whitespace": (True, False),
                            "disable_additional_properties": (True, False),
                            "enable_in_reasoning": (False,), "reasoning_parser": None}


def structured_outputs_config(value: str) -> dict[str, Any]:
    """vLLM's `--structured-outputs-config` JSON, checked: what it asks must be what this
    engine does (xgrammar, the answer after the thinking); it changes no setting."""
    from ksana_llm.cli_types import json_object

    parsed = json_object(value)
    for key, given in parsed.items():
        if key not in _STRUCTURED_OUTPUTS_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}; known: {', '.join(_STRUCTURED_OUTPUTS_KEYS)}")
        allowed = _STRUCTURED_OUTPUTS_KEYS[key]
        if allowed is not None and given not in allowed:
            raise argparse.ArgumentTypeError(
                f"{key}: {given!r} is not supported here (accepted: "
                f"{', '.join(json.dumps(a) for a in allowed)})")
    return parsed


# vLLM's CompilationConfig keys. Its CUDA-graph ones set EngineConfig fields; the others are
# torch.compile's, and this engine compiles nothing (eager modules, Triton kernels, and CUDA
# graphs of whole decode steps), so they change nothing.
_CUDAGRAPH_MODES = ("NONE", "PIECEWISE", "FULL", "FULL_DECODE_ONLY", "FULL_AND_PIECEWISE")
_COMPILE_ONLY_KEYS = frozenset((
    "level", "mode", "backend", "custom_ops", "splitting_ops", "use_inductor", "compile_sizes",
    "inductor_compile_config", "inductor_passes", "cudagraph_num_of_warmups",
    "cudagraph_copy_inputs", "full_cuda_graph", "pass_config", "debug_dump_path", "cache_dir",
    "use_inductor_graph_partition", "cudagraph_specialize_lora", "compile_mm_encoder"))
_COMPILATION_KEYS = ("cudagraph_mode", "use_cudagraph", "cudagraph_capture_sizes",
                     "max_cudagraph_capture_size")


@dataclass(frozen=True)
class CompilationFlags:
    """What vLLM's `--compilation-config` / `-O` says here."""

    fields: dict[str, Any]  # EngineConfig fields its CUDA-graph keys set
    ignored: tuple[str, ...]  # its torch.compile keys (and level), which change nothing


def compilation_config(value: str) -> CompilationFlags:
    """vLLM's `--compilation-config`: an optimization level (0-3, as `-O3`), or a JSON object
    whose `cudagraph_mode` (NONE: no graphs; any other mode: this engine's whole-step decode
    graphs), `use_cudagraph`, `cudagraph_capture_sizes` and `max_cudagraph_capture_size` set
    the CUDA-graph settings, and whose torch.compile keys are taken without effect."""
    from ksana_llm.cli_types import json_object

    if value.strip().isdigit():
        parsed: dict[str, Any] = {"level": int(value)}
    else:
        parsed = json_object(value)
    fields: dict[str, Any] = {}
    for key, item in parsed.items():
        if key in ("level", "mode") and item not in (0, 1, 2, 3):
            raise argparse.ArgumentTypeError(f"{key} must be 0, 1, 2 or 3, got {item!r}")
        if key == "cudagraph_mode":
            mode = str(item).upper()
            if mode not in _CUDAGRAPH_MODES:
                raise argparse.ArgumentTypeError(
                    f"cudagraph_mode must be one of {', '.join(_CUDAGRAPH_MODES)}, got {item!r}")
            fields["enable_cuda_graphs"] = mode != "NONE"
        elif key == "use_cudagraph":
            if not isinstance(item, bool):
                raise argparse.ArgumentTypeError(
                    f"use_cudagraph must be true or false, got {item!r}")
            if fields.get("enable_cuda_graphs", item) != item:
                raise argparse.ArgumentTypeError("cudagraph_mode and use_cudagraph disagree")
            fields["enable_cuda_graphs"] = item
        elif key == "cudagraph_capture_sizes":
            if not isinstance(item, list) or not item or not all(
                    isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in item):
                raise argparse.ArgumentTypeError(
                    f"cudagraph_capture_sizes must be a list of positive integers, got {item!r}")
            fields["cuda_graph_sizes"] = sorted(set(item))
        elif key == "max_cudagraph_capture_size":
            if isinstance(item, bool) or not isinstance(item, int) or item < 1:
                raise argparse.ArgumentTypeError(
                    f"max_cudagraph_capture_size must be a positive integer, got {item!r}")
            fields["cuda_graph_max_batch_size"] = item
        elif key not in _COMPILE_ONLY_KEYS:
            raise argparse.ArgumentTypeError(
                f"unknown key {key!r}; known: {', '.join(_COMPILATION_KEYS)} (CUDA graphs) and "
                f"{', '.join(sorted(_COMPILE_ONLY_KEYS))} (torch.compile's: no effect here)")
    if "cuda_graph_sizes" in fields and "cuda_graph_max_batch_size" in fields:
        # vLLM caps the list by the largest size; EngineConfig takes one or the other.
        largest = fields.pop("cuda_graph_max_batch_size")
        fields["cuda_graph_sizes"] = [n for n in fields["cuda_graph_sizes"] if n <= largest] \
            or [largest]
    return CompilationFlags(fields, tuple(k for k in parsed if k in _COMPILE_ONLY_KEYS))


def add_model_task_args(parser: argparse.ArgumentParser) -> None:
    """vLLM's --runner / --convert / --task: checked against the model (server/model_tasks.py)."""
    from ksana_llm.server.model_tasks import CONVERTS, RUNNERS, TASKS

    parser.add_argument("--runner", choices=RUNNERS, default=None,
                        help="vLLM's: every API the model has is served; `generate` refuses "
                             "a classification model at start")
    parser.add_argument("--convert", choices=CONVERTS, default=None,
                        help="vLLM's: `classify` refuses a model without a classification head "
                             "at start (nothing is converted; see --hf-overrides "
                             "classifier_from_token)")
    parser.add_argument("--task", choices=TASKS, default=None,
                        help="vLLM's older form of --runner / --convert, checked the same way")
