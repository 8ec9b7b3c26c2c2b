"""Structured output in the sampler: each step, the rows with a grammar matcher
(`ksana_llm.structured.GrammarMatcher`) get the tokens their grammar refuses masked to -inf
before any processor runs, again after the Python processors (which may raise any logit), and a
row the processors left with no token at all falls back to the grammar's choices alone."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ksana_llm.runner.logits_processing import to_device

if TYPE_CHECKING:  # only for annotations: the sampler imports this module
    from ksana_llm.runner.sampler import SamplingRow

__all__ = ["apply_grammar_masks", "keep_grammar_choices", "remask_grammar_rows"]


def apply_grammar_masks(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    """Mask each matcher row's disallowed tokens to -inf; returns a float32 copy when any row has
    a matcher (the caller's tensor is never modified), else `logits` itself."""
    constrained = [i for i, row in enumerate(rows) if row.matcher is not None]
    if not constrained:
        return logits
    # Imported here: xgrammar is only loaded once a request asks for structured output.
    from ksana_llm.structured import allocate_bitmask, apply_bitmask

    out = logits.to(torch.float32, copy=True)
    bitmask = allocate_bitmask(len(rows), out.shape[1])  # every token allowed
    for i in constrained:
        rows[i].matcher.fill_bitmask(bitmask, i)
    # Applied to every row (the others' masks allow everything): no row-index list to copy to
    # the device, which might wait for the forward queued before it.
    apply_bitmask(out, bitmask)
    return out


def remask_grammar_rows(processed: torch.Tensor, grammar_masked: torch.Tensor,
                        rows: list[SamplingRow]) -> torch.Tensor:
    """`processed` with the grammar's refused tokens back at -inf in the matcher rows: Python
    processors (the engine's and the request's own) may have raised any logit, and structured
    output must still win. The built-in processors never raise a -inf: nothing to do then."""
    revivable = [row.matcher is not None and (bool(row.engine_processors)
                                             or bool(row.custom_processors)) for row in rows]
    if not any(revivable):
        return processed
    refused = torch.isneginf(grammar_masked)
    refused &= to_device(revivable, torch.bool, processed.device).unsqueeze(1)
    return processed.masked_fill_(refused, float("-inf"))


def keep_grammar_choices(processed: torch.Tensor, grammar_masked: torch.Tensor) -> torch.Tensor:
    """Rows the processors left with no token at all fall back to the grammar's choices alone.

    That happens when min_new_tokens holds back the end of a complete document (the grammar then
    allows only the stop tokens) or a bad word is the grammar's only way on. Structured output's
    promise (the text matches) wins over those softer constraints, as the request could otherwise
    only go on with a token the grammar refuses. Decided on the device: no host sync."""
    stuck = torch.isneginf(processed).all(dim=1, keepdim=True)
    return torch.where(stuck, grammar_masked.float(), processed)
