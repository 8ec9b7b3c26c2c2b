"""Beam search for one request, step for step what `transformers` beam search does.

The engine runs the beams as ordinary sequences (forked from one another, sharing KV blocks); this
module only decides, from the beams' log-probs at one step, which (beam, token) continuations
live on and which finished hypotheses are kept. It mirrors `GenerationMixin._beam_search` of
transformers 5.x for one batch item, with the same float32 tensor arithmetic and the same order
of `topk` calls, so sequences and `sequences_scores` match:

- every step keeps the top K = max(2, 1 + #stop tokens) * num_beams continuations over all beams
  (accumulated processed log-probs); the best num_beams of those that did not stop run on;
- a continuation that stops (a stop token, a stop string ending in its last token -- the
  engine's `stop_string` callback, as transformers' `StopStringCriteria` -- or the length limit)
  among the first num_beams of the K becomes a finished hypothesis scored
  sum_logprobs / generated_len ** length_penalty, the generated length counting the stopping
  token; the num_beams best hypotheses are kept;
- `early_stopping`: True ends once num_beams hypotheses are finished; False and "never" end when
  the heuristic says the best running beam can no longer beat the worst kept hypothesis
  ("never" assumes, with a positive length penalty, that it could still grow to the length limit).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# transformers' "impossible" score: added to candidates that must not be chosen.
NEG = -1.0e9


def length_normalized(scores: torch.Tensor, length: int, penalty: float) -> torch.Tensor:
    """`scores / length ** penalty`, transformers' beam score, with the power taken as Python
    takes it (so scores match transformers') but never raising: a penalty that overflows the
    power (about 100 on a 1,000-token answer; transformers raises OverflowError there) divides by
    inf, giving -0.0; one that underflows it to 0 gives -inf, and a sure answer's 0 / 0 stays 0
    (a NaN would win every `topk`)."""
    try:
        divisor = float(length) ** penalty
    except OverflowError:
        divisor = math.inf
    return torch.nan_to_num(scores / divisor, nan=0.0, posinf=math.inf, neginf=-math.inf)


@dataclass
class Hypothesis:
    """A finished beam."""

    token_ids: list[int]  # generated tokens, the stop token included
    score: float  # sum_logprob / len(token_ids) ** length_penalty: transformers' sequences_scores
    sum_logprob: float  # summed processed log-probs of the tokens
    finish_reason: str  # "stop" (a stop token or string) or "length"
    logprobs: list[dict[str, Any]] | None = None  # per-token entries, when asked
    stop_string: str | None = None  # the stop string it ended on, if any


# finalize(parent beam index, token, score, sum_logprob, stop string or None) -> the Hypothesis.
Finalize = Callable[[int, int, float, float, "str | None"], Hypothesis]
# stop_string(parent beam index, token) -> the stop string that continuation ends on, or None.
StopString = Callable[[int, int], "str | None"]


class BeamSearch:
    """The search state of one request: running beam scores and the kept hypotheses."""

    def __init__(self, *, num_beams: int, length_penalty: float, early_stopping: bool | str,
                 max_generated: int, stop_token_ids: list[int]) -> None:
        self.num_beams = num_beams
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.max_generated = max_generated  # the length limit, in generated tokens
        self.stop_token_ids = torch.tensor(sorted(set(stop_token_ids)), dtype=torch.int64)
        self.beams_to_keep = max(2, 1 + len(set(stop_token_ids))) * num_beams
        # Running beams' accumulated scores, in the order of the engine's live beams. The first
        # step has one beam (the prompt): transformers' other initial beams score -1e9, so they
        # never contribute a candidate.
        self.running_scores = torch.zeros(1, dtype=torch.float32)
        # Kept hypotheses: num_beams slots sorted best first, empty slots at -1e9 (not finished).
        self.pool_scores = torch.full((num_beams,), NEG, dtype=torch.float32)
        self.pool_finished = torch.zeros(num_beams, dtype=torch.bool)
        self.pool: list[Hypothesis | None] = [None] * num_beams
        self.improvement_possible = True
        self.kept_sum_logprobs = torch.zeros(0, dtype=torch.float32)
        self.num_generated = 0
        self.done = False
        # Log-prob rows received for the current step, by live beam (set by the engine).
        self.rows: dict[Any, tuple[torch.Tensor, torch.Tensor]] = {}

    def step(self, log_probs: torch.Tensor, finalize: Finalize,
             stop_string: StopString | None = None) -> list[tuple[int, int]]:
        """Advance by one token. `log_probs` [beams, V]: each live beam's processed log-probs,
        in live-beam order. Returns the next live beams as (parent beam index, token), best first
        (the order the engine must keep for the next step); `done` tells whether to stop."""
        vocab = log_probs.shape[1]
        accumulated = (log_probs.float() + self.running_scores.to(log_probs.device)[:, None])
        k = min(self.beams_to_keep, accumulated.numel())
        topk_scores, topk_index = torch.topk(accumulated.reshape(-1), k)
        topk_scores, topk_index = topk_scores.cpu(), topk_index.cpu()
        parents, tokens = topk_index // vocab, topk_index % vocab
        generated = self.num_generated + 1
        hits = torch.isin(tokens, self.stop_token_ids) | (generated >= self.max_generated)
        # Stop strings: only the K candidates are checked (the host decodes their tails).
        strings: list[str | None] = [None] * k
        if stop_string is not None:
            strings = [stop_string(int(p), int(t)) for p, t in zip(parents, tokens)]
            hits |= torch.tensor([s is not None for s in strings], dtype=torch.bool)

        # Running beams: the best num_beams continuations that did not stop.
        running = topk_scores + hits.to(torch.float32) * NEG
        keep = torch.topk(running, min(self.num_beams, k))[1]
        next_scores = running[keep]
        # The kept continuations' own summed log-probs (no stop mask): what they score should
        # they have to be the answer (`running` of the engine's `_finish_beams`).
        self.kept_sum_logprobs = topk_scores[keep]

        # Finished hypotheses: only the first num_beams of the K may finish.
        top_mask = torch.arange(k) < self.num_beams
        just_finished = hits & top_mask
        candidates = length_normalized(topk_scores, generated, self.length_penalty)
        pool_full = bool(self.pool_finished.all()) and self.early_stopping is True
        candidates += torch.tensor(float(pool_full)) * NEG
        candidates += torch.tensor(float(not self.improvement_possible)) * NEG
        candidates += (~just_finished) * NEG
        merged_scores = torch.cat((self.pool_scores, candidates))
        merged_finished = torch.cat((self.pool_finished, just_finished))
        chosen = torch.topk(merged_scores, self.num_beams)[1].tolist()
        pool: list[Hypothesis | None] = []
        for j in chosen:
            if j < self.num_beams:
                pool.append(self.pool[j])
            elif merged_finished[j]:
                c = j - self.num_beams
                pool.append(finalize(int(parents[c]), int(tokens[c]), float(candidates[c]),
                                     float(topk_scores[c]), strings[c]))
            else:
                pool.append(None)  # an unfinished filler, as transformers keeps it
        self.pool = pool
        self.pool_scores = merged_scores[chosen]
        self.pool_finished = merged_finished[chosen]
        self.num_generated = generated

        # Can a running beam still beat the worst kept hypothesis?
        if self.early_stopping == "never" and self.length_penalty > 0.0:
            best_length = self.max_generated
        else:
            best_length = generated
        best_possible = length_normalized(next_scores[:1], best_length, self.length_penalty)
        worst = torch.where(self.pool_finished, self.pool_scores.min(), NEG)
        self.improvement_possible = self.improvement_possible and bool((best_possible > worst).any())
        all_finished = bool(self.pool_finished.all()) and self.early_stopping is True
        self.done = not self.improvement_possible or all_finished or bool(hits.all())
        self.running_scores = next_scores
        return [(int(parents[i]), int(tokens[i])) for i in keep.tolist()]

    def results(self, num: int) -> list[Hypothesis]:
        """The best `num` finished hypotheses, best first."""
        return [h for h, done in zip(self.pool, self.pool_finished.tolist())
                if done and h is not None][:num]
