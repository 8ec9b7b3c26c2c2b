"""OpenAI request parameters -> engine inputs (token ids and GenerationConfig), with every check that
must fail as a 400 *before* anything is submitted or streamed: prompt shape, vocabulary, context
length, and the engine's own GenerationConfig validation.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ksana_llm.api.request import Request as EngineRequest
from ksana_llm.api.prompt_rows import truncate_prompt
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server.errors import APIError, bad_request, no_tokenizer
from ksana_llm.server.json_body import LONE_SURROGATE, holds_lone_surrogate
from ksana_llm.server.openai_protocol import (MAX_STOP, ChatCompletionRequest, CompletionRequest,
                                             _SamplingRequest)

# Engine field -> OpenAI parameter, so that an engine ValueError names what the client sent.
_ENGINE_TO_OPENAI = MappingProxyType({"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                     "do_sample": "temperature", "num_return_sequences": "n",
                     "export_kv": "kv_transfer_params", "imported_kv": "kv_transfer_params",
                     "extra_args": "vllm_xargs"})


# The fields the engine's ValueErrors name first: its own request's, and the HTTP requests'
# it is handed (chat_template_kwargs, tools, ...).
_ENGINE_FIELDS = frozenset(f.name for f in dataclasses.fields(GenerationConfig)) | frozenset(
    f.name for f in dataclasses.fields(EngineRequest)) | frozenset(
    name for model in (CompletionRequest, ChatCompletionRequest) for name in model.model_fields)


@dataclass(frozen=True)
class ModelLimits:
    max_model_len: int
    vocab_size: int


def _is_token_list(value: Any) -> bool:
    return isinstance(value, list) and all(isinstance(t, int) and not isinstance(t, bool) for t in value)


def check_token_ids(ids: list[int], vocab_size: int, param: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise bad_request(f"Token id(s) {bad[:5]} are out of vocabulary (valid: 0..{vocab_size - 1}).",
                          param=param, code="invalid_token_id")


def bad_words_ids(words: list[str], tokenizer: Any) -> list[list[int]]:
    """vLLM's `bad_words` as token sequences: each word as written and, with a leading space
    (the word inside a text), when that is as many tokens starting with another one (vLLM's
    rule: a space that only adds a token of its own is no other word)."""
    sequences: list[list[int]] = []
    for i, word in enumerate(words):
        if not word.strip():
            raise bad_request("A bad word must not be empty.", param=f"bad_words.{i}")
        plain = list(tokenizer.encode(word.lstrip(), add_special_tokens=False))
        spaced = list(tokenizer.encode(" " + word.lstrip(), add_special_tokens=False))
        sequences.append(plain)
        if len(spaced) == len(plain) and spaced[0] != plain[0]:
            sequences.append(spaced)
    return sequences


def prediction_token_ids(prediction: Any, tokenizer: Any) -> list[int] | None:
    """OpenAI's Predicted Outputs, `{"type": "content", "content": text or text parts}`, as
    token ids (None: no prediction)."""
    if prediction is None:
        return None
    if not isinstance(prediction, dict) or prediction.get("type") != "content":
        raise bad_request("`prediction` must be {\"type\": \"content\", \"content\": ...}.",
                          param="prediction")
    content = prediction.get("content")
    if isinstance(content, list) and content and all(
            isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
            for p in content):
        content = "".join(p["text"] for p in content)
    if not isinstance(content, str):
        raise bad_request("`prediction.content` must be a string or a list of text parts.",
                          param="prediction.content")
    return list(tokenizer.encode(content, add_special_tokens=False)) or None


def prediction_usage(prediction: list[int], outputs: list[list[int]]) -> tuple[int, int]:
    """(accepted, rejected) prediction tokens over the choices: those that appear, in order, in
    a choice's tokens (the longest matching blocks, as difflib finds them), and the rest."""
    from difflib import SequenceMatcher

    accepted = 0
    for tokens in outputs:
        matcher = SequenceMatcher(None, prediction, tokens, autojunk=False)
        accepted += sum(block.size for block in matcher.get_matching_blocks())
    return accepted, len(prediction) * len(outputs) - accepted


def prompt_token_lists(prompt: Any, tokenizer: Any, limits: ModelLimits,
                       field: str = "prompt", add_special_tokens: bool = True
                       ) -> list[list[int]]:
    """The completions `prompt` (or embeddings `input`: `field`) in any of its four shapes -> one
    token-id list per prompt. Text needs `tokenizer` (None: a 400 naming the field);
    `add_special_tokens` (vLLM's request field) is the tokenizer's own (BOS, ...)."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif _is_token_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                 or all(_is_token_list(p) for p in prompt)):
        prompts = prompt
    elif prompt is None:
        raise bad_request(f"`{field}` is required.", param=field)
    else:
        raise bad_request(f"`{field}` must be a string, a list of strings, a list of token ids or "
                          "a list of token-id lists, and must not be empty.", param=field)
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request(f"The {field} is empty.", param=field, code="empty_prompt")
            if tokenizer is None:
                raise no_tokenizer(field)
            if holds_lone_surrogate(p):  # (from a JSON escape): no tokenizer takes it
                raise bad_request(f"The {field} holds {LONE_SURROGATE}.", param=field)
            ids = list(tokenizer.encode(p, add_special_tokens=add_special_tokens))
        else:
            if not p:
                raise bad_request(f"The {field} is empty.", param=field, code="empty_prompt")
            check_token_ids(p, limits.vocab_size, field)
            ids = list(p)
        if not ids:
            raise bad_request(f"The {field} tokenizes to no tokens.", param=field,
                              code="empty_prompt")
        out.append(ids)
    return out


# OpenAI's (and vLLM's) default completion length for the legacy /v1/completions API; chat's
# default is the rest of the context.
COMPLETIONS_DEFAULT_MAX_TOKENS = 16


def context_length_exceeded(max_model_len: int, prompt_len: int, prompt_param: str,
                            remedy: str = "", what: str | None = None) -> APIError:
    """OpenAI's 400 (code context_length_exceeded) for a prompt of `prompt_len` tokens that
    does not fit the model's context; `remedy` ends the advice (", or set ..."); `what` names
    the prompt in the message when it is more than `prompt_param` (a pair of texts)."""
    what = what or prompt_param
    return bad_request(
        f"This model's maximum context length is {max_model_len} tokens. However, your "
        f"{what} resulted in {prompt_len} tokens. Please reduce the length of the "
        f"{what}{remedy}.", param=prompt_param, code="context_length_exceeded")


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: ModelLimits,
                       prompt_param: str, default: int | None = None) -> int:
    """The completion budget: as asked when it fits the context, else 400; by default `default`
    (the model's max_new_tokens, see server.sampling_defaults) as far as the context allows, or
    the rest of the context (the engine stops at EOS long before, for an instruct model)."""
    room = limits.max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise context_length_exceeded(limits.max_model_len, prompt_len, prompt_param)
        return room if default is None else min(room, default)
    if requested > room:
        raise bad_request(
            f"This model's maximum context length is {limits.max_model_len} tokens. However, you "
            f"requested {prompt_len + requested} tokens ({prompt_len} in the {prompt_param}, "
            f"{requested} in the completion). Please reduce the length of the {prompt_param} or "
            "completion.", param=prompt_param, code="context_length_exceeded")
    return requested


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP:
        raise bad_request(f"At most {MAX_STOP} stop sequences are allowed.", param="stop")
    if any(not s for s in stops):
        raise bad_request("Stop sequences must be non-empty strings.", param="stop")
    return stops


def engine_fields() -> frozenset[str]:
    """The GenerationConfig fields this engine build has (decoding features land over time)."""
    return frozenset(f.name for f in dataclasses.fields(GenerationConfig))


def engine_samples_n() -> bool:
    """Whether one engine request can sample several sequences (else: one request per choice)."""
    try:
        GenerationConfig(num_return_sequences=2, do_sample=True)
    except ValueError:
        return False
    return True


def engine_config(fields: dict[str, Any], params: dict[str, str]) -> GenerationConfig:
    """GenerationConfig(**fields); a field this engine lacks, or rejects, is a 400 naming the
    request parameter (`params`: field -> parameter, for the fields whose names differ)."""
    missing = sorted(set(fields) - engine_fields())
    if missing:
        param = params.get(missing[0], missing[0])
        raise bad_request(f"`{param}` is not supported by this engine build.", param=param,
                          code="unsupported_parameter")
    try:
        return GenerationConfig(**fields)
    except ValueError as exc:
        raise engine_value_error(exc, params) from exc


def logit_bias_map(bias: dict[str, float] | None, vocab_size: int, param: str) -> dict[int, float]:
    """OpenAI's {"token id": bias} -> {token_id: bias}; ids must be in the vocabulary and biases
    in [-100, 100], as OpenAI checks."""
    out: dict[int, float] = {}
    for key, value in (bias or {}).items():
        try:
            token = int(key)
        except ValueError:
            raise bad_request(f"`{param}` keys must be token ids, got {key!r}.", param=param) from None
        if not 0 <= token < vocab_size:
            raise bad_request(f"Token id {token} in `{param}` is out of vocabulary "
                              f"(valid: 0..{vocab_size - 1}).", param=param, code="invalid_token_id")
        if not -100 <= value <= 100:
            raise bad_request(f"`{param}` values must be in [-100, 100], got {value}.", param=param)
        out[token] = float(value)
    return out


def check_logprobs_cap(value: int | None, cap: int, param: str, vocab_size: int) -> None:
    """A request's count of top alternatives against --max-logprobs (vLLM's rule: -1 counts
    as the whole vocabulary, and a cap of -1 allows that much)."""
    if value is None:
        return
    allowed = vocab_size if cap == -1 else cap
    if value == -1 and vocab_size > allowed:
        raise bad_request(f"`{param}` -1 asks for the whole vocabulary ({vocab_size} tokens); "
                          f"this server allows at most {cap} (--max-logprobs; -1 allows it).",
                          param=param)
    if value > allowed:
        limit = (f"the vocabulary size ({vocab_size})" if cap == -1
                 else f"{allowed} on this server (--max-logprobs)")
        raise bad_request(f"`{param}` must be at most {limit}, got {value}.", param=param)


def beam_search_fields(req: _SamplingRequest) -> dict[str, Any] | None:
    """GenerationConfig fields of a beam-search request (None if it does not ask for beams).

    Beam width: `num_beams` if given, else `best_of`, else `n` (vLLM's use_beam_search); the
    caller asks for the `n` best beams. Beams are deterministic, so sampling parameters are
    refused."""
    if not req.use_beam_search and (req.num_beams or 1) == 1:
        if req.length_penalty != 1.0:
            raise bad_request("`length_penalty` applies to beam search only (set use_beam_search "
                              "or num_beams).", param="length_penalty")
        if req.early_stopping is not False:
            raise bad_request("`early_stopping` applies to beam search only (set use_beam_search "
                              "or num_beams).", param="early_stopping")
        return None
    sampling = [("temperature", req.temperature is not None and req.temperature > 0),
                ("top_p", req.top_p is not None and req.top_p < 1),
                ("top_k", req.top_k not in (None, -1, 0)),
                ("min_p", bool(req.min_p)),
                ("best_of", req.best_of is not None and req.num_beams is not None
                 and req.best_of != req.num_beams)]
    for name, used in sampling:
        if used:
            raise bad_request(f"Beam search is deterministic: `{name}` cannot be used with it "
                              "(use temperature 0 and no top_p / top_k / min_p).", param=name)
    width = req.num_beams or max(req.best_of or 0, req.n)
    if req.n > width:
        raise bad_request(f"`n` ({req.n}) cannot exceed the beam width ({width}).", param="n")
    return {"num_beams": width, "do_sample": False, "temperature": 1.0,
            "length_penalty": req.length_penalty, "early_stopping": req.early_stopping}


def generation_config(req: _SamplingRequest, *, max_tokens: int, logprobs: int | None,
                      seed: int | None, limits: ModelLimits, num_return_sequences: int = 1,
                      extra: dict[str, Any] | None = None) -> GenerationConfig:
    """One engine config (one choice, or all `num_return_sequences` of them). OpenAI semantics:
    temperature defaults to 1.0 (sampling); 0 means greedy. `extra`: fields already mapped by
    the caller (beam search, best_of, structured output, prompt logprobs)."""
    temperature = 1.0 if req.temperature is None else req.temperature
    sample = temperature > 0
    stop_token_ids = list(req.stop_token_ids or [])
    check_token_ids(stop_token_ids, limits.vocab_size, "stop_token_ids")
    fields: dict[str, Any] = {
        "max_new_tokens": max_tokens, "min_new_tokens": req.min_tokens, "do_sample": sample,
        "temperature": temperature if sample else 1.0,
        "top_k": 0 if req.top_k in (None, -1) else req.top_k,
        "top_p": 1.0 if req.top_p is None else req.top_p,
        "min_p": 0.0 if req.min_p is None else req.min_p,
        "repetition_penalty": 1.0 if req.repetition_penalty is None else req.repetition_penalty,
        "presence_penalty": req.presence_penalty or 0.0,
        "frequency_penalty": req.frequency_penalty or 0.0,
        "stop": _stop_list(req.stop), "stop_token_ids": stop_token_ids,
        "ignore_eos": req.ignore_eos, "include_stop_str_in_output": req.include_stop_str_in_output,
        "skip_special_tokens": req.skip_special_tokens, "logprobs": logprobs, "seed": seed,
    }
    # Only fields that differ from "off" are passed, so an engine without a feature still
    # serves every request that does not use it.
    if req.no_repeat_ngram_size:
        fields["no_repeat_ngram_size"] = req.no_repeat_ngram_size
    if req.thinking_token_budget is not None:
        fields["thinking_token_budget"] = req.thinking_token_budget
    bias = logit_bias_map(req.logit_bias, limits.vocab_size, "logit_bias")
    if bias:
        fields["logit_bias"] = bias
    if num_return_sequences != 1:
        fields["num_return_sequences"] = num_return_sequences
    fields.update(extra or {})
    return engine_config(fields, dict(_ENGINE_TO_OPENAI))


def engine_value_error(exc: ValueError, params: Mapping[str, str] = _ENGINE_TO_OPENAI) -> APIError:
    """The engine's ValueError ("<field> must be ...") as a 400 naming the request parameter."""
    message = str(exc)
    field = message.split(" ", 1)[0].split(".", 1)[0].rstrip(":")
    # Only a field's name names a parameter: a plugin's "image could not be decoded" does not.
    param = params.get(field, field if field in _ENGINE_FIELDS else None)
    # The request's names throughout: "min_tokens must be in [0, max_tokens]", not the engine's.
    for engine_name, request_name in params.items():
        message = re.sub(rf"\b{re.escape(engine_name)}\b", request_name, message)
    return bad_request(message, param=param)


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per choice so that n > 1 with a seed gives n different but reproducible samples."""
    if seed is None:
        return [None] * n
    return [seed + i for i in range(n)]


def truncated_prompt(ids: Any, keep: int | None, max_model_len: int) -> Any:
    """`truncate_prompt` for a request: a truncation longer than the context is a 400 naming
    `truncate_prompt_tokens`."""
    try:
        return truncate_prompt(ids, keep, max_model_len)
    except ValueError as exc:
        raise bad_request(str(exc), param="truncate_prompt_tokens") from None
