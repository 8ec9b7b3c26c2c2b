"""Engine-wide logits processors for the tests (importable by path, as `--logits-processors`
takes them): each records what it was given, so a test can check which rows reached it."""

from __future__ import annotations

from typing import Any

import torch

import ksana_llm as kt


class Recording(kt.LogitsProcessor):
    """Keeps (request id, sample index, output ids so far) for every row it is given, and the
    rows it was told to release."""

    def __init__(self, context: kt.LogitsProcessorContext) -> None:
        super().__init__(context)
        self.seen: list[tuple[str, int, list[int]]] = []
        self.released: list[tuple[str, int]] = []

    def record(self, rows) -> None:
        self.seen.extend((r.request_id, r.index, list(r.output_token_ids)) for r in rows)

    def release(self, row: kt.LogitsRow) -> None:
        self.released.append((row.request_id, row.index))


class BanTokens(Recording):
    """`extra_args={"ban": [ids]}`: those tokens are never produced (transformers'
    `suppress_tokens`)."""

    @classmethod
    def validate_params(cls, config: kt.GenerationConfig) -> None:
        ban = config.extra_args.get("ban")
        if ban is not None and (not isinstance(ban, list) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ban)):
            raise ValueError(f"extra_args.ban must be a list of token ids, got {ban!r}")

    def applies_to(self, config: kt.GenerationConfig) -> bool:
        return bool(config.extra_args.get("ban"))

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        self.record(rows)
        # Through a flat view, which only a contiguous tensor allows.
        flat, width = logits.view(-1), logits.shape[1]
        for i, row in enumerate(rows):
            flat[[i * width + t for t in row.extra_args["ban"]]] = float("-inf")
        return logits


class TopOne(Recording):
    """`extra_args={"top_one": true}`: only the most likely token stays (a new tensor). It never
    changes the argmax, so greedy rows skip it, and a sampled row becomes greedy."""

    def applies_to(self, config: kt.GenerationConfig) -> bool:
        return bool(config.extra_args.get("top_one"))

    def is_argmax_invariant(self) -> bool:
        return True

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        self.record(rows)
        best = logits.argmax(dim=1, keepdim=True)
        return torch.full_like(logits, float("-inf")).scatter(1, best, logits.gather(1, best))


def no_repeats(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    logits[output_token_ids] = float("-inf")
    return logits


class NoRepeats(kt.PerRequestLogitsProcessor):
    """The per-request form (vLLM's AdapterLogitsProcessor): `extra_args={"no_repeats": true}`
    never produces a token twice in its output."""

    def __init__(self, context: kt.LogitsProcessorContext) -> None:
        super().__init__(context)
        self.made = 0

    def applies_to(self, config: kt.GenerationConfig) -> bool:
        return bool(config.extra_args.get("no_repeats"))

    def new_request_processor(self, config: kt.GenerationConfig) -> Any:
        self.made += 1
        return no_repeats


class Exploding(kt.LogitsProcessor):
    """`extra_args={"explode_at": k}`: raises when a row has k output tokens."""

    def applies_to(self, config: kt.GenerationConfig) -> bool:
        return "explode_at" in config.extra_args

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        if any(len(r.output_token_ids) == r.extra_args["explode_at"] for r in rows):
            raise RuntimeError("out of ideas")
        return logits


class Unbuildable(kt.LogitsProcessor):
    def __init__(self, context: kt.LogitsProcessorContext) -> None:
        raise RuntimeError("no GPU here")

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        return logits


class BadCheck(kt.LogitsProcessor):
    @classmethod
    def validate_params(cls, config: kt.GenerationConfig) -> None:
        config.extra_args["missing"]  # a bug: KeyError for requests without it

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        return logits


class Boost(kt.LogitsProcessor):
    """`extra_args={"boost": id}`: that token's logit is raised far above the others."""

    def applies_to(self, config: kt.GenerationConfig) -> bool:
        return "boost" in config.extra_args

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        for i, row in enumerate(rows):
            logits[i, row.extra_args["boost"]] = 1e4
        return logits


def fussy(config: kt.GenerationConfig) -> Any:
    """A per-request callable that raises once the output has `fail_at` tokens, or returns a
    tensor one short when `short_at`; otherwise leaves the logits alone."""
    fail_at, short_at = config.extra_args.get("fail_at"), config.extra_args.get("short_at")

    def process(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        if len(output_token_ids) == fail_at:
            raise KeyError("lost track")
        return logits[:-1] if len(output_token_ids) == short_at else logits
    return process


class Fussy(kt.PerRequestLogitsProcessor):
    def new_request_processor(self, config: kt.GenerationConfig) -> Any:
        return fussy(config)


class ForgetfulRelease(kt.LogitsProcessor):
    """Leaves the logits alone, and raises when told a request is done."""

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        return logits

    def release(self, row: kt.LogitsRow) -> None:
        raise RuntimeError("already forgotten")


class Undecided(kt.LogitsProcessor):
    def is_argmax_invariant(self) -> bool:
        raise NotImplementedError("ask me later")

    def apply(self, logits: torch.Tensor, rows) -> torch.Tensor:
        return logits
