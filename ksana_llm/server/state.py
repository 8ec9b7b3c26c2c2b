"""What the routes share, built once by `build_app` and kept in `app.state.server`."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from ksana_llm.api.engine import Engine
from ksana_llm.api.forward_outputs import ForwardOutput
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server.chat import ChatTemplate
from ksana_llm.server.errors import engine_unavailable, model_not_found, no_tokenizer
from ksana_llm.server.event_log import EventLog
from ksana_llm.server.logprobs import TokenIdTexts, TokenTexts
from ksana_llm.server.middleware import ServerLoad
from ksana_llm.server.openai_protocol import MAX_LOGPROBS
from ksana_llm.server.params import ModelLimits
from ksana_llm.server.reasoning_parsers import ReasoningParser
from ksana_llm.server.request_log import RequestLog
from ksana_llm.server.responses_store import ResponseStore
from ksana_llm.server.sampling_defaults import SamplingDefaults
from ksana_llm.server.tool_parsers import ToolParser


@dataclass
class BackgroundResponse:
    """A `/v1/responses` request with `background: true` that is still running."""

    run: Any  # its server.chat_run.ChatRun
    task: asyncio.Task  # waits for it, then stores the finished response
    body: dict[str, Any]  # the response as it is while in progress
    cancelled: bool = False  # POST /v1/responses/{id}/cancel asked to stop it
    deleted: bool = False  # DELETE /v1/responses/{id}: stopped, and not stored when it ends
    events: EventLog | None = None  # its events so far, when it was created with stream: true


@dataclass
class ServerState:
    engine: Engine
    served_model_name: str
    chat_template: ChatTemplate  # --chat-template and --chat-template-content-format
    limits: ModelLimits
    token_texts: TokenTexts | TokenIdTexts
    shutting_down: bool = False
    metrics: Any = None  # the ksana_llm.server.metrics.ServerMetrics, once mounted
    tool_parser: ToolParser | None = None  # --tool-call-parser
    enable_auto_tool_choice: bool = False  # --enable-auto-tool-choice
    reasoning_parser: ReasoningParser | None = None  # --reasoning-parser
    # --max-logprobs: cap on top_logprobs / prompt_logprobs; -1: the whole vocabulary
    max_logprobs: int = MAX_LOGPROBS
    return_tokens_as_token_ids: bool = False  # --return-tokens-as-token-ids: for every request
    enable_prompt_embeds: bool = False  # --enable-prompt-embeds: completions take prompt_embeds
    request_log: RequestLog | None = None  # --enable-log-requests
    # --default-chat-template-kwargs: under each chat request's own chat_template_kwargs
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    force_include_usage: bool = False  # --enable-force-include-usage: streams end with usage
    # --exclude-tools-when-tool-choice-none: tool_choice "none" shows the template no tools
    exclude_tools_when_tool_choice_none: bool = False
    response_role: str = "assistant"  # --response-role: the role of answers to a generation prompt
    kv_transfer: Any = None  # a ksana_llm.server.kv_transfer.KvTransfer with --kv-role
    responses: ResponseStore = field(default_factory=ResponseStore)  # /v1/responses, store=true
    model_aliases: tuple[str, ...] = ()  # more names for the served model (--served-model-name)
    background_responses: dict[str, BackgroundResponse] = field(default_factory=dict)
    # --generation-config: what a request that leaves a sampling parameter out gets
    sampling_defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    # When the server came up: the `created` of its model cards, the same on every call.
    started_at: int = field(default_factory=lambda: int(time.time()))
    load: ServerLoad = field(default_factory=ServerLoad)  # GET /load (LoadTrackingMiddleware)

    def grammar_compiler(self) -> Any:
        """The engine's GrammarCompiler: a spec compiled here to check it (off the event loop)
        is a cache hit when the engine compiles it again at submit."""
        return self.engine.grammar_compiler

    def request_observer(self, config: GenerationConfig | None = None
                         ) -> Callable[[Any], None] | None:
        """A callback for one engine request (None without metrics): it times the gaps between
        tokens as the engine produces them, streaming or not, and records the finished request
        (with `config`, its generation settings)."""
        metrics = self.metrics
        if metrics is None:
            return None
        timer = metrics.token_timer()
        seen = 0

        def observe(output: Any) -> None:
            nonlocal seen
            if len(output.token_ids) > seen:
                seen = len(output.token_ids)
                timer.tick()
            if output.finished and output.error is None:  # a failure is counted where seen
                metrics.observe_finished(output, output.metrics.queue_time, config)

        return observe

    def count_failure(self, reason: str) -> None:
        if self.metrics is not None:
            self.metrics.count_failure(reason)

    def count_forward_outputs(self, outputs: list[ForwardOutput] | None) -> None:
        """Count forward-only requests as they ended (server.metrics' rule): None, the client
        left (their requests aborted), is one "aborted" failure; else each finished one."""
        if outputs is None:
            self.count_failure("aborted")
        elif self.metrics is not None:
            for output in outputs:
                self.metrics.observe_forward_finished(len(output.prompt_token_ids))

    def logprob_texts(self, req: Any) -> TokenTexts | TokenIdTexts:
        """How a request's logprob entries name tokens: their text, or "token_id:<id>" when it
        (or the server's --return-tokens-as-token-ids) asks for `return_tokens_as_token_ids`."""
        by_id = self.return_tokens_as_token_ids or getattr(req, "return_tokens_as_token_ids",
                                                           False)
        return TokenIdTexts() if by_id else self.token_texts

    @property
    def tokenizer(self) -> Any:
        """The engine's tokenizer; None when the server runs without one
        (--skip-tokenizer-init): read it through `text_tokenizer` where text is involved."""
        return self.engine.tokenizer

    def chat_template_kwargs(self, requested: dict[str, Any] | None) -> dict[str, Any]:
        """A request's chat_template_kwargs over the server's defaults
        (--default-chat-template-kwargs)."""
        return {**self.default_chat_template_kwargs, **(requested or {})}

    def text_tokenizer(self, field: str) -> Any:
        """The tokenizer, for a request's `field` given as text (or asking for text); a 400
        naming the field when the server has none (--skip-tokenizer-init)."""
        tokenizer = self.engine.tokenizer
        if tokenizer is None:
            raise no_tokenizer(field)
        return tokenizer

    def check_model(self, name: str | None) -> str | None:
        """The LoRA adapter a request's `model` names, or None for the base model. An omitted
        model (or an empty name) means the one being served (as vLLM does); a name that is
        neither the served model nor a loaded adapter is a 404."""
        if not name or name == self.served_model_name or name in self.model_aliases:
            return None
        if name in self.engine.lora_adapters:
            return name
        raise model_not_found(name)

    def response_model(self, name: str | None) -> str:
        """The `model` a response names: the adapter or model the request named."""
        return name or self.served_model_name

    def check_alive(self) -> None:
        if self.shutting_down:
            raise engine_unavailable("the server is shutting down")
        if not self.engine.is_running:
            raise engine_unavailable()


def server_state(request: Request) -> ServerState:
    return request.app.state.server
