"""OpenAI request parameters -> engine inputs (token ids and GenerationConfig), with every check that
must fail as a 400 *before* anything is submitted or streamed: prompt shape, vocabulary, context
length, and the engine's own GenerationConfig validation.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.server.errors import APIError, bad_request
from ksana_llm.server.openai_protocol import MAX_STOP, _SamplingRequest

# Engine field -> OpenAI parameter, so that an engine ValueError names what the client sent.
_ENGINE_TO_OPENAI = MappingProxyType({"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens",
                     "do_sample": "temperature"})


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


def prompt_token_lists(prompt: Any, tokenizer: Any, limits: ModelLimits) -> list[list[int]]:
    """The completions `prompt` in any of its four shapes -> one token-id list per prompt."""
    if isinstance(prompt, str):
        prompts: list[Any] = [prompt]
    elif _is_token_list(prompt) and prompt:
        prompts = [prompt]
    elif isinstance(prompt, list) and prompt and (all(isinstance(p, str) for p in prompt)
                                                 or all(_is_token_list(p) for p in prompt)):
        prompts = prompt
    elif prompt is None:
        raise bad_request("`prompt` is required.", param="prompt")
    else:
        raise bad_request("`prompt` must be a string, a list of strings, a list of token ids or a "
                          "list of token-id lists, and must not be empty.", param="prompt")
    out = []
    for p in prompts:
        if isinstance(p, str):
            if not p:
                raise bad_request("The prompt is empty.", param="prompt", code="empty_prompt")
            ids = list(tokenizer.encode(p))
        else:
            if not p:
                raise bad_request("The prompt is empty.", param="prompt", code="empty_prompt")
            check_token_ids(p, limits.vocab_size, "prompt")
            ids = list(p)
        if not ids:
            raise bad_request("The prompt tokenizes to no tokens.", param="prompt", code="empty_prompt")
        out.append(ids)
    return out


def resolve_max_tokens(requested: int | None, prompt_len: int, limits: ModelLimits,
                       prompt_param: str) -> int:
    """The completion budget: as asked when it fits the context, else 400; by default the rest of
    the context (the engine stops at EOS long before, for an instruct model)."""
    room = limits.max_model_len - prompt_len
    if requested is None:
        if room < 1:
            raise bad_request(
                f"This model's maximum context length is {limits.max_model_len} tokens. However, "
                f"your {prompt_param} resulted in {prompt_len} tokens. Please reduce the length of "
                f"the {prompt_param}.", param=prompt_param, code="context_length_exceeded")
        return room
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


def generation_config(req: _SamplingRequest, *, max_tokens: int, logprobs: int | None,
                      seed: int | None, limits: ModelLimits) -> GenerationConfig:
    """One engine config for one choice. OpenAI semantics: temperature defaults to 1.0 (sampling);
    0 means greedy."""
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
    try:
        return GenerationConfig(**fields)
    except ValueError as exc:
        raise engine_value_error(exc) from exc


def engine_value_error(exc: ValueError) -> APIError:
    """The engine's ValueError ("<field> must be ...") as a 400 naming the OpenAI parameter."""
    message = str(exc)
    field = message.split(" ", 1)[0]
    param = _ENGINE_TO_OPENAI.get(field, field if field.isidentifier() else None)
    if param is not None and param != field:
        message = param + message[len(field):]
    return bad_request(message, param=param)


def choice_seeds(seed: int | None, n: int) -> list[int | None]:
    """One seed per choice so that n > 1 with a seed gives n different but reproducible samples."""
    if seed is None:
        return [None] * n
    return [seed + i for i in range(n)]
