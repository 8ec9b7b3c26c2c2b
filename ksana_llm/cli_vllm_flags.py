"""vLLM flags that change nothing here, taken so that a vLLM command line runs as it is, each
with a warning that says why (and `--trust-remote-code`, which does, taken by the same commands);
and vLLM's --runner / --convert / --task, which switch nothing either but are checked against
the model once it loads."""

from __future__ import annotations

import argparse
import logging
from typing import Any


class _FlagWithoutEffect(argparse.Action):
    """A vLLM flag that means nothing here, taken (so a vLLM command line runs as it is) with a
    warning that says why."""

    def __init__(self, option_strings: list[str], dest: str, why: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS, **kwargs)
        self.why = why

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Any, option_string: str | None = None) -> None:
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
                                              "answered")):
        parser.add_argument(flag, action=_FlagWithoutEffect, why=why,
                            help=f"accepted for vLLM's command lines: {why}")



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
