"""Validation of `/forward` targets: names, reduce modes, token ids and `slice_pos` ranges
(inclusive, negatives counting from the end, as KsanaLLM defines them)."""

from __future__ import annotations

from typing import Any

from ksana_llm.api.forward_outputs import FORWARD_TARGETS, TOKEN_REDUCE_MODES, ForwardTarget


def resolve_target(j: int, target: Any, prompt_ids: list[int], vocab: int
                   ) -> tuple[ForwardTarget, list[int]]:
    """Validate `targets[j]` (a ForwardTarget or a dict) against a prompt and a vocabulary of
    `vocab` ids; returns the target and its row positions. ValueError names the bad field."""
    name = f"targets[{j}]"
    n = len(prompt_ids)
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
    if target.token_id:
        _check_token_ids(name, target.token_id, vocab)
    next_token = is_logits and target.token_reduce_mode == "GATHER_TOKEN_ID" and not target.token_id
    if target.token_reduce_mode == "GATHER_TOKEN_ID" and not is_logits:
        raise ValueError(f"{name}.token_reduce_mode GATHER_TOKEN_ID applies to logits only")
    if target.token_id and is_logits and target.token_reduce_mode != "GATHER_TOKEN_ID":
        raise ValueError(f"{name}.token_id needs token_reduce_mode GATHER_TOKEN_ID on logits")
    top = target.input_top_logprobs_num
    if isinstance(top, bool) or not isinstance(top, int) or not 0 <= top <= vocab:
        raise ValueError(f"{name}.input_top_logprobs_num must be an integer in "
                         f"[0, {vocab}]; got {top!r}")
    if not is_logits and (top or target.token_logprobs):
        raise ValueError(f"{name}: input_top_logprobs_num and token_logprobs need "
                         "target_name logits")
    if target.token_id and not is_logits:
        # KsanaLLM: a hidden-state target picks its rows by token id or by position, not both:
        # the rows of the positions holding one of those ids, in prompt order.
        if target.slice_pos:
            raise ValueError(f"{name}.token_id: give token_id or slice_pos, not both")
        wanted = set(target.token_id)
        positions = [p for p, t in enumerate(prompt_ids) if t in wanted]
        if not positions:
            raise ValueError(f"{name}.token_id: the prompt holds none of {sorted(wanted)[:5]}")
        return target, positions
    if not target.slice_pos:
        if next_token and n < 2:
            raise ValueError(f"{name}.token_reduce_mode GATHER_TOKEN_ID scores each next prompt "
                             "token, and a 1-token prompt has none")
        # Next-token probabilities: every position that has a next prompt token.
        return target, list(range(n - 1 if next_token else n))
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
    if next_token and n - 1 in positions:
        raise ValueError(f"{name}.slice_pos: GATHER_TOKEN_ID gives the probability of the next "
                         f"prompt token, and the last position ({n - 1}) has none")
    return target, positions


def _check_token_ids(name: str, ids: Any, vocab: int) -> None:
    if not isinstance(ids, (list, tuple)) or not all(
            isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise ValueError(f"{name}.token_id must be a list of token ids")
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{name}.token_id must be in [0, {vocab}); got {bad[:5]}")
