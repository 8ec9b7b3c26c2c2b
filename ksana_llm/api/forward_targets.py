"""Validation of `/forward` targets: names, reduce modes, token ids and `slice_pos` ranges
(inclusive, negatives counting from the end, as KsanaLLM defines them)."""

from __future__ import annotations

from typing import Any

from ksana_llm.api.forward_outputs import FORWARD_TARGETS, TOKEN_REDUCE_MODES, ForwardTarget


def resolve_target(j: int, target: Any, n: int, vocab: int) -> tuple[ForwardTarget, list[int]]:
    """Validate `targets[j]` (a ForwardTarget or a dict) against an n-token prompt and a vocabulary
    of `vocab` ids; returns the target and its row positions. ValueError names the bad field."""
    name = f"targets[{j}]"
    if isinstance(target, dict):
        try:
            target = ForwardTarget(**target)
        except TypeError as exc:
            raise ValueError(f"{name}: {exc}") from None
    if not isinstance(target, ForwardTarget):
        raise ValueError(f"{name} must be a ForwardTarget, got {type(target).__name__}")
    if target.target_name not in FORWARD_TARGETS:
        raise ValueError(f"{name}.target_name must be one of {', '.join(FORWARD_TARGETS)}; "
                         f"got {target.target_name!r}")
    if target.token_reduce_mode not in TOKEN_REDUCE_MODES:
        raise ValueError(f"{name}.token_reduce_mode must be one of "
                         f"{', '.join(TOKEN_REDUCE_MODES)}; got {target.token_reduce_mode!r}")
    is_logits = target.target_name == "logits"
    if target.token_reduce_mode == "GATHER_TOKEN_ID":
        if not is_logits:
            raise ValueError(f"{name}.token_reduce_mode GATHER_TOKEN_ID applies to logits only")
        ids = target.token_id
        if not isinstance(ids, (list, tuple)) or not ids or not all(
                isinstance(t, int) and not isinstance(t, bool) for t in ids):
            raise ValueError(f"{name}.token_id must be a non-empty list of token ids with "
                             "GATHER_TOKEN_ID")
        vocab = vocab
        bad = [t for t in ids if not 0 <= t < vocab]
        if bad:
            raise ValueError(f"{name}.token_id must be in [0, {vocab}); got {bad[:5]}")
    elif target.token_id:
        raise ValueError(f"{name}.token_id needs token_reduce_mode GATHER_TOKEN_ID")
    top = target.input_top_logprobs_num
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
        raise ValueError(f"{name}.input_top_logprobs_num must be an integer in "
                         f"[0, {vocab}]; got {top!r}")
    if not is_logits and (top or target.token_logprobs):
        raise ValueError(f"{name}: input_top_logprobs_num and token_logprobs need "
                         "target_name logits")
    if not target.slice_pos:
        return target, list(range(n))
    positions: list[int] = []
    if not isinstance(target.slice_pos, (list, tuple)):
        raise ValueError(f"{name}.slice_pos must be a list of [start, end] pairs")
    for pair in target.slice_pos:
        if (not isinstance(pair, (list, tuple)) or len(pair) != 2
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in pair)):
            raise ValueError(f"{name}.slice_pos must be a list of [start, end] integer pairs; "
                             f"got {pair!r}")
        start, end = (v + n if v < 0 else v for v in pair)
        if not 0 <= start <= end < n:
            raise ValueError(f"{name}.slice_pos {list(pair)} is out of range for a {n}-token "
                             f"prompt (inclusive [start, end], -{n} <= pos < {n}, start <= end)")
        positions.extend(range(start, end + 1))
    return target, positions
