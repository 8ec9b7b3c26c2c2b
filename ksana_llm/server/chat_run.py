"""A chat request from validation to submitted choices, shared by `/v1/chat/completions` and
`/v1/responses` (which differ only in how they shape the answer).

Everything that can be a 400 happens here, before anything is submitted: the template renders,
the prompt fits, tools and output constraints compile.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ksana_llm.server.chat import message_text, render_chat, template_flags
from ksana_llm.server.chat_output import ChoiceOutputParser
from ksana_llm.server.errors import bad_request
from ksana_llm.server.generation import ChoiceSet
from ksana_llm.server.openai_protocol import ChatCompletionRequest
from ksana_llm.server.params import (
    check_logprobs_cap,
    check_token_ids,
    prediction_token_ids,
    resolve_max_tokens,
    truncated_prompt,
)
from ksana_llm.server.state import ServerState
from ksana_llm.server.structured_params import from_response_format, from_vllm_extras
from ksana_llm.server.submission import (check_common, constraint, plan_jobs, plugin_sees,
                                         request_fields)
from ksana_llm.server.tool_parsers import ToolParser
from ksana_llm.server.tools import plan_tools

# Constraints that make the whole output JSON, where the engine does not let the model think
# first (it has no reasoning_config): such an output has no thinking block.
_JSON_KINDS = ("json_object", "json_schema")


@dataclass
class ChatRun:
    """A submitted chat request: its prompt, its choices, and how to read their text."""

    request_id: str
    ids: list[int]  # the rendered prompt's tokens
    choices: ChoiceSet
    output_parser: Callable[[], ChoiceOutputParser]  # a fresh one per choice
    model: str  # the name the response gives
    created: int
    prediction: list[int] | None = None  # Predicted Outputs' token ids, for the usage
    # The answer's role: --response-role after a generation prompt, else the last message's
    # (a continued final message, a template that answers as another role), as vLLM does.
    role: str = "assistant"
    # echo: the last message's text, which the answer starts with (it has the answer's role).
    echo: str = ""


async def start_chat(req: ChatCompletionRequest, state: ServerState, request_id: str) -> ChatRun:
    if req.chat_template is not None:
        raise bad_request("A chat template cannot be sent with the request; the server uses its own "
                          "(set at start-up with --chat-template).", param="chat_template",
                          code="unsupported_parameter")
    check_common(req, state)
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs needs logprobs to be true.", param="top_logprobs")
    check_logprobs_cap(req.top_logprobs, state.max_logprobs, "top_logprobs",
                       state.limits.vocab_size)
    tools = plan_tools(req.tools, req.tool_choice, parallel_tool_calls=req.parallel_tool_calls,
                       auto_enabled=state.enable_auto_tool_choice, parser=state.tool_parser)
    template_kwargs = state.chat_template_kwargs(req.chat_template_kwargs)
    if req.reasoning_effort is not None:
        template_kwargs.setdefault("reasoning_effort", req.reasoning_effort)
    adds_generation_prompt, continues_final_message, template_kwargs = template_flags(
        req.add_generation_prompt, req.continue_final_message, template_kwargs)
    prompt = render_chat(state.text_tokenizer("messages"), req.messages, state.chat_template,
                         add_generation_prompt=adds_generation_prompt,
                         continue_final_message=continues_final_message,
                         tools=None if tools.mode == "none"
                         and state.exclude_tools_when_tool_choice_none else tools.tools,
                         template_kwargs=template_kwargs,
                         documents=req.documents)
    # The template already holds the special tokens (BOS etc.): not added twice unless asked.
    ids = truncated_prompt(list(state.tokenizer.encode(
        prompt, add_special_tokens=req.add_special_tokens)), req.truncate_prompt_tokens,
        state.limits.max_model_len)
    check_token_ids(ids, state.limits.vocab_size, "messages")
    # Both given: max_completion_tokens, OpenAI's current name for what max_tokens was (vLLM's
    # rule too; a client filling both from different defaults is not refused).
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(ids), state.limits, "messages",
                                    state.sampling_defaults.max_tokens)
    spec, kind = await constraint(state, [from_response_format(req.response_format),
                                          *from_vllm_extras(req), tools.constraint], req)
    extra: dict[str, Any] = {}
    if spec is not None:
        extra["structured_output"] = spec
    if req.prompt_logprobs is not None:
        extra["prompt_logprobs"] = req.prompt_logprobs
    # Reasoning is parsed unless the request turned thinking off, or constrained the whole
    # output to JSON (which leaves no room for a thinking block). An engine watching the
    # thinking block (its reasoning_config, which the parser gives it) constrains only the
    # answer after it, as vLLM does: the block is there to parse, the JSON (a forced tool
    # call's too) after it.
    reasoning = state.reasoning_parser
    whole_output_json = (kind in _JSON_KINDS
                         and state.engine.config.reasoning_config is None)
    if template_kwargs.get("enable_thinking") is False or whole_output_json:
        reasoning = None
    if req.skip_special_tokens and any(getattr(parser, "reads_special_tokens", False)
                                       for parser in (reasoning, tools.parser)):
        # GPT-OSS's harmony parsers read the channels off its special tokens, and take them
        # out of what they return.
        req = req.model_copy(update={"skip_special_tokens": False})
    logprobs = (req.top_logprobs or 0) if req.logprobs else None
    jobs = plan_jobs(req, [ids], state, logprobs=logprobs, extra=extra,
                     max_tokens=lambda _: max_tokens)

    thinking_open = reasoning is not None and reasoning.opens_thinking(prompt)
    # GPT-OSS: calls go on (as harmony) from its reasoning parser to its tool-call parser
    calls_read = getattr(tools.parser, "reads_special_tokens", False)
    # The server's parser names calls, whatever tool_choice: a model whose template checks the
    # ids (Mistral's) gets them back in the conversation either way.
    new_call_id = (state.tool_parser or ToolParser).new_call_id

    def output_parser() -> ChoiceOutputParser:
        return ChoiceOutputParser(reasoning.stream(thinking_open, calls_read=calls_read)
                                  if reasoning is not None else None,
                                  tools.stream(), forced_call=tools.mode == "named",
                                  include_reasoning=req.include_reasoning,
                                  new_call_id=new_call_id)

    prediction = prediction_token_ids(req.prediction, state.tokenizer)
    if prediction is not None:
        check_token_ids(prediction, state.limits.vocab_size, "prediction.content")
    fields = await request_fields(req, state, jobs)
    fields.update(plugin_sees(state, prompt_text=prompt, messages=[
        m.model_dump(exclude_none=True) for m in req.messages]))
    if prediction is not None:
        fields["prediction"] = prediction
    choices = ChoiceSet.submit(state.engine, request_id, jobs.items,
                               state.request_observer if state.metrics is not None else None,
                               fields, state.request_log)
    role = state.response_role if adds_generation_prompt else req.messages[-1].role
    last = req.messages[-1]
    echo = message_text(last, len(req.messages) - 1) if req.echo and last.role == role else ""
    return ChatRun(request_id, ids, choices, output_parser, state.response_model(req.model),
                   int(time.time()), prediction, role, echo)
