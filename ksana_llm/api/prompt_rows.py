"""A prompt's rows before it becomes a sequence: vLLM's `truncate_prompt_tokens`, and the
embedding rows a request brings (`Request.prompt_embeds`, the whole prompt; `input_embeddings`,
rows replacing some tokens' embeddings), checked and moved to the model's device and dtype.
Split from `api/request_builder.py`; every check raises ValueError naming the field."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ksana_llm.api.model import Model
    from ksana_llm.api.outputs import Request

# What prompt embeddings may be (vLLM's rule): the model's own float types, not float8 codes.
_EMBEDDING_DTYPES = ("float32", "float16", "bfloat16")


def truncate_prompt(ids: Any, keep: int | None, max_model_len: int) -> Any:
    """vLLM's `truncate_prompt_tokens`: the prompt's last `keep` tokens (-1: as many as the
    model's context holds); `ids` may be token ids or a prompt's embedding rows. More than the
    context holds is a ValueError, as in vLLM (it could only mean a wrong setting)."""
    if keep == -1:
        keep = max_model_len
    elif keep is not None and keep > max_model_len:
        raise ValueError(f"truncate_prompt_tokens ({keep}) is greater than max_model_len "
                         f"({max_model_len}): select a smaller truncation size, or -1 to keep "
                         "as many tokens as the context holds")
    return ids if keep is None or len(ids) <= keep else ids[-keep:]


def prompt_embeds_rows(request: Request, keep: int | None, model: Model, max_model_len: int
                       ) -> tuple[list[int], tuple[list[int], Any]]:
    """`Request.prompt_embeds` (its last `keep` rows: truncate_prompt_tokens) -> placeholder
    token ids, and the embeddings replacing them all (on the model's device and dtype)."""
    import torch

    if request.prompt is not None or request.input_embeddings is not None:
        raise ValueError("prompt_embeds is the whole prompt: give it without prompt and "
                         "input_embeddings")
    rows = request.prompt_embeds
    hidden = int(model.hf_config.hidden_size)
    if isinstance(rows, torch.Tensor) and rows.dim() == 3 and rows.shape[0] == 1:
        rows = rows[0]  # a batch of one, as transformers takes inputs_embeds
    if not isinstance(rows, torch.Tensor) or rows.dim() != 2 or rows.shape[1] != hidden \
            or str(rows.dtype).removeprefix("torch.") not in _EMBEDDING_DTYPES \
            or rows.shape[0] == 0 \
            or rows.layout != torch.strided or rows.device.type == "meta":
        got = (f"a {rows.layout} {rows.device.type} {rows.dtype} tensor of shape "
               f"{tuple(rows.shape)}" if isinstance(rows, torch.Tensor)
               else type(rows).__name__)
        raise ValueError(f"prompt_embeds must be a dense float32, float16 or bfloat16 "
                         f"tensor of shape (num_tokens, {hidden}) (hidden_size), got {got}")
    if not bool(torch.isfinite(rows).all()):
        raise ValueError("prompt_embeds must hold finite values (no NaN or inf)")
    rows = truncate_prompt(rows, keep, max_model_len)
    rows = rows.detach().to(model.device, model.dtype)
    return [0] * rows.shape[0], (list(range(rows.shape[0])), rows)

def input_embedding_rows(value: Any, num_tokens: int, model: Model
                         ) -> tuple[list[int], Any] | None:
    """`Request.input_embeddings` -> (positions, rows on the model's device and dtype)."""
    if value is None:
        return None
    import torch

    hidden = int(model.hf_config.hidden_size)
    try:
        positions, rows = value
    except (TypeError, ValueError):
        raise ValueError("input_embeddings must be (positions, tensor of [len(positions), "
                         "hidden_size])") from None
    if not isinstance(positions, (list, tuple)) or not positions or not all(
            isinstance(p, int) and not isinstance(p, bool) and 0 <= p < num_tokens
            for p in positions) or len(set(positions)) != len(positions):
        raise ValueError(f"input_embeddings positions must be distinct prompt positions in "
                         f"[0, {num_tokens}), got {positions!r}")
    if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (len(positions), hidden):
        shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
        raise ValueError(f"input_embeddings rows must be a tensor of shape "
                         f"({len(positions)}, {hidden}), got {shape}")
    if not bool(torch.isfinite(rows).all()):
        # A NaN would reach the KV cache, and attention over a block's unused slots reads them.
        raise ValueError("input_embeddings rows must hold finite values (no NaN or inf)")
    return list(positions), rows.detach().to(model.device, model.dtype)
