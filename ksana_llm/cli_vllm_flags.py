"""vLLM flags that change nothing here, taken so that a vLLM command line runs as it is, each
with a warning that says why (and `--trust-remote-code`, which does, taken by the same commands);
and vLLM's --runner / --convert / --task, which switch nothing either but are checked against
the model once it loads."""

from __future__ import annotations

import argparse
import json
import logging
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
                                         "parallelism")):
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
             ("auto", "xgrammar"))):
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
