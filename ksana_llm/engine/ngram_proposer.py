"""Drafts from the sequence itself (prompt lookup, vLLM's "ngram" speculative method).

Text that copies or edits its context (summaries, code edits, answers that quote the question,
structured extraction) repeats runs of tokens it has seen. The proposer looks for the sequence's
last n tokens earlier in the sequence (prompt and output), longest n first, and drafts the tokens
that followed the most recent such occurrence. The main model verifies the drafts like any other
(`engine.speculative_steps`), so greedy outputs are unchanged and sampled ones keep their
distribution; a wrong guess costs only the drafts' rows in the next forward.

Each sequence keeps an index of its n-grams (n-gram -> where its latest occurrence ends), grown
by the tokens added since its last lookup: a lookup costs the new tokens, not the whole history.

A request may also bring a prediction of its output (OpenAI's Predicted Outputs: the file being
edited, the answer expected): its n-grams are indexed once, and the sequence's last tokens are
looked up there first, in reading order (the first occurrence at or after where the last drafts
from it started), so the drafts follow the prediction through repeats.
"""

from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass, field


@dataclass
class NgramIndex:
    """One sequence's n-grams of every size in [min_n, max_n]: n-gram -> end (exclusive) of its
    latest occurrence among the first `indexed` positions."""

    ends: dict[tuple[int, ...], int] = field(default_factory=dict)
    indexed: int = 0  # n-grams ending at or before this position are in `ends`


@dataclass
class ReferenceIndex:
    """A fixed token list's n-grams: n-gram -> the ends (exclusive) of all its occurrences,
    ascending; `cursor`: where the last drafts taken from it started."""

    tokens: tuple[int, ...]
    ends: dict[tuple[int, ...], list[int]]
    cursor: int = 0


@dataclass(frozen=True)
class NgramProposer:
    min_n: int = 1
    max_n: int = 4

    def __post_init__(self) -> None:
        if not 1 <= self.min_n <= self.max_n:
            raise ValueError(f"prompt_lookup_min ({self.min_n}) must be in [1, prompt_lookup_max "
                             f"({self.max_n})]")

    def propose(self, tokens: list[int], index: NgramIndex, num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens that followed the latest earlier occurrence of the longest
        n-gram (n in [min_n, max_n]) that ends `tokens`; [] when none occurs earlier."""
        length = len(tokens)
        # Index the n-grams ending before the last position (the suffix itself must not match
        # itself).
        for end in range(max(index.indexed + 1, self.min_n), length):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                index.ends[tuple(tokens[end - n:end])] = end
        index.indexed = max(index.indexed, length - 1)
        for n in range(min(self.max_n, length - 1), self.min_n - 1, -1):
            end = index.ends.get(tuple(tokens[length - n:]))
            if end is not None:
                return tokens[end:end + num_drafts]
        return []

    def index_reference(self, tokens: list[int]) -> ReferenceIndex:
        ends: dict[tuple[int, ...], list[int]] = {}
        for end in range(self.min_n, len(tokens) + 1):
            for n in range(self.min_n, min(self.max_n, end) + 1):
                ends.setdefault(tuple(tokens[end - n:end]), []).append(end)
        return ReferenceIndex(tuple(tokens), ends)

    def propose_from_reference(self, tokens: list[int], reference: ReferenceIndex,
                               num_drafts: int) -> list[int]:
        """Up to `num_drafts` tokens that follow, in `reference`, the longest n-gram that ends
        `tokens` (its first occurrence at or after the cursor, else its last); [] when none
        occurs there with anything after it."""
        for n in range(min(self.max_n, len(tokens)), self.min_n - 1, -1):
            ends = reference.ends.get(tuple(tokens[len(tokens) - n:]))
            if not ends:
                continue
            i = bisect_left(ends, reference.cursor)
            end = ends[i] if i < len(ends) else ends[-1]
            drafts = list(reference.tokens[end:end + num_drafts])
            if drafts:
                reference.cursor = end
                return drafts
        return []
