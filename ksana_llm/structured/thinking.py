"""A request's thinking block in the sampler: its token budget (vLLM's `thinking_token_budget`)
and structured output that starts once the model has thought.

A `ThinkingGate` stands where a grammar matcher does (the sequence's `matcher`): each step it
fills the row's token bitmask and is fed the sampled token. It follows the thinking block by its
text (`ThinkingMarkers`: the engine's `reasoning_config`), decoding a few recent tokens at a
time, so a tag the tokenizer spells over several tokens is seen as well as a special token.

- Thinking: every token is allowed until the block holds `budget` tokens; then the end text's
  tokens are forced, one a step (after those of them the model just wrote itself). Its end
  (written or forced) closes the block.
- Not thinking: the grammar, if any, rules. A request with a grammar may open its block only
  with its first token, and only where the start tag is one token (a reasoning model's
  `<think>`): that token is allowed beside the grammar's. After the block the grammar starts
  over the answer; without a grammar the model may think again, on the same budget.
- Where the prompt starts: in the block when the prompt's tail opened it (a template that
  ends with `<think>`); past it when the tail closed it (thinking turned off: `<think></think>`
  with nothing after it but whitespace), so the grammar rules from the first token. A tag the
  prompt's last tokens begin and the output finishes counts as the output's.
"""

from __future__ import annotations

import enum
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ksana_llm.structured.bitmask import allow_also, allow_only

# Prompt tokens decoded to find whether the prompt opened or closed the block.
PROMPT_TAIL_TOKENS = 64


class ThinkingState(enum.Enum):
    BEFORE = "before"  # no block yet: the model may open one
    THINKING = "thinking"
    AFTER = "after"  # the block closed (or a grammar's answer began without one)


@dataclass(frozen=True)
class ThinkingMarkers:
    """What the engine's reasoning config means for its tokenizer, made once per engine.
    `decode`: token ids to text, special tokens included."""

    start: str
    end_tag: str  # ends the block when the model writes it
    forced_end_ids: tuple[int, ...]  # what a spent budget forces
    start_token: int | None  # the start tag as one token, if it is one
    decode: Callable[[list[int]], str]

    @classmethod
    def from_tokenizer(cls, tokenizer: Any, start: str, end: str,
                       end_tag: str | None = None) -> ThinkingMarkers:
        start_ids = tokenizer.encode(start, add_special_tokens=False)
        end_ids = tokenizer.encode(end, add_special_tokens=False)
        if not end_ids:
            raise ValueError(f"reasoning_config.reasoning_end_str: {end!r} is no tokens")

        def decode(ids: list[int]) -> str:
            return tokenizer.decode(ids, skip_special_tokens=False,
                                    clean_up_tokenization_spaces=False)

        return cls(start, end_tag or end, tuple(end_ids),
                   start_ids[0] if len(start_ids) == 1 else None, decode)

    def prompt_state(self, prompt_token_ids: list[int]) -> ThinkingState:
        """Where a request whose prompt is `prompt_token_ids` starts (see the module's doc)."""
        tail = self.decode(prompt_token_ids[-PROMPT_TAIL_TOKENS:]) if prompt_token_ids else ""
        opened, closed = tail.rfind(self.start), tail.rfind(self.end_tag)
        if opened > closed:
            return ThinkingState.THINKING
        if closed > opened and not tail[closed + len(self.end_tag):].strip():
            return ThinkingState.AFTER
        return ThinkingState.BEFORE


class ThinkingGate:
    """One sequence's thinking block and what constrains its tokens (the matcher protocol of
    `structured.GrammarMatcher`: fill_bitmask, accept_token, is_terminated, fork).

    `grammar`: the request's structured output matcher, for the answer; `budget`: the most
    tokens the block may hold (None: no cap)."""

    def __init__(self, markers: ThinkingMarkers, state: ThinkingState, *,
                 grammar: Any = None, budget: int | None = None) -> None:
        self.markers = markers
        self.grammar = grammar
        self.budget = budget
        if grammar is not None and state is ThinkingState.BEFORE and markers.start_token is None:
            state = ThinkingState.AFTER  # only a one-token tag may open the block (see above)
        self.thought = 0  # tokens in the block so far (all blocks: one budget)
        self.forcing: int | None = None  # index into forced_end_ids once the budget is spent
        self._recent: list[int] = []  # the tokens since the state changed, for the tag search
        self._first = True  # no token accepted yet
        self._enter(state)

    # -- the matcher protocol -------------------------------------------------------------------

    def fill_bitmask(self, bitmask: torch.Tensor, index: int) -> None:
        """Row `index` of an all-allowing bitmask gets this step's constraint."""
        if self.state is ThinkingState.THINKING:
            if self.forcing is not None:
                allow_only(bitmask, index, self.markers.forced_end_ids[self.forcing])
            return
        if self.grammar is None:
            return
        self.grammar.fill_bitmask(bitmask, index)
        if self.state is ThinkingState.BEFORE:
            allow_also(bitmask, index, self.markers.start_token)

    def accept_token(self, token_id: int) -> bool:
        """Advance by one token; False only when the grammar refuses it."""
        first, self._first = self._first, False
        if self.state is ThinkingState.THINKING:
            self._think(token_id)
            return True
        if self.grammar is not None:
            if self.state is ThinkingState.BEFORE:
                if first and token_id == self.markers.start_token:
                    self._enter(ThinkingState.THINKING)
                    return True
                self._enter(ThinkingState.AFTER)
            return self.grammar.accept_token(token_id)
        if self._seen(token_id, self.markers.start):  # no grammar: a block may open any time
            self._enter(ThinkingState.THINKING)
        return True

    def is_terminated(self) -> bool:
        return self.grammar is not None and self.state is ThinkingState.AFTER \
            and self.grammar.is_terminated()

    def fork(self) -> ThinkingGate:
        """An independent copy at the same position (a parallel sample)."""
        twin = ThinkingGate(self.markers, self.state, budget=self.budget,
                            grammar=self.grammar.fork() if self.grammar is not None else None)
        twin.thought, twin.forcing, twin._first = self.thought, self.forcing, self._first
        twin._recent = list(self._recent)
        return twin

    def carry_prompt_tail(self, prompt_token_ids: list[int]) -> None:
        """Start the tag search with the prompt's last tokens, short of a whole tag: a tag the
        prompt begins and the output finishes (`...</thi` then `nk>`) is then seen."""
        wanted = self.markers.end_tag if self.state is ThinkingState.THINKING \
            else self.markers.start
        tail = list(prompt_token_ids[-(len(wanted) + 1):])
        while tail and wanted in self.markers.decode(tail):
            del tail[0]  # (a whole tag there already made the state)
        self._recent = tail
        if self.forcing is not None:  # spent at the start (a budget of 0): the rest of the end
            self.forcing = self._end_begun()

    # -- the block ---------------------------------------------------------------------------

    def _think(self, token_id: int) -> None:
        if self.forcing is not None:
            self.forcing += 1
            if self.forcing == len(self.markers.forced_end_ids):
                self._enter(ThinkingState.AFTER)
            return
        if self._seen(token_id, self.markers.end_tag):
            self._enter(ThinkingState.AFTER)
        else:
            self.thought += 1
            self._force_end_if_spent()

    def _force_end_if_spent(self) -> None:
        if self.budget is not None and self.thought >= self.budget:
            self.forcing = self._end_begun()

    def _end_begun(self) -> int:
        """How many of the forced end's tokens the block already ends with: a budget spent
        while the model was writing the end itself goes on from there rather than starting
        the end over ("</" then "</think>")."""
        ids, recent = self.markers.forced_end_ids, self._recent
        for m in range(min(len(ids) - 1, len(recent)), 0, -1):
            if tuple(recent[-m:]) == ids[:m]:
                return m
        return 0

    def _seen(self, token_id: int, text: str) -> bool:
        """Whether the tokens since the last change, with `token_id`, spell `text`. Only the
        last few are decoded: a token holds at least one character."""
        self._recent.append(token_id)
        del self._recent[:-(len(text) + 2)]
        return text in self.markers.decode(self._recent)

    def _enter(self, state: ThinkingState) -> None:
        self.state, self.forcing, self._recent = state, None, []
        if state is ThinkingState.THINKING:
            self._force_end_if_spent()  # a budget of 0, or spent by an earlier block


def thinking_gate(markers: ThinkingMarkers, prompt_token_ids: list[int], *, grammar: Any = None,
                  budget: int | None = None) -> ThinkingGate:
    """The gate of a request with this prompt, grammar and budget."""
    gate = ThinkingGate(markers, markers.prompt_state(prompt_token_ids), grammar=grammar,
                        budget=budget)
    gate.carry_prompt_tail(prompt_token_ids)
    return gate


__all__ = ["PROMPT_TAIL_TOKENS", "ThinkingGate", "ThinkingMarkers", "ThinkingState",
           "thinking_gate"]
