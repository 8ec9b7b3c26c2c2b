"""Pydantic models of the OpenAI HTTP protocol, as far as this server speaks it, plus the vLLM
extra parameters users send through `extra_body` (beam search, structured outputs, ...).

Requests forbid unknown fields: a parameter we cannot honour must fail loudly (400) rather than be
silently dropped. Fields OpenAI defines but the server cannot honour are declared (typed `Any`)
so that the error names them as unsupported instead of unknown; `unsupported_params` lists the
ones a request actually set. Harmless fields (`user`, `metadata`, `service_tier`, ...) are accepted
and ignored. Fields whose shape needs a precise error (`response_format`, `tools`, `tool_choice`,
...) are typed loosely here and checked by the module that maps them.
"""

from __future__ import annotations

import time
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, model_serializer, model_validator

# Caps against single-request denial of service (see serving-reliability-notes §7). Within them
# a request must also fit the engine (`submission.check_fits_queue`: max_num_seqs sequences of one
# prompt side by side, max_num_seqs + max_queue_size prompts x n).
MAX_N = 128  # OpenAI's limit on n
MAX_BEAMS = 16  # best_of and num_beams: each candidate is a full sequence until the end
MAX_CHOICES = 2048  # prompts x n in one request (OpenAI's limit on a prompt list)
MAX_STOP = 16
MAX_LOGPROBS = 20  # default of --max-logprobs (the engine's own limit)
MAX_LOGIT_BIAS = 300  # entries, as OpenAI
MAX_BAD_WORDS = 128
MAX_XARGS = 64  # vllm_xargs entries
MAX_DOCUMENTS = 1024  # RAG documents handed to a chat template


class _Request(BaseModel):
    # Strict: "5" is not an int and 1 is not a bool, as in the OpenAI API. No float may be
    # infinite or NaN (Infinity, or 1e400, is no temperature).
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit null for a parameter that has a default means that default, as OpenAI's
        nullable parameters (`n`, `stream`, `logprobs`, `echo`, ...) and vLLM's Optional ones
        read: the SDK sends null for every argument given as None. Required fields stay
        required."""
        if not isinstance(data, dict):
            return data
        fields = cls.model_fields
        nulls = [key for key, value in data.items() if value is None and key in fields
                 and not fields[key].is_required() and fields[key].default is not None]
        return {k: v for k, v in data.items() if k not in nulls} if nulls else data


class StreamOptions(_Request):
    include_usage: bool = False
    continuous_usage_stats: bool = False
    include_obfuscation: bool = True  # accepted and ignored: this server pads no events


class _SamplingRequest(_Request):
    """Parameters shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    n: int = Field(1, ge=1, le=MAX_N)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=MAX_STOP)
    seed: int | None = Field(None, ge=-(2**63), lt=2**64)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Accepted and ignored: they do not change what is generated.
    user: str | None = None
    metadata: dict[str, str] | None = None
    service_tier: str | None = None
    # vLLM's; decoding keeps the tokenizer's own setting (fast tokenizers put no spaces between
    # special tokens either way, as vLLM's fast detokenizer does not).
    spaces_between_special_tokens: bool = True
    best_of: int | None = Field(None, ge=1, le=MAX_BEAMS)
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_LOGIT_BIAS)
    # {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}; see structured_params
    response_format: Any = None
    # vLLM extras: prompt logprobs, beam search, n-gram blocking, structured outputs.
    prompt_logprobs: int | None = Field(None, ge=-1)  # -1: the whole vocabulary (vLLM's)
    use_beam_search: bool = False
    num_beams: int | None = Field(None, ge=1, le=MAX_BEAMS)
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False
    no_repeat_ngram_size: int = Field(0, ge=0)
    structured_outputs: Any = None  # {"json" | "regex" | "grammar" | "choice" | "json_object": ...}
    guided_json: Any = None
    guided_regex: str | None = None
    guided_grammar: str | None = None
    guided_choice: list[str] | None = None
    # vLLM's token restrictions: words never generated, the only ids that may be, and a prompt
    # cut to its last N tokens.
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    allowed_token_ids: list[int] | None = Field(None, min_length=1, max_length=2**18)
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # -1: the model's context
    # vLLM's: the most tokens the thinking block may hold before the server forces its end.
    thinking_token_budget: int | None = Field(None, ge=0)
    # Prefill/decode disaggregation (vLLM's name); checked by server.kv_transfer.
    kv_transfer_params: dict[str, Any] | None = None
    # vLLM's: lower runs first; needs a server started with --scheduling-policy priority.
    priority: int = Field(0, ge=-(2**63), lt=2**63)
    # vLLM's: logprob tokens as "token_id:<id>" strings.
    return_tokens_as_token_ids: bool = False
    # vLLM's: only requests with the same salt share prefix-cache entries.
    cache_salt: str | None = Field(None, min_length=1)
    # vLLM's: the prompt's and each choice's token ids in the answer (streams: the prompt's on
    # the first chunk, each chunk's own tokens after).
    return_token_ids: bool = False
    # vLLM's: the id the request runs under, and the response's id after its prefix
    # ("chatcmpl-<id>", "cmpl-<id>"); a random one when left out. One in use by a running
    # request is refused.
    request_id: str | None = Field(None, min_length=1, max_length=256, pattern=r"^[\x21-\x7e]+$")
    # vLLM's: settings for the server's --logits-processors (GenerationConfig.extra_args).
    vllm_xargs: dict[str, bool | str | int | float | list[bool | str | int | float]] | None = Field(
        None, max_length=MAX_XARGS)

    def unsupported_params(self) -> list[str]:
        return []


class CompletionRequest(_SamplingRequest):
    # Typed loosely on purpose: `prompt_to_token_ids` gives precise 400 messages for the four
    # accepted shapes instead of pydantic's union-error noise.
    prompt: Any = None
    # 0 with echo: score the prompt, generate nothing (OpenAI's legacy rule; checked in the route)
    max_tokens: int | None = Field(None, ge=0)
    logprobs: int | None = Field(None, ge=0)  # capped by --max-logprobs in the route
    echo: bool = False
    suffix: Any = None
    prompt_embeds: Any = None  # vLLM's: base64 torch.save'd tensors (server/prompt_embeds.py)
    add_special_tokens: bool = True  # vLLM's: the tokenizer's special tokens around a text prompt

    def unsupported_params(self) -> list[str]:
        found = super().unsupported_params()
        if self.suffix:
            found.append("suffix")
        return found


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # str, or a list of {"type": "text", "text": ...} parts; checked by chat.py for clear errors.
    content: Any = None
    name: str | None = None
    # An assistant turn that called tools, and the tool's answer (multi-turn tool use).
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    reasoning_content: str | None = None  # a thinking model's earlier reasoning; templates may drop it
    # What the client sends back of an earlier answer (`message.model_dump()`): a refusal is the
    # turn's text (chat.py); annotations (citations) are dropped; audio and function_call must
    # be null, as they are from this server (chat.py refuses others).
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: Any = None
    function_call: Any = None


class ChatCompletionRequest(_SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    # Capped by --max-logprobs in the route; -1: the whole vocabulary (vLLM's).
    top_logprobs: int | None = Field(None, ge=-1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    store: bool | None = None
    parallel_tool_calls: bool | None = None
    tools: Any = None  # [{"type": "function", "function": {...}}]; checked by tools.py
    tool_choice: Any = None  # "none" | "auto" | "required" | {"type": "function", ...}
    chat_template_kwargs: dict[str, Any] | None = None  # e.g. {"enable_thinking": false}
    # vLLM's: retrieved texts for templates with a RAG section ([{"title": ..., "text": ...}]);
    # the answer starts with the last message's content when it has the answer's role (echo);
    # special tokens (BOS) added on top of the template's own.
    documents: list[dict[str, str]] | None = Field(None, max_length=MAX_DOCUMENTS)
    echo: bool = False
    add_special_tokens: bool = False
    functions: Any = None
    function_call: Any = None
    chat_template: Any = None
    audio: Any = None
    modalities: Any = None
    # OpenAI's Predicted Outputs: {"type": "content", "content": str | [text parts]}; checked by
    # params.prediction_token_ids.
    prediction: Any = None
    # Handed to the chat template as `reasoning_effort` (as vLLM does): templates that read it
    # (gpt-oss's, ...) act on it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh", "max"] | None = None
    # vLLM's: false leaves the reasoning parser's reasoning_content out of the answer.
    include_reasoning: bool = True
    web_search_options: Any = None
    verbosity: Any = None
    # Accepted and ignored, as on /v1/responses: they do not change what is generated.
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None

    def unsupported_params(self) -> list[str]:
        found = super().unsupported_params()
        # functions / function_call: OpenAI's deprecated spelling of tools / tool_choice.
        for name in ("functions", "function_call", "audio",
                     "web_search_options", "verbosity"):
            if getattr(self, name):
                found.append(name)
        if self.modalities not in (None, ["text"]):
            found.append("modalities")
        if self.store:
            found.append("store")
        return found


# ---- responses ------------------------------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache served


class CompletionTokensDetails(BaseModel):
    # Predicted Outputs: prediction tokens that appear in the completion (in order), and the rest
    accepted_prediction_tokens: int = 0
    rejected_prediction_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None
    completion_tokens_details: CompletionTokensDetails | None = None


class PromptLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class CompletionLogprobs(BaseModel):
    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class _KeepsNullKeys(BaseModel):
    """A record whose `_null_keys` stay in the JSON as null even when dumped with exclude_none
    (streamed chunks are, to leave out the many unused optional fields): OpenAI and vLLM send
    `"finish_reason": null` and `"logprobs": null` on every choice, and typed clients index
    them."""

    _null_keys: ClassVar[tuple[str, ...]] = ()

    @model_serializer(mode="wrap")
    def _with_null_keys(self, handler: Any) -> Any:
        data = handler(self)
        if isinstance(data, dict):
            for key in self._null_keys:
                data.setdefault(key, None)
        return data


class CompletionChoice(_KeepsNullKeys):
    _null_keys: ClassVar[tuple[str, ...]] = ("logprobs", "finish_reason", "stop_reason")

    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    # vLLM's prompt_logprobs: None for the first prompt token, then {token_id: PromptLogprob}.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids: this choice's (chunk's) tokens


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill server's answer to do_remote_decode


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(BaseModel):
    content: list[ChatLogprobEntry] | None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str  # JSON text


class ToolCallModel(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatResponseMessage(BaseModel):
    role: str = "assistant"  # another with --response-role, or without a generation prompt
    content: str | None = None
    refusal: str | None = None  # OpenAI's (nullable, always present); this server never refuses
    reasoning_content: str | None = None
    tool_calls: list[ToolCallModel] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    kv_transfer_params: dict[str, Any] | None = None  # a prefill server's answer to do_remote_decode
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class DeltaFunctionCall(BaseModel):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(BaseModel):
    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(BaseModel):
    role: str | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_KeepsNullKeys):
    _null_keys: ClassVar[tuple[str, ...]] = ("logprobs", "finish_reason")

    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    # vLLM's: on the last chunk of a choice, the stop string or token id that ended it.
    stop_reason: str | int | None = None
    token_ids: list[int] | None = None  # with return_token_ids: this chunk's tokens


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids: on the first chunk


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "ksana-llm"
    root: str
    parent: str | None = None  # a LoRA adapter's base model (its root is the adapter's folder)
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
