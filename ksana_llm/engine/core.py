"""EngineCore.step(): schedule -> run -> sample -> update -> outputs. Single-threaded, no asyncio.

The core owns the scheduler, the block manager, the model runner and the sampler. Callers feed it
validated `Sequence`s and read back `StepOutput` deltas; the Python API and the server run it in
a background thread (see `ksana_llm.api`).
"""

from __future__ import annotations

import bisect
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from ksana_llm.engine.detokenizer import IncrementalDetokenizer
from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.request import FinishReason, Sequence
from ksana_llm.engine.scheduler import Scheduler, SchedulerConfig
from ksana_llm.runner.model_runner import CapturedRows, ModelRunner, SeqSlice, StepInput
from ksana_llm.runner.sampler import Sampler, SamplingRow, make_generator


@dataclass(frozen=True)
class ForwardResult:
    """A forward-only request's captured rows, on the CPU, in `ForwardSpec.positions` order."""

    positions: list[int]
    hidden: Any  # torch.Tensor [P, hidden] float32 (after the final norm), or None
    logits: Any  # torch.Tensor [P, vocab] float32, or None


# stop_reason of a request that expired in the waiting queue.
TIMEOUT_STOP_REASON = "timeout"


@dataclass
class StepOutput:
    """What one step added to one request."""

    request_id: str
    new_token_ids: list[int]
    text_delta: str
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None
    new_logprobs: list[dict[str, Any]] = field(default_factory=list)
    forward: ForwardResult | None = None  # set on the (only) output of a forward-only request
    first_scheduled_time: float | None = None  # time.monotonic() when it first got compute


@dataclass(frozen=True)
class CoreStats:
    num_waiting: int
    num_running: int
    num_swapped: int
    kv_cache_usage: float
    num_free_blocks: int
    num_blocks: int
    num_preemptions: int
    prefix_cache_queries: int
    prefix_cache_hits: int


class EngineCore:
    def __init__(self, runner: ModelRunner, block_manager: BlockManager,
                 scheduler_config: SchedulerConfig, tokenizer: Any, *, max_model_len: int,
                 sampler: Sampler | None = None) -> None:
        self.runner = runner
        self.block_manager = block_manager
        self.scheduler = Scheduler(scheduler_config, block_manager)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.sampler = sampler or Sampler()
        self.sequences: dict[str, Sequence] = {}
        self.detokenizers: dict[str, IncrementalDetokenizer] = {}
        self.num_generated_tokens = 0
        self.num_prompt_tokens = 0

    # ---- requests ------------------------------------------------------------------------------
    @property
    def kv_capacity_tokens(self) -> int:
        return self.block_manager.num_blocks * self.block_manager.block_size

    def add(self, seq: Sequence) -> None:
        """Queue a validated sequence (may raise QueueFullError)."""
        if seq.request_id in self.sequences:
            raise ValueError(f"request_id {seq.request_id!r} is already in use")
        self.scheduler.add(seq)
        if seq.config.seed is not None and seq.generator is None:
            seq.generator = make_generator(seq.config.seed, self.runner.device)
        self.sequences[seq.request_id] = seq
        self.detokenizers[seq.request_id] = IncrementalDetokenizer(
            self.tokenizer, seq.prompt_token_ids,
            skip_special_tokens=seq.config.skip_special_tokens, stop=seq.config.stop,
            include_stop_str_in_output=seq.config.include_stop_str_in_output)

    def abort(self, request_id: str) -> StepOutput | None:
        seq = self.sequences.get(request_id)
        if seq is None:
            return None
        seq.finish_reason = FinishReason.ABORT
        return self._finish(seq, [], "")

    def has_work(self) -> bool:
        return self.scheduler.has_work()

    def stats(self) -> CoreStats:
        s, bm = self.scheduler, self.block_manager
        return CoreStats(len(s.waiting), len(s.running), len(s.swapped), bm.usage,
                         bm.num_free_blocks, bm.num_blocks, s.num_preemptions,
                         bm.prefix_queries, bm.prefix_hits)

    # ---- one step ------------------------------------------------------------------------------
    def expire_waiting(self, timeout_s: float) -> list[StepOutput]:
        """Finish (finish_reason "abort", stop_reason "timeout") the requests that waited longer
        than `timeout_s` without ever being scheduled."""
        outputs = []
        for seq in self.scheduler.expire_waiting(time.monotonic() - timeout_s):
            seq.finish_reason, seq.stop_reason = FinishReason.ABORT, TIMEOUT_STOP_REASON
            outputs.append(self._finish(seq, [], ""))
        return outputs

    def step(self) -> list[StepOutput]:
        plan = self.scheduler.schedule()
        slices = []
        for item in plan.scheduled:
            seq, start = item.seq, item.seq.num_computed_tokens
            end = start + item.num_new_tokens
            spec = seq.forward
            if spec is None:
                slices.append(SeqSlice(seq.tokens_slice(start, end), start, seq.block_table,
                                       sample=end == seq.num_tokens))
            else:
                lo, hi = bisect.bisect_left(spec.positions, start), bisect.bisect_left(spec.positions, end)
                slices.append(SeqSlice(seq.tokens_slice(start, end), start, seq.block_table,
                                       sample=False, capture=spec.positions[lo:hi],
                                       capture_logits=spec.logits))
            if seq.first_scheduled_time is None:
                seq.first_scheduled_time = time.monotonic()
                self.num_prompt_tokens += seq.num_prompt_tokens
        result = self.runner.execute(StepInput(slices, plan.swap_out, plan.swap_in))
        for item in plan.scheduled:
            item.seq.num_computed_tokens += item.num_new_tokens
            self.block_manager.cache_full_blocks(item.seq)
        outputs = self._collect_forward(plan.scheduled, slices, result.captured)
        if not result.sampled:
            return outputs
        seqs = [plan.scheduled[i].seq for i in result.sampled]
        rows = [SamplingRow(config=s.config, prompt_token_ids=s.prompt_token_ids,
                            output_token_ids=s.output_token_ids, generator=s.generator,
                            eos_token_ids=s.eos_token_ids) for s in seqs]
        sampled = self.sampler.sample(result.logits, rows)
        token_ids, logprobs, top = sampled.to_lists()
        now = time.monotonic()
        for i, seq in enumerate(seqs):
            outputs.append(self._append(seq, token_ids[i],
                                        None if logprobs is None else logprobs[i],
                                        None if top is None else list(zip(top[1][i], top[0][i])),
                                        now))
        return outputs

    def _collect_forward(self, scheduled: list, slices: list[SeqSlice],
                         captured: dict[int, CapturedRows]) -> list[StepOutput]:
        """Keep the rows forward-only sequences captured; finish those whose prompt is done."""
        outputs = []
        for i, item in enumerate(scheduled):
            seq = item.seq
            if seq.forward is None:
                continue
            rows = captured.get(i)
            if rows is not None:
                hidden = rows.hidden.float().cpu() if seq.forward.hidden else None
                logits = rows.logits.float().cpu() if rows.logits is not None else None
                for k, pos in enumerate(slices[i].capture):
                    seq.forward_rows[pos] = (None if hidden is None else hidden[k],
                                             None if logits is None else logits[k])
            if seq.num_computed_tokens >= seq.num_tokens:
                outputs.append(self._finish_forward(seq))
        return outputs

    def _finish_forward(self, seq: Sequence) -> StepOutput:
        spec = seq.forward
        positions = list(spec.positions)
        rows = [seq.forward_rows[p] for p in positions]
        hidden = torch.stack([h for h, _ in rows]) if spec.hidden and rows else None
        logits = torch.stack([lg for _, lg in rows]) if spec.logits and rows else None
        seq.forward_rows = {}
        seq.finish_reason = FinishReason.STOP
        out = self._finish(seq, [], "")
        out.forward = ForwardResult(positions, hidden, logits)
        return out

    def _append(self, seq: Sequence, token: int, logprob: float | None,
                top: Any, now: float) -> StepOutput:
        seq.output_token_ids.append(token)
        self.num_generated_tokens += 1
        if seq.first_token_time is None:
            seq.first_token_time = now
        entries = []
        if seq.config.logprobs is not None and logprob is not None:
            entry = {"token_id": token, "logprob": logprob,
                     "top_logprobs": dict(top[:seq.config.logprobs]) if top else {}}
            seq.logprobs.append(entry)
            entries.append(entry)
        update = self.detokenizers[seq.request_id].update([token])
        config = seq.config
        if update.stop_str is not None:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, update.stop_str
        elif not config.ignore_eos and token in seq.eos_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif token in config.stop_token_ids:
            seq.finish_reason, seq.stop_reason = FinishReason.STOP, token
        elif len(seq.output_token_ids) >= config.max_new_tokens or seq.num_tokens >= self.max_model_len:
            seq.finish_reason = FinishReason.LENGTH
        if seq.finish_reason is not None:
            return self._finish(seq, [token], update.delta, entries)
        return StepOutput(seq.request_id, [token], update.delta, new_logprobs=entries,
                          first_scheduled_time=seq.first_scheduled_time)

    def _finish(self, seq: Sequence, tokens: list[int], delta: str,
                logprobs: list[dict[str, Any]] | None = None) -> StepOutput:
        detok = self.detokenizers.pop(seq.request_id)
        delta += detok.flush()
        self.scheduler.finish(seq)
        seq.finished_time = time.monotonic()
        del self.sequences[seq.request_id]
        return StepOutput(seq.request_id, tokens, delta, True, seq.finish_reason, seq.stop_reason,
                          logprobs or [], first_scheduled_time=seq.first_scheduled_time)
