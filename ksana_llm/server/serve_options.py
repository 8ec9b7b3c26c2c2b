"""The options `build_app` takes from the flags `serve` and `run-batch` share: how outputs are
parsed (tool calls, reasoning, logprob caps), the model's sampling defaults, and the request
options (logging, template kwargs, usage). Each is checked before the model loads where it can
be, so a typo fails at once."""

from __future__ import annotations

import argparse
import logging
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

from ksana_llm.api.engine import Engine
from ksana_llm.server import metrics
from ksana_llm.server.reasoning_parsers import get_reasoning_parser
from ksana_llm.server.request_log import RequestLog
from ksana_llm.server.sampling_defaults import (NO_MODEL_DEFAULTS, SamplingDefaults,
                                               load_sampling_defaults)
from ksana_llm.server.tool_parsers import TOOL_PARSERS, ToolParser, get_tool_parser
from ksana_llm.server.tool_parsers.plugin import load_tool_parser_plugin

logger = logging.getLogger("ksana_llm.server")


@dataclass(frozen=True)
class OutputParsing:
    """How outputs are read and shown: `--tool-call-parser`, `--enable-auto-tool-choice`,
    `--reasoning-parser`, the `--max-logprobs` cap and `--return-tokens-as-token-ids`."""

    tool_call_parser: str | None = None
    enable_auto_tool_choice: bool = False
    # The parsers a --tool-parser-plugin file defines (`load_tool_parser_plugin`), by name.
    plugin_tool_parsers: Mapping[str, type[ToolParser]] = field(
        default_factory=lambda: MappingProxyType({}))
    reasoning_parser: str | None = None
    max_logprobs: int | None = None  # None: the engine's max_logprobs; -1: no cap
    return_tokens_as_token_ids: bool = False  # every request's logprob tokens as token_id:<id>

    def check(self) -> None:
        """ValueError for a bad combination or an unknown parser (listing the known names);
        run before the model loads so that a typo fails at once."""
        if self.tool_call_parser is not None:
            self.tool_parser()
        if self.enable_auto_tool_choice and self.tool_call_parser is None:
            known = {**TOOL_PARSERS, **self.plugin_tool_parsers}
            raise ValueError("--enable-auto-tool-choice needs --tool-call-parser "
                             f"(one of: {', '.join(sorted(known))})")
        if self.reasoning_parser is not None:
            get_reasoning_parser(self.reasoning_parser)
        if self.max_logprobs is not None and self.max_logprobs < -1:
            raise ValueError("--max-logprobs must be >= 0, or -1 for no cap, got "
                             f"{self.max_logprobs}")

    def tool_parser(self) -> ToolParser | None:
        """The --tool-call-parser (built-in or from the plugin file), or None."""
        if self.tool_call_parser is None:
            return None
        return get_tool_parser(self.tool_call_parser, self.plugin_tool_parsers)


def check_tokenizer(engine: Engine, parsing: OutputParsing, chat_template: str | None) -> None:
    """A server without a tokenizer only with --skip-tokenizer-init, and then none of the
    settings that read or write text (parsers, a chat template): ValueError otherwise."""
    if engine.tokenizer is not None:
        return
    if not engine.config.skip_tokenizer_init:
        raise ValueError("the OpenAI server needs a tokenizer, and this model folder has none: "
                         "give one (--tokenizer), or serve token ids only "
                         "(--skip-tokenizer-init)")
    for flag, value in (("--tool-call-parser", parsing.tool_call_parser),
                        ("--reasoning-parser", parsing.reasoning_parser),
                        ("--chat-template", chat_template)):
        if value is not None:
            raise ValueError(f"{flag} works on text: not with --skip-tokenizer-init")


def output_parsing_from_args(args: argparse.Namespace) -> OutputParsing:
    plugin = getattr(args, "tool_parser_plugin", None)
    return OutputParsing(tool_call_parser=getattr(args, "tool_call_parser", None),
                         enable_auto_tool_choice=bool(getattr(args, "enable_auto_tool_choice", False)),
                         plugin_tool_parsers=(load_tool_parser_plugin(plugin, TOOL_PARSERS)
                                              if plugin is not None else MappingProxyType({})),
                         reasoning_parser=getattr(args, "reasoning_parser", None),
                         max_logprobs=getattr(args, "max_logprobs", None),
                         return_tokens_as_token_ids=bool(
                             getattr(args, "return_tokens_as_token_ids", False)))



def sampling_defaults_from_args(args: argparse.Namespace, model_dir: Any) -> SamplingDefaults:
    """--generation-config / --override-generation-config, read for the loaded model."""
    defaults = load_sampling_defaults(getattr(args, "generation_config", None) or "auto",
                                      model_dir, getattr(args, "override_generation_config", None))
    if defaults.summary():
        logger.warning("Requests that leave them out get the model's sampling defaults "
                       "(--generation-config vllm leaves them out): %s", defaults.summary())
    return defaults


def check_sampling_defaults_args(args: argparse.Namespace) -> None:
    """What of --generation-config / --override-generation-config can be checked without the
    model: a folder named outright, and the overrides' values. ("auto" reads the model's own
    folder, which is known only once it is found.)"""
    source = getattr(args, "generation_config", None) or "auto"
    load_sampling_defaults(NO_MODEL_DEFAULTS if source == "auto" else source, None,
                           getattr(args, "override_generation_config", None))


def request_options_from_args(args: argparse.Namespace) -> dict[str, Any]:
    """build_app's request options from the flags serve and run-batch share:
    --enable-prompt-embeds, --enable-log-requests / --enable-log-outputs / --max-log-len,
    --default-chat-template-kwargs, --enable-force-include-usage,
    --exclude-tools-when-tool-choice-none,
    --chat-template-content-format and --response-role."""
    log = bool(getattr(args, "enable_log_requests", False))
    log_outputs = bool(getattr(args, "enable_log_outputs", False))
    return {"enable_prompt_embeds": bool(getattr(args, "enable_prompt_embeds", False)),
            "request_log": RequestLog(args.max_log_len, requests=log, outputs=log_outputs).enable()
            if log or log_outputs else None,
            "default_chat_template_kwargs": getattr(args, "default_chat_template_kwargs", None),
            "force_include_usage": bool(getattr(args, "enable_force_include_usage", False)),
            "exclude_tools_when_tool_choice_none": bool(
                getattr(args, "exclude_tools_when_tool_choice_none", False)),
            "chat_template_content_format": getattr(args, "chat_template_content_format", "auto"),
            "response_role": getattr(args, "response_role", "assistant"),
            "metrics_prefix": getattr(args, "metrics_prefix", metrics.DEFAULT_PREFIX)}
