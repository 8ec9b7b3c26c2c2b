"""The engine core's captured rows: forward-only requests' hidden states and logits, and prompt
log-probs. Their device work and copies to the host are queued with the step; they are read back
in the same step, or (async scheduling) with the step's tokens after the next step is launched.

A mixin of `EngineCore`: it works on the core's `groups`, and its `_free`.
"""

from __future__ import annotations

import time

import torch

from ksana_llm.engine.outputs import CaptureRead, ForwardResult, StepOutput
from ksana_llm.engine.request import FinishReason, Sequence
from ksana_llm.engine.scheduler_records import ScheduledSequence
from ksana_llm.runner.captured_rows import CapturedRows
from ksana_llm.runner.host_copy import start_host_copy
from ksana_llm.runner.model_runner import SeqSlice


class CaptureSteps:
    def _launch_captures(self, scheduled: list[ScheduledSequence], slices: list[SeqSlice],
                         captured: dict[int, CapturedRows]) -> list[CaptureRead]:
        """Queue the device work on the step's captured rows and their copies to the host:
        forward-only sequences' rows, and prompt log-probs. A forward-only sequence whose
        prompt is done is freed now (its rows are activations, not KV blocks); its output comes
        with the read (`_read_captures`)."""
        reads = []
        for i, item in enumerate(scheduled):
            seq, rows = item.seq, captured.get(i)
            positions = slices[i].capture
            if seq.forward is None:
                if rows is not None and rows.prompt_logprobs is not None:
                    reads.append(CaptureRead(seq, positions, prompt_logprobs=rows.prompt_logprobs))
                continue
            hidden = logits = None
            if rows is not None:
                hidden = start_host_copy(rows.hidden.float()) if seq.forward.hidden else None
                logits = rows.logits
            done = seq.num_computed_tokens >= seq.num_tokens
            if done:
                self._free(seq)
            reads.append(CaptureRead(seq, positions, hidden=hidden, logits=logits, done=done))
        return reads

    def _read_captures(self, reads: list[CaptureRead]) -> list[StepOutput]:
        """Keep the captured rows once on the host; outputs of the forward-only sequences done."""
        outputs = []
        for read in reads:
            seq = read.seq
            if read.prompt_logprobs is not None:
                self._keep_prompt_logprobs(seq, read.positions, read.prompt_logprobs.wait())
                continue
            hidden = None if read.hidden is None else read.hidden.wait()
            logits = None if read.logits is None else read.logits.wait()
            for k, pos in enumerate(read.positions):
                seq.forward_rows[pos] = (None if hidden is None else hidden[k],
                                         None if logits is None else logits[k])
            if read.done:
                outputs.append(self._finish_forward(seq))
        return outputs

    def _keep_prompt_logprobs(self, seq: Sequence, positions: tuple[int, ...],
                              packed: torch.Tensor) -> None:
        """`packed` [len(positions), 2 + 2K]: each row's chosen log-prob and its rank, then the
        top K values and ids, K >= this sequence's k (`runner.captured_rows.CapturedRows`)."""
        k = seq.config.prompt_logprobs or 0
        width = (packed.shape[1] - 2) // 2
        # Only this sequence's k columns become Python numbers (K may be another's, larger).
        values = packed[:, 2:2 + k].tolist()
        ids = packed[:, 2 + width:2 + width + k].to(torch.int64).tolist()
        for j, (p, (chosen, rank)) in enumerate(zip(positions, packed[:, :2].tolist())):
            seq.prompt_logprobs[p + 1] = {
                "token_id": seq.prompt_token_ids[p + 1], "logprob": chosen, "rank": int(rank),
                "top_logprobs": dict(zip(ids[j], values[j]))}
        group = seq.group
        if group.prompt_logprobs is None and len(seq.prompt_logprobs) == seq.num_prompt_tokens - 1:
            group.prompt_logprobs = [None] + [seq.prompt_logprobs[p]
                                              for p in range(1, seq.num_prompt_tokens)]

    def _finish_forward(self, seq: Sequence) -> StepOutput:
        """The output of a forward-only sequence, already freed (`_launch_captures`)."""
        spec = seq.forward
        positions = list(spec.positions)
        rows = [seq.forward_rows[p] for p in positions]
        hidden = torch.stack([h for h, _ in rows]) if spec.hidden and rows else None
        logits = torch.stack([lg for _, lg in rows]) if spec.logits and rows else None
        seq.forward_rows = {}
        seq.finish_reason = FinishReason.STOP
        seq.finished_time = time.monotonic()
        del self.groups[seq.request_id]
        return StepOutput(seq.request_id, [], seq.detokenizer.flush(), True, FinishReason.STOP,
                          forward=ForwardResult(positions, hidden, logits),
                          first_scheduled_time=seq.first_scheduled_time)
