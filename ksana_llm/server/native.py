"""KsanaLLM's native `POST /generate` (see ksana-notes §1 and §3).

Request: `prompt` (str) or `input_tokens` (list[int]) -- exactly one -- plus `sampling_config`
(KsanaLLM names: `topk`, `topp`, `max_new_tokens`, `num_return_sequences`, `num_beams`,
`length_penalty`, `no_repeat_ngram_size`, `structured_output_regex`, `enable_structured_output` +
`json_schema`, ...), `structured_output_regex` (KsanaLLM's top-level spelling), `model_type` /
`use_chat_template` (see `prompt_affixes`) and `stream` (default **true**). As in KsanaLLM, a key
set to null takes its default, and greedy decoding (`topk` 1, the default, or `do_sample` false)
ignores `topp` and `temperature`. `num_return_sequences` sequences are one engine request (beam
search returns its best `num_return_sequences` beams, at most `num_beams`). Response: `{"texts",
"output_token_ids", "logprobs", "input_token_ids"}`, one entry per return sequence; `texts` is
the decode of `output_token_ids` (special tokens skipped, a stop token's text kept, as KsanaLLM
decodes), except that a matched stop string and what follows it are cut from the text. A stream
is not SSE: each chunk is that same object, JSON, followed by a NUL byte, holding the *cumulative*
output so far; the last chunk is the final result.

Errors, the API key, metrics and abort-on-disconnect are the OpenAI routes' own (`errors.py`,
`generation.py`, the middlewares), so a client gets the same statuses and bodies on both APIs.
"""

from __future__ import annotations

import json
import secrets
import uuid
from collections.abc import AsyncIterator
from types import MappingProxyType
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server.errors import APIError, bad_request, from_validation_error, malformed_json
from ksana_llm.server.generation import ChoiceResult, ChoiceSet, ClientDisconnected
from ksana_llm.server.json_body import load_json
from ksana_llm.server.logprobs import _finite
from ksana_llm.server.openai_protocol import MAX_BEAMS, MAX_N, MAX_STOP
from ksana_llm.server.submission import (CLIENT_CLOSED_REQUEST, AbortOnCloseStreamingResponse,
                                         heavy_logprobs, off_the_loop_if, plugin_sees)
from ksana_llm.server.params import (
    check_logprobs_cap,
    check_token_ids,
    engine_config,
    prompt_token_lists,
    resolve_max_tokens,
)
from ksana_llm.server.prompt_affixes import build_prompt
from ksana_llm.server.state import ServerState, server_state
from ksana_llm.server.structured_params import (StructuredRequest, compile_spec,
                                                refuse_with_beam_search, single)

NUL = b"\0"
STREAM_MEDIA_TYPE = "application/octet-stream"

# KsanaLLM top-level keys we do not serve yet: named in the 400 rather than called unknown,
# with the value that means "nothing" where one does (accepted and dropped).
_UNSUPPORTED_TOP = ("messages", "input_refit_embedding", "pos", "embeddings", "additional_params")
_UNSUPPORTED_TOP_DEFAULTS: dict[str, Any] = {"additional_params": {}}

# KsanaLLM sampling_config keys we do not serve yet, with the value that means "off" (accepted).
_UNSUPPORTED_SAMPLING_DEFAULTS: dict[str, Any] = {
    "encoder_no_repeat_ngram_size": 0, "decoder_no_repeat_ngram_size": 0,
}

# GenerationConfig field -> request parameter, so that an engine ValueError names the key sent.
_ENGINE_TO_NATIVE = MappingProxyType({
    name: f"sampling_config.{key}" for name, key in (
        ("top_k", "topk"), ("top_p", "topp"), ("stop", "stop_strings"),
        ("max_new_tokens", "max_new_tokens"), ("temperature", "temperature"),
        ("do_sample", "do_sample"), ("repetition_penalty", "repetition_penalty"),
        ("stop_token_ids", "stop_token_ids"), ("logprobs", "logprobs"),
        ("num_return_sequences", "num_return_sequences"), ("num_beams", "num_beams"),
        ("length_penalty", "length_penalty"), ("no_repeat_ngram_size", "no_repeat_ngram_size"),
        ("seed", "seed"), ("ignore_eos", "ignore_eos"))})


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0)
    topk: int = Field(1, ge=0)
    topp: float = Field(1.0, ge=0, le=1)  # 0 is KsanaLLM's clients' greedy spelling
    do_sample: bool | None = None
    max_new_tokens: int | None = None  # absent or <= 0: until EOS or the context limit
    repetition_penalty: float = Field(1.0, gt=0)
    stop_token_ids: list[int] = Field(default_factory=list, max_length=MAX_STOP)
    stop_strings: list[str] = Field(default_factory=list, max_length=MAX_STOP)
    ignore_eos: bool = False
    logprobs: int = Field(0, ge=0)  # top-N per step; 0 = none; capped by --max-logprobs
    num_return_sequences: int = Field(1, ge=1, le=MAX_N)
    num_beams: int = Field(1, ge=1, le=MAX_BEAMS)
    length_penalty: float = 1.0
    no_repeat_ngram_size: int = Field(0, ge=0)
    # Structured output (xgrammar): a regex, or a JSON schema when enable_structured_output.
    structured_output_regex: str | None = None
    enable_structured_output: bool = False
    json_schema: str | dict[str, Any] | None = None
    # Extension (not KsanaLLM's): base seed; sequence i samples with seed + i.
    seed: int | None = Field(None, ge=0, lt=2**63)
    # Reasoning models: handed to the chat template with use_chat_template (Qwen3's switch);
    # a raw prompt is the model's input as it is.
    enable_thinking: bool = True

    @property
    def greedy(self) -> bool:
        return self.do_sample is False or self.topk == 1 or self.temperature == 0


class GenerateRequest(_Strict):
    prompt: str | None = None
    input_tokens: list[int] | None = None
    structured_output_regex: str | None = None  # KsanaLLM's top-level spelling
    sampling_config: SamplingConfig = Field(default_factory=SamplingConfig)
    stream: bool = True
    model_name: str = ""  # accepted, as KsanaLLM does; one model is served
    debug_mode: bool = False  # accepted and ignored
    model_type: str = "empty"  # the prompt's chat affix (prompt_affixes.PROMPT_AFFIXES)
    use_chat_template: bool = False  # `prompt` is JSON messages for the model's chat template


def _check_keys(body: Any) -> None:
    """400 naming *every* unsupported or unknown key (pydantic would name only the first)."""
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.")
    unsupported = [k for k in _UNSUPPORTED_TOP
                   if k in body and not (k in _UNSUPPORTED_TOP_DEFAULTS
                                         and body[k] == _UNSUPPORTED_TOP_DEFAULTS[k])]
    sampling = body.get("sampling_config")
    if isinstance(sampling, dict):
        unsupported += [f"sampling_config.{k}" for k, off in _UNSUPPORTED_SAMPLING_DEFAULTS.items()
                        if k in sampling and sampling[k] != off]
    known_top = set(GenerateRequest.model_fields)
    unknown = [k for k in body if k not in known_top and k not in _UNSUPPORTED_TOP]
    if isinstance(sampling, dict):
        known = set(SamplingConfig.model_fields) | set(_UNSUPPORTED_SAMPLING_DEFAULTS)
        unknown += [f"sampling_config.{k}" for k in sampling if k not in known]
    parts = []
    if unsupported:
        parts.append(f"Unsupported parameter(s): {', '.join(unsupported)}.")
    if "messages" in unsupported:  # KsanaLLM's own pointer, without a multimodal plugin
        parts.append("For chat messages use /v1/chat/completions, or give them as `prompt` "
                     "(their JSON text) with use_chat_template: true.")
    if unknown:
        parts.append(f"Unknown parameter(s): {', '.join(unknown)}.")
    if parts:
        raise bad_request(" ".join(parts), param=(unsupported + unknown)[0],
                          code="unsupported_parameter" if unsupported else "unknown_parameter")


async def parse_generate_request(request: Request) -> GenerateRequest:
    raw = await request.body()
    try:
        body = load_json(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:  # RecursionError: nesting
        raise malformed_json(exc) from exc
    # null means the default, as KsanaLLM reads its keys (also for the keys we do not serve);
    # the unsupported keys' "off" values are dropped before the model sees them.
    if isinstance(body, dict):
        body = {k: v for k, v in body.items() if v is not None}
        if isinstance(body.get("sampling_config"), dict):
            body["sampling_config"] = {k: v for k, v in body["sampling_config"].items()
                                       if v is not None}
    _check_keys(body)
    body = {k: v for k, v in body.items() if k not in _UNSUPPORTED_TOP_DEFAULTS}
    sampling = body.get("sampling_config")
    if isinstance(sampling, dict):
        body = {**body, "sampling_config": {k: v for k, v in sampling.items()
                                            if k not in _UNSUPPORTED_SAMPLING_DEFAULTS}}
    try:
        return GenerateRequest.model_validate(body)
    except ValidationError as exc:
        raise from_validation_error(exc) from exc


def prompt_ids(req: GenerateRequest, state: ServerState) -> list[int]:
    """The prompt's token ids: `input_tokens` when given (KsanaLLM's rule: then `prompt` is not
    tokenized), else `prompt` tokenized."""
    if req.prompt is None and req.input_tokens is None:
        raise bad_request("Give `prompt` or `input_tokens`.", param="prompt")
    if req.input_tokens is None:
        text = build_prompt(req.prompt, req.model_type, req.use_chat_template,
                            state.text_tokenizer("prompt"), state.chat_template,
                            template_kwargs={"enable_thinking":
                                             req.sampling_config.enable_thinking})
        return prompt_token_lists(text, state.tokenizer, state.limits)[0]
    if not req.input_tokens:
        raise bad_request("The prompt is empty.", param="input_tokens", code="empty_prompt")
    check_token_ids(req.input_tokens, state.limits.vocab_size, "input_tokens")
    return list(req.input_tokens)


def _structured(req: GenerateRequest) -> StructuredRequest | None:
    sc = req.sampling_config
    found = []
    for param, regex in (("structured_output_regex", req.structured_output_regex),
                         ("sampling_config.structured_output_regex", sc.structured_output_regex)):
        if regex:  # "" is KsanaLLM's "none"
            found.append(StructuredRequest("regex", regex, param))
    if sc.enable_structured_output:
        param = "sampling_config.json_schema"
        if sc.json_schema in (None, ""):
            raise bad_request("enable_structured_output needs `sampling_config.json_schema`.",
                              param=param)
        schema = sc.json_schema if isinstance(sc.json_schema, str) else json.dumps(sc.json_schema)
        found.append(StructuredRequest("json_schema", schema, param))
    elif sc.json_schema not in (None, ""):
        raise bad_request("`sampling_config.json_schema` needs enable_structured_output: true.",
                          param="sampling_config.enable_structured_output")
    return single(found)


def _beam_fields(sc: SamplingConfig) -> dict[str, Any]:
    """Beam search (num_beams > 1): deterministic, so sampling settings are refused; the
    num_return_sequences best beams come back (KsanaLLM caps them at num_beams)."""
    if sc.num_beams == 1:
        if sc.length_penalty != 1.0:
            raise bad_request("`length_penalty` applies to beam search only (num_beams > 1).",
                              param="sampling_config.length_penalty")
        return {}
    if sc.do_sample:
        raise bad_request("Beam search cannot sample: do_sample must be false with num_beams > 1.",
                          param="sampling_config.do_sample")
    if not sc.greedy:
        # Without do_sample, topk != 1 at a temperature above 0 means sampling (as with one
        # beam); silently running deterministic beams instead would not be what was asked.
        raise bad_request(f"Beam search cannot sample: topk {sc.topk} with temperature "
                          f"{sc.temperature} samples; use topk 1, temperature 0 or do_sample false "
                          "with num_beams > 1.", param="sampling_config.topk")
    if 0 < sc.topp < 1:  # (0: KsanaLLM's clients' way of saying "not used")
        raise bad_request("Beam search cannot use topp < 1.", param="sampling_config.topp")
    if sc.num_return_sequences > sc.num_beams:
        raise bad_request(f"num_return_sequences ({sc.num_return_sequences}) cannot exceed "
                          f"num_beams ({sc.num_beams}).", param="sampling_config.num_return_sequences")
    return {"num_beams": sc.num_beams, "length_penalty": sc.length_penalty,
            "num_return_sequences": sc.num_return_sequences}


def generation_config(sc: SamplingConfig, prompt_len: int, state: ServerState,
                      structured: Any = None, prompt_param: str = "prompt") -> GenerationConfig:
    """The engine config of the request (KsanaLLM semantics: greedy by default), returning all
    its sequences (samples or beams). `prompt_param`: the field the prompt came from."""
    requested = sc.max_new_tokens if sc.max_new_tokens is not None and sc.max_new_tokens > 0 else None
    try:
        max_tokens = resolve_max_tokens(requested, prompt_len, state.limits, prompt_param)
    except APIError as exc:
        if requested is not None and prompt_len < state.limits.max_model_len:
            # The prompt fits: the completion asked for is what does not.
            exc.param = "sampling_config.max_new_tokens"
        raise
    # A stop id past the vocabulary can never be generated, so it never stops anything: dropped,
    # as KsanaLLM does not check them (its clients send a model family's ids whatever the model).
    check_token_ids([t for t in sc.stop_token_ids if t < 0], state.limits.vocab_size,
                    "sampling_config.stop_token_ids")
    stop_ids = [t for t in sc.stop_token_ids if t < state.limits.vocab_size]
    check_logprobs_cap(sc.logprobs, state.max_logprobs, "sampling_config.logprobs",
                       state.limits.vocab_size)
    if any(not s for s in sc.stop_strings):
        raise bad_request("Stop strings must be non-empty.", param="sampling_config.stop_strings")
    beam = _beam_fields(sc)
    sample = not sc.greedy and not beam
    if sample and sc.topp == 0:
        raise bad_request("topp must be > 0 when sampling (topk other than 1); topp 0 is only "
                          "accepted with greedy decoding, which ignores it.",
                          param="sampling_config.topp")
    base_seed = (sc.seed if sc.seed is not None else secrets.randbits(62)) if sample else None
    fields: dict[str, Any] = {
        "max_new_tokens": max_tokens, "do_sample": sample,
        "temperature": sc.temperature if sample else 1.0,
        "top_k": sc.topk if sample else 0, "top_p": sc.topp if sample else 1.0,
        "repetition_penalty": sc.repetition_penalty, "stop": list(sc.stop_strings),
        "stop_token_ids": stop_ids, "ignore_eos": sc.ignore_eos,
        "logprobs": sc.logprobs or None,
    }
    if sc.no_repeat_ngram_size:
        fields["no_repeat_ngram_size"] = sc.no_repeat_ngram_size
    if structured is not None:
        fields["structured_output"] = structured
    if beam:
        return engine_config({**fields, **beam}, _ENGINE_TO_NATIVE)
    # One engine request for every sequence: they share the prompt's KV, the metrics count one
    # request, and sequence i of a seeded request samples with seed + i.
    return engine_config({**fields, "seed": base_seed,
                          "num_return_sequences": sc.num_return_sequences}, _ENGINE_TO_NATIVE)


def _logprob_steps(entries: list[dict[str, Any]], n: int) -> list[list[list[float | int]]]:
    """KsanaLLM's format: per step, the top-N `[token_id, logprob]` pairs, best first."""
    steps = []
    for entry in entries:
        top = sorted(entry["top_logprobs"].items(), key=lambda kv: kv[1], reverse=True)[:n]
        steps.append([[int(token_id), _finite(lp)] for token_id, lp in top])
    return steps


def _text(out: ChoiceResult, tokenizer: Any) -> str:
    """KsanaLLM's `texts`, the decode of the output tokens with special tokens skipped: the
    engine's own incremental text (which leaves out an incomplete UTF-8 character at the end,
    and cuts a matched stop string as KsanaLLM's output is cut), plus the text of a stop token
    that is not special, which KsanaLLM keeps. Decoded in its context (the tokens before it
    decide its leading space), and only the tail: a chunk per token must not decode it all."""
    stop = out.stop_reason
    if not isinstance(stop, int) or isinstance(stop, bool) or not out.token_ids \
            or out.token_ids[-1] != stop or tokenizer is None:  # (no tokenizer: no text at all)
        return out.text
    before = out.token_ids[-5:-1]
    head = tokenizer.decode(before, skip_special_tokens=True)
    return out.text + tokenizer.decode(before + [stop], skip_special_tokens=True)[len(head):]


class LogprobSteps:
    """Each sequence's log-prob steps in KsanaLLM's format, each step formatted once: a stream's
    chunks are cumulative, and re-sorting every step's alternatives for every chunk grows with
    the square of the output (seconds per chunk with vocabulary-wide ones)."""

    def __init__(self, n: int) -> None:
        self.n = n
        self._entries: list[list[dict[str, Any]]] = []  # the entries formatted so far
        self._steps: list[list[list[list[float | int]]]] = []

    def of(self, outs: list[ChoiceResult]) -> list[list[list[list[float | int]]]]:
        """One list per sequence, as KsanaLLM's: empty when no log-probs were asked for."""
        if not self.n:
            return [[] for _ in outs]
        for i, out in enumerate(outs):
            entries = out.logprobs or []
            if i == len(self._steps):
                self._entries.append([])
                self._steps.append([])
            done = self._entries[i]
            # Entries are only appended, except where a sequence's output was replaced (a
            # beam's): then its steps are formatted again.
            if len(done) > len(entries) or (done and entries[len(done) - 1] is not done[-1]):
                done.clear()
                self._steps[i] = []
            new = entries[len(done):]
            done.extend(new)
            self._steps[i].extend(_logprob_steps(new, self.n))
        return self._steps[:len(outs)]


def snapshot(choices: ChoiceSet, input_ids: list[int], steps: LogprobSteps, tokenizer: Any
             ) -> dict[str, Any]:
    """The response object as of now (cumulative; final once every sequence finished)."""
    outs = choices.results()  # token lists copied: the engine thread appends
    return {
        "texts": [_text(o, tokenizer) for o in outs],
        "output_token_ids": [o.token_ids for o in outs],
        "logprobs": steps.of(outs),
        "input_token_ids": input_ids,
    }


def _chunk(payload: dict[str, Any]) -> bytes:
    return json.dumps(payload, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + NUL


async def _nul_stream(choices: ChoiceSet, input_ids: list[int], logprobs_n: int,
                      every_event: bool, tokenizer: Any) -> AsyncIterator[bytes]:
    """A chunk whenever the token count changes (every event with stop strings, as KsanaLLM),
    then the final result unless the last chunk was it already; an engine failure after the 200
    went out becomes an error chunk. Chunks with many alternatives per step are made off the
    event loop."""
    steps, heavy = LogprobSteps(logprobs_n), heavy_logprobs(logprobs_n)
    last_counts: list[int] | None = None
    last: bytes | None = None
    try:
        async for _ in choices.events():
            payload = await off_the_loop_if(
                heavy, lambda: snapshot(choices, input_ids, steps, tokenizer))
            counts = [len(t) for t in payload["output_token_ids"]]
            if every_event or counts != last_counts:
                last_counts = counts
                last = await off_the_loop_if(heavy, lambda: _chunk(payload))
                yield last
    except APIError as exc:
        yield _chunk(exc.body())
        return
    final = await off_the_loop_if(
        heavy, lambda: _chunk(snapshot(choices, input_ids, steps, tokenizer)))
    if final != last:
        yield final


async def generate(request: Request) -> Response:
    state = server_state(request)
    req = await parse_generate_request(request)
    state.check_alive()
    ids = prompt_ids(req, state)
    sc = req.sampling_config
    constraint = _structured(req)
    refuse_with_beam_search(constraint, sc.num_beams > 1)
    spec = await compile_spec(state, constraint) if constraint is not None else None
    config = generation_config(sc, len(ids), state, spec,  # one engine request
                               prompt_param="prompt" if req.input_tokens is None
                               else "input_tokens")
    limit = state.engine.config.max_num_seqs  # its sequences run side by side
    for key in ("num_return_sequences", "num_beams"):
        if getattr(sc, key) > limit:
            raise bad_request(f"{key} must be <= max_num_seqs ({limit}), got {getattr(sc, key)}",
                              param=f"sampling_config.{key}")
    choices = ChoiceSet.submit(state.engine, f"gen-{uuid.uuid4().hex}", [(ids, config)],
                               state.request_observer if state.metrics is not None else None,
                               plugin_sees(state, prompt_text=req.prompt
                                           if isinstance(req.prompt, str) else None),
                               request_log=state.request_log)
    if req.stream:
        response = AbortOnCloseStreamingResponse(
            _nul_stream(choices, ids, sc.logprobs, every_event=bool(sc.stop_strings),
                        tokenizer=state.tokenizer), choices)
        response.headers["content-type"] = STREAM_MEDIA_TYPE
        return response
    try:
        await choices.wait(request)
    except ClientDisconnected:  # not a failure: the metrics count its requests as aborted
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    def answer() -> Response:
        return JSONResponse(snapshot(choices, ids, LogprobSteps(sc.logprobs), state.tokenizer))

    return await off_the_loop_if(heavy_logprobs(sc.logprobs), answer)


def mount(app: FastAPI, engine: Any = None) -> None:
    """Called by `build_app` (the engine is in `app.state.server`; the argument is unused)."""
    app.add_api_route("/generate", generate, methods=["POST"], include_in_schema=True)
