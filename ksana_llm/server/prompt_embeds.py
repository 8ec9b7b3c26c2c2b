"""The completions route's `prompt_embeds` (vLLM's, behind `--enable-prompt-embeds`): each prompt
as a tensor `[num_tokens, hidden_size]` saved with `torch.save` and base64-encoded, one string or
a list of them.

Off by default, as in vLLM: the payload is unpickled (with `weights_only=True`, which loads
tensors and plain containers only, never code), and the embeddings bypass the tokenizer. Only
dense float32 / float16 / bfloat16 tensors are taken (sparse ones are refused: densifying a
client's sparse tensor is how vLLM's CVE-2025-62164 wrote out of bounds). A request body is at
most --max-body-bytes (2 MiB by default: about 190 tokens of a 4096-wide float16 model's
embeddings, base64-encoded); raise it for longer prompts.
"""

from __future__ import annotations

import base64
import io
from typing import Any

from ksana_llm.server.errors import bad_request

PARAM = "prompt_embeds"


def decode_prompt_embeds(value: Any, hidden_size: int, enabled: bool) -> list[Any]:
    """The tensors `value` holds, on the CPU: one per prompt. A 400 naming `prompt_embeds` when
    the server does not take them or a payload is not a tensor of the model's width (the
    engine checks the rest: dtype, finiteness, length)."""
    if not enabled:
        raise bad_request("prompt_embeds needs a server started with --enable-prompt-embeds.",
                          param=PARAM)
    payloads = [value] if isinstance(value, str) else value
    if not isinstance(payloads, list) or not payloads \
            or not all(isinstance(p, str) for p in payloads):
        raise bad_request("prompt_embeds must be a base64 string (a torch.save'd tensor) or a "
                          "non-empty list of them.", param=PARAM)
    return [_tensor(p, i, hidden_size) for i, p in enumerate(payloads)]


def _tensor(payload: str, index: int, hidden_size: int) -> Any:
    import torch

    where = f"prompt_embeds[{index}]"
    try:
        raw = base64.b64decode(payload, validate=True)
        # A sparse tensor's indices are not checked by weights_only loading; with the checks
        # on, a malformed one fails here (and any sparse one is refused below, never
        # densified: its declared size could be anything).
        with torch.sparse.check_sparse_tensor_invariants():
            tensor = torch.load(io.BytesIO(raw), weights_only=True, map_location="cpu")
    except Exception as exc:  # noqa: BLE001 - torch.load fails on junk in many ways (struct,
        # zip, pickle, EOF errors...); whatever the client sent, it is the client's 400
        raise bad_request(f"{where} is not a base64-encoded torch.save'd tensor ({exc}).",
                          param=PARAM) from exc
    if not isinstance(tensor, torch.Tensor):
        raise bad_request(f"{where} holds a {type(tensor).__name__}, not a tensor.", param=PARAM)
    if tensor.layout != torch.strided or tensor.device.type != "cpu" \
            or tensor.dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise bad_request(f"{where} must be a dense float32, float16 or bfloat16 tensor, got a "
                          f"{tensor.layout} {tensor.device.type} {tensor.dtype} one.", param=PARAM)
    if tensor.dim() == 3 and tensor.shape[0] == 1:
        tensor = tensor[0]  # a batch of one
    if tensor.dim() != 2 or tensor.shape[1] != hidden_size or tensor.shape[0] == 0:
        raise bad_request(f"{where} must have shape (num_tokens, {hidden_size}) (the model's "
                          f"hidden size), got {tuple(tensor.shape)}.", param=PARAM)
    return tensor
