"""Forward-only requests' records (KsanaLLM's `/forward`): what a request asks for
(`ForwardTarget`), what it gets (`ForwardOutput`), and the handle that builds it from the rows the
engine captured."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ksana_llm.api.outputs import RequestError
from ksana_llm.api.request_handle import RequestHandle

FORWARD_TARGETS = ("logits", "layernorm")
TOKEN_REDUCE_MODES = ("GATHER_ALL", "GATHER_TOKEN_ID")


@dataclass
class ForwardTarget:
    """One thing a forward-only request asks for (KsanaLLM's `request_target` names).

    `target_name`: "logits" (final logits rows, float32) or "layernorm" (the last hidden state,
    after the final norm). `slice_pos`: inclusive `[start, end]` position ranges, negatives counting
    from the end of the prompt (KsanaLLM semantics); None or [] means every position. Rows come in
    the order the ranges give them. `token_reduce_mode`: "GATHER_ALL" (whole vocab row) or
    "GATHER_TOKEN_ID" (logits only, KsanaLLM's PPL mode: at each position the probability of the
    *next prompt token*, a 1-D tensor; the last position has none, so the default positions stop
    before it). `token_id`: on "layernorm", the rows of the positions holding those ids instead of
    `slice_pos` (KsanaLLM); on "logits" with GATHER_TOKEN_ID (our extension), just those
    vocabulary entries of each row. `input_top_logprobs_num`:
    N > 0 adds the top-N `(token_id, logprob)` of each row's next-token distribution.
    `token_logprobs`: adds the log-prob of the *next actual prompt token* at each position (NaN at
    the last prompt position, which has no next token) -- the PPL building block.
    """

    target_name: str
    slice_pos: list[list[int]] | None = None
    token_id: list[int] | None = None
    token_reduce_mode: str = "GATHER_ALL"
    input_top_logprobs_num: int = 0
    token_logprobs: bool = False


@dataclass
class ForwardTargetOutput:
    target_name: str
    positions: list[int]  # absolute prompt positions of the rows, in request order
    # torch.Tensor float32 CPU: [P, vocab] | [P] (next-token probabilities) | [P, len(token_id)]
    # | [P, hidden]
    tensor: Any
    token_logprobs: Any = None  # torch.Tensor [P] float32, when asked
    top_logprobs: list[list[tuple[int, float]]] | None = None  # per row, best first, when asked


@dataclass
class ForwardOutput:
    request_id: str
    prompt_token_ids: list[int]
    targets: list[ForwardTargetOutput]

    def __getitem__(self, index: int) -> ForwardTargetOutput:
        return self.targets[index]


class ForwardHandle:
    """A submitted forward-only request: wraps its RequestHandle and turns the captured rows into
    per-target outputs on the caller's thread (the engine thread only captures rows)."""

    def __init__(self, handle: RequestHandle, targets: list[ForwardTarget],
                 target_positions: list[list[int]]) -> None:
        self.handle = handle
        self.id = handle.id
        self.targets = targets
        self.target_positions = target_positions

    @property
    def finished(self) -> bool:
        return self.handle.finished

    def _build(self) -> ForwardOutput:
        import torch

        out = self.handle.output
        result = self.handle.forward_result
        if result is None:
            raise RequestError(f"request {self.id} ended without a result "
                               f"(finish_reason {out.finish_reason!r})")
        index = {p: k for k, p in enumerate(result.positions)}
        ids = out.prompt_token_ids
        outputs = []
        for target, positions in zip(self.targets, self.target_positions):
            rows = torch.tensor([index[p] for p in positions], dtype=torch.long)
            if target.target_name == "layernorm":
                outputs.append(ForwardTargetOutput("layernorm", positions,
                                                   result.hidden.index_select(0, rows)))
                continue
            logits = result.logits.index_select(0, rows)
            item = ForwardTargetOutput("logits", positions, logits)
            next_token = target.token_reduce_mode == "GATHER_TOKEN_ID" and not target.token_id
            if target.token_reduce_mode == "GATHER_TOKEN_ID" and target.token_id:
                item.tensor = logits[:, torch.tensor(target.token_id, dtype=torch.long)]
            if target.token_logprobs or target.input_top_logprobs_num or next_token:
                logprobs = torch.log_softmax(logits, dim=-1)
                nxt = [ids[p + 1] if p + 1 < len(ids) else 0 for p in positions]
                lp = logprobs.gather(1, torch.tensor(nxt, dtype=torch.long)[:, None])[:, 0]
                if next_token:  # (positions stop before the last one: see resolve_target)
                    item.tensor = lp.exp()
                if target.token_logprobs:
                    last = torch.tensor([p + 1 >= len(ids) for p in positions], dtype=torch.bool)
                    item.token_logprobs = lp.masked_fill(last, float("nan"))
                if target.input_top_logprobs_num:
                    values, top_ids = logprobs.topk(target.input_top_logprobs_num, dim=-1)
                    item.top_logprobs = [list(zip(i, v)) for i, v in
                                         zip(top_ids.tolist(), values.tolist())]
            outputs.append(item)
        return ForwardOutput(self.id, list(ids), outputs)

    def result(self, timeout: float | None = None) -> ForwardOutput:
        self.handle.result(timeout)
        return self._build()

    async def aresult(self) -> ForwardOutput:
        await self.handle.aresult()
        return self._build()
