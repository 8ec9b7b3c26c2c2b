"""What a caller submits: a `Request` (a prompt with its own settings), and the prompt shapes the
engine takes (text, token ids as a list, numpy array or tensor, vLLM's prompt dicts)."""

from __future__ import annotations

import numbers
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.kv_transfer import TransferredKv

if TYPE_CHECKING:  # annotations only: outputs.py imports this module
    from ksana_llm.api.outputs import RequestOutput

Prompt = str | list[int]


def as_token_ids(value: Any) -> list[int] | None:
    """`value` as a prompt of token ids, if it is one: a non-empty list or tuple of integers
    (numpy's included), or a 1-D integer numpy array or torch tensor, as tokenizers return
    them. None for anything else (text, a batch, floats)."""
    if isinstance(value, (list, tuple)):
        if value and all(isinstance(t, numbers.Integral) and not isinstance(t, bool) for t in value):
            return [int(t) for t in value]
        return None
    ndim, dtype = getattr(value, "ndim", None), getattr(value, "dtype", None)
    if ndim != 1 or dtype is None or not hasattr(value, "tolist"):
        return None
    if isinstance(value, torch.Tensor):
        integer = not value.is_floating_point() and not value.is_complex() and dtype != torch.bool
    else:  # numpy, without importing it: signed or unsigned integer kinds
        integer = getattr(dtype, "kind", "") in ("i", "u")
    ids = value.tolist() if integer else []
    return [int(t) for t in ids] if ids else None


@dataclass
class Request:
    """A prompt (text or token ids) with its own settings, priority and optional callback.

    `callback(output: RequestOutput)` runs on the engine thread after every step that changed the
    request; keep it short. Lower `priority` values run first under the "priority" policy.
    `input_embeddings`: `(positions, rows)` -- rows `[len(positions), hidden_size]` replace the
    token embeddings at those prompt positions (image features, ...); such a request never shares
    KV through the prefix cache. `additional_params`: free-form values for the model's plugin.

    Prefill/decode disaggregation (single-rank engines): `export_kv=True` makes the finished
    output carry the prompt's KV (`RequestOutput.exported_kv`); another engine given it as
    `imported_kv` starts from that KV for the common prefix of the prompts, computing only the
    rest (at least the last prompt token, whose logits it samples from).

    `lora`: the name of a loaded LoRA adapter to generate with (None: the base model).

    `cache_salt` (vLLM's): a secret string that keys this request's prefix-cache entries, so
    only requests with the same salt share cached KV (nobody else can time a cache hit to learn
    whether a prompt was seen). Use a long random string per tenant.

    `prediction` (OpenAI's Predicted Outputs): text (or token ids) the output is expected to
    be much like, e.g. the file an edit rewrites. With the "ngram" speculative method, drafts
    are looked up there first; the output itself is what it would be without it.

    `prompt_embeds` (vLLM's): the whole prompt as embeddings, a float tensor `[n, hidden_size]`
    (soft prompts, another model's output), given instead of `prompt`. The model reads them in
    place of its token embeddings, as transformers' `generate(inputs_embeds=...)` does; nothing
    reads the prompt as tokens (penalties and n-gram bans see only the output), so the output's
    `prompt_token_ids` are n placeholder zeros. Such a request never shares KV through the
    prefix cache, drafts no speculative tokens, and cannot ask for prompt log-probs, export KV or
    use a plugin's pre/postprocess. Dense float32 / float16 / bfloat16 tensors only.

    `prompt_text` and `messages`: what a token-id prompt was made from -- its text, and the chat
    messages a template rendered into it -- for the model plugin's `preprocess`, which gets them
    as `prompt` and `messages` (KsanaLLM's kwargs). The server fills them: it tokenizes first.
    """

    prompt: Prompt | None = None
    generation_config: GenerationConfig | dict[str, Any] | None = None
    priority: int = 0
    callback: Callable[[RequestOutput], None] | None = None
    request_id: str | None = None
    input_embeddings: tuple[list[int], Any] | None = None
    additional_params: dict[str, Any] | None = None
    export_kv: bool = False
    imported_kv: TransferredKv | None = None
    lora: str | None = None
    cache_salt: str | None = None
    prediction: str | list[int] | None = None
    prompt_embeds: Any = None
    prompt_text: str | None = None
    messages: list[dict[str, Any]] | None = None

    @classmethod
    def of(cls, prompt: Prompt | dict[str, Any], generation_config: Any = None,
           **settings: Any) -> Request:
        """A request for `prompt`: text, token ids, or one of vLLM's prompt dicts,
        `{"prompt": text}`, `{"prompt_token_ids": ids}` or `{"prompt_embeds": tensor}`."""
        if not isinstance(prompt, dict):
            return cls(prompt, generation_config, **settings)
        keys = [k for k in _PROMPT_KEYS if k in prompt]
        if len(keys) != 1 or len(prompt) != 1:
            raise ValueError(f"a prompt dict holds exactly one of {', '.join(_PROMPT_KEYS)}; "
                             f"got keys {sorted(prompt)}")
        if keys[0] == "prompt_embeds":
            return cls(None, generation_config, prompt_embeds=prompt["prompt_embeds"], **settings)
        return cls(prompt[keys[0]], generation_config, **settings)


# vLLM's prompt dicts (TextPrompt, TokensPrompt, EmbedsPrompt), by their one key.
_PROMPT_KEYS = ("prompt", "prompt_token_ids", "prompt_embeds")
