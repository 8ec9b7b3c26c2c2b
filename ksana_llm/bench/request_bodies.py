"""The body of one benchmark request, per backend: KsanaLLM's /generate with its
`sampling_config` keys, or /v1/completions with the OpenAI/vLLM names of the same settings."""

from __future__ import annotations

import json
from typing import Any

from ksana_llm.bench.flags import OPENAI_BACKENDS, BenchConfig


def build_request(cfg: BenchConfig, prompt: str | list[int], max_new_tokens: int | None = None
                  ) -> tuple[str, dict[str, Any]]:
    """(path, JSON body) of one request for the configured backend; a prompt is text or token
    ids (sent as `input_tokens` to /generate)."""
    max_new_tokens = max_new_tokens or cfg.max_new_tokens
    if cfg.backend in OPENAI_BACKENDS:
        return "/v1/completions", _openai_body(cfg, prompt, max_new_tokens)
    return "/generate", _ksana_body(cfg, prompt, max_new_tokens)


def chat_messages_text(prompt: str) -> str:
    """A prompt as `use_chat_template` reads it, the JSON text of a message list: as it is when it
    is one already, else a plain prompt as one user message."""
    try:
        messages = json.loads(prompt)
    except ValueError:
        messages = None
    if isinstance(messages, list) and all(isinstance(m, dict) for m in messages) and messages:
        return prompt
    return json.dumps([{"role": "user", "content": prompt}], ensure_ascii=False)


def _ksana_body(cfg: BenchConfig, prompt: str | list[int], max_new_tokens: int) -> dict[str, Any]:
    """KsanaLLM's /generate body: every sampling key its client sends, with its names."""
    sampling = {
        "max_new_tokens": max_new_tokens, "temperature": cfg.temperature, "topk": cfg.topk,
        "topp": cfg.topp, "repetition_penalty": cfg.repetition_penalty,
        "num_beams": cfg.num_beams, "num_return_sequences": 1,
        "length_penalty": cfg.length_penalty, "no_repeat_ngram_size": cfg.no_repeat_ngram_size,
        "encoder_no_repeat_ngram_size": cfg.encoder_no_repeat_ngram_size,
        "decoder_no_repeat_ngram_size": cfg.decoder_no_repeat_ngram_size,
        "logprobs": cfg.logprobs, "stop_token_ids": list(cfg.stop_token_ids),
        "stop_strings": list(cfg.stop_strings), "ignore_eos": cfg.ignore_eos,
    }
    if cfg.chat_template and isinstance(prompt, str):
        prompt = chat_messages_text(prompt)
    key = "prompt" if isinstance(prompt, str) else "input_tokens"
    body: dict[str, Any] = {key: prompt, "sampling_config": sampling, "stream": cfg.stream}
    if cfg.model_type is not None:
        body["model_type"] = cfg.model_type
    if cfg.chat_template:
        body["use_chat_template"] = True
    if cfg.structured_output_regex:
        body["structured_output_regex"] = cfg.structured_output_regex
    return body


def _openai_body(cfg: BenchConfig, prompt: str | list[int], max_new_tokens: int
                 ) -> dict[str, Any]:
    """/v1/completions with the OpenAI/vLLM equivalents of KsanaLLM's sampling flags (top_k,
    repetition_penalty, stop_token_ids, ignore_eos, guided_regex are vLLM's extra parameters)."""
    if isinstance(prompt, str):
        prompt = cfg.prompt_affix[0] + prompt + cfg.prompt_affix[1]
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_new_tokens,
                            "temperature": cfg.temperature, "top_p": cfg.topp,
                            "repetition_penalty": cfg.repetition_penalty, "stream": cfg.stream}
    if cfg.model:
        body["model"] = cfg.model
    if cfg.num_beams > 1:  # this server's extension (config_from_args refuses it for vllm)
        body.update(use_beam_search=True, num_beams=cfg.num_beams)
    if cfg.num_beams == 1 or cfg.topk != 1:  # beams take no top_k (the server names a conflict)
        body["top_k"] = cfg.topk  # KsanaLLM's default 1 is greedy, as on /generate
    if cfg.length_penalty != 1.0:
        body["length_penalty"] = cfg.length_penalty
    if cfg.no_repeat_ngram_size:
        body["no_repeat_ngram_size"] = cfg.no_repeat_ngram_size
    if cfg.logprobs:
        body["logprobs"] = cfg.logprobs
    if cfg.stop_strings:
        body["stop"] = list(cfg.stop_strings)
    if cfg.stop_token_ids:
        body["stop_token_ids"] = list(cfg.stop_token_ids)
    if cfg.ignore_eos:
        body["ignore_eos"] = True
    if cfg.structured_output_regex:
        body["guided_regex"] = cfg.structured_output_regex
    if cfg.stream:
        body["stream_options"] = {"include_usage": True}
    return body
