"""The engine core's speculative decoding steps (`num_speculative_tokens` > 0): drafts from
DeepSeek's MTP layer, or from the sequence itself (the "ngram" method, `engine.ngram_proposer`).

A decoding sequence that holds drafts (`Sequence.draft_token_ids`) is scheduled with them: its
slice computes its last token and the drafts in one forward, and the main model's logits at those
1 + k rows decide how many drafts stand (`runner.draft_verification`); the first refused draft is
replaced by the main model's own choice, and when all stand a bonus token follows. So a step adds
1 to k + 1 tokens to such a sequence, each exactly what decoding without drafts would give
(greedy), or drawn from the same distribution (sampling).

After every step the draft layer runs over the rows whose next token is now known (prompt chunks
too, so its KV cache keeps up) and drafts for each sequence that may draft (`_drafts_allowed`);
the ngram method instead looks each such sequence's last tokens up in its own history.
Those steps read their results at once: speculative decoding turns async scheduling off.

A mixin of `EngineCore`: it works on the core's `runner`, `sampler`, `block_manager`,
`scheduler`, `num_speculative_tokens` and draft counters, and its `_sampling_row` and
`_append`.
"""

from __future__ import annotations

import time

import torch

from ksana_llm.engine.ngram_proposer import NgramIndex
from ksana_llm.engine.outputs import StepOutput, join_token_outputs
from ksana_llm.engine.request import PENDING_TOKEN, Sequence, SequenceStatus
from ksana_llm.engine.scheduler_records import ScheduledSequence
from ksana_llm.runner.draft_verification import (
    ACCEPTED,
    DRAFT_LOGPROB,
    DRAFT_RANK,
    NO_DRAFT,
    TOKEN,
    TOKEN_LOGPROB,
    TOKEN_RANK,
    TOP_LOGPROBS,
    verify_drafts,
)
from ksana_llm.runner.drafting import DraftInput
from ksana_llm.runner.logits_processing import to_device
from ksana_llm.runner.slices import SeqSlice


class SpeculativeSteps:
    @staticmethod
    def _drafts_allowed(seq: Sequence) -> bool:
        """Whether each row of a drafted step sees the same processors as the first, and nothing
        needs per-token host work between them: no penalties over the token history, no grammar,
        no logits processors of the request's own, min_new_tokens already met, no beams; and a
        prompt of token ids (the drafters read a prompt given as embeddings as its placeholder
        ids: drafts that would all be refused)."""
        row = seq.sampling_row
        return (row is not None and seq.group.beam is None and not seq.samples_from_host_tokens
                and not row.uses_token_history and not row.suppresses_stop
                and not seq.prompt_is_embeddings)

    def _verify(self, seqs: list[Sequence], slices: list[SeqSlice], logits: torch.Tensor,
                first_rows: list[int], defer: bool) -> tuple[list[StepOutput], dict[Sequence, int]]:
        """Verify each sequence's drafts (its slice's last num_draft_tokens tokens) against its
        logits rows from `first_rows[i]` on, and append the tokens that stand; returns the
        outputs and each sequence's accepted draft count."""
        rows, draft_ids, logit_rows = [], [], []
        for seq, piece, first in zip(seqs, slices, first_rows):
            k = piece.num_draft_tokens
            rows.extend([self._sampling_row(seq)] * (k + 1))
            draft_ids.extend(piece.token_ids[-k:] + [NO_DRAFT])
            logit_rows.extend(range(first, first + k + 1))
        if logit_rows != list(range(logits.shape[0])):
            logits = logits.index_select(0, to_device(logit_rows, torch.long, logits.device))
        wanted = [row.config.logprobs or 0 for row in rows if row.wants_logprob]
        top_k = max(wanted) if wanted else None
        table = verify_drafts(self.sampler, logits, rows, draft_ids, top_k).cpu()
        # The top columns become Python numbers per sequence, only as many as it asked for.
        verdict = (table if top_k is None else table[:, :TOP_LOGPROBS]).tolist()
        now = time.monotonic()
        outputs: list[StepOutput] = []
        accepted: dict[Sequence, int] = {}
        offset = 0
        for seq, piece in zip(seqs, slices):
            k = piece.num_draft_tokens
            num_accepted = 0
            while num_accepted < k and verdict[offset + num_accepted][ACCEPTED]:
                num_accepted += 1
            last = verdict[offset + num_accepted]
            tokens = draft_ids[offset:offset + num_accepted] + [int(last[TOKEN])]
            emitted = slice(offset, offset + num_accepted + 1)
            logprobs = self._draft_logprobs(verdict[emitted],
                                            None if top_k is None else table[emitted],
                                            seq.config.logprobs or 0)
            offset += k + 1
            self.num_draft_tokens += k
            self.num_accepted_draft_tokens += num_accepted
            self.num_drafts += 1
            per_position = self.num_accepted_per_position
            if len(per_position) < num_accepted:  # (k can change: 0 while drafting pauses)
                per_position.extend([0] * (num_accepted - len(per_position)))
            for position in range(num_accepted):
                per_position[position] += 1
            accepted[seq] = num_accepted
            # The accepted drafts' KV is computed (the refused ones' is overwritten later).
            seq.num_computed_tokens += num_accepted
            for token, (logprob, rank, top) in zip(tokens, logprobs):
                index = len(seq.output_token_ids)
                seq.output_token_ids.append(PENDING_TOKEN)
                seq.num_pending_tokens += 1
                outputs.extend(self._append(seq, index, token, logprob, rank, top, now, defer))
                if seq.status is SequenceStatus.FINISHED:
                    break  # a stop token or string among the drafts: the rest is dropped
            else:
                self.block_manager.cache_full_blocks(seq)
        return join_token_outputs(outputs), accepted

    def _propose_from_history(self, scheduled: list[ScheduledSequence],
                              slices: list[SeqSlice]) -> None:
        """The ngram method: each sequence that sampled this step and may draft looks its last
        tokens up in its predicted output, if it has one, then in its prompt and output."""
        for item, piece in zip(scheduled, slices):
            seq = item.seq
            seq.draft_token_ids = []
            if not piece.sample or seq.status is SequenceStatus.FINISHED \
                    or not self._drafts_allowed(seq):
                continue
            wanted = min(self.num_speculative_tokens, seq.max_num_tokens - seq.num_tokens - 1)
            if wanted <= 0:
                continue
            tokens = seq.token_ids
            if seq.prediction:
                if seq.prediction_index is None:
                    seq.prediction_index = self.ngram.index_reference(seq.prediction)
                seq.draft_token_ids = self.ngram.propose_from_reference(
                    tokens, seq.prediction_index, wanted)
                if seq.draft_token_ids:
                    continue
            if seq.ngram_index is None:
                seq.ngram_index = NgramIndex()
            seq.draft_token_ids = self.ngram.propose(tokens, seq.ngram_index, wanted)

    @staticmethod
    def _draft_logprobs(verdict: list[list[float]], table: torch.Tensor | None, k: int
                        ) -> list[tuple[float | None, int | None, list[tuple[int, float]] | None]]:
        """(log-prob, rank, top k (id, log-prob) pairs) of each emitted token: the accepted
        drafts', then the last row's own token's, from their rows of `verify_drafts`' result
        (`table`, on the host; `verdict` its first columns as lists); Nones without it."""
        if table is None:
            return [(None, None, None)] * len(verdict)
        out = []
        width = (table.shape[1] - TOP_LOGPROBS) // 2  # the batch's top_k, at most the vocabulary
        values = table[:, TOP_LOGPROBS:TOP_LOGPROBS + k].tolist()
        ids = table[:, TOP_LOGPROBS + width:TOP_LOGPROBS + width + k].to(torch.int64).tolist()
        for j, row in enumerate(verdict):
            top = list(zip(ids[j], values[j]))
            # An accepted draft's log-prob, then the last row's own token's.
            drafted = j < len(verdict) - 1
            out.append((row[DRAFT_LOGPROB] if drafted else row[TOKEN_LOGPROB],
                        int(row[DRAFT_RANK] if drafted else row[TOKEN_RANK]), top))
        return out

    def _propose(self, scheduled: list[ScheduledSequence], slices: list[SeqSlice],
                 accepted: dict[Sequence, int]) -> None:
        """Run the draft layer over this step's rows whose next token is known, and give each
        sequence that may draft its next drafts."""
        # A batch as large as `speculative_disable_by_batch_size` drafts nothing for its next
        # step (whose scheduler makes the exact call, on that step's batch).
        paused = self.scheduler.speculation_paused(len(self.scheduler.running))
        if self.ngram is not None:
            if paused:
                for item in scheduled:
                    item.seq.draft_token_ids = []
            else:
                self._propose_from_history(scheduled, slices)
            return
        draft_slices: list[SeqSlice] = []
        sources: list[int] = []
        num_drafts: list[int] = []
        drafting: list[Sequence] = []
        for j, (item, piece) in enumerate(zip(scheduled, slices)):
            seq = item.seq
            seq.draft_token_ids = []
            block_table = seq.block_table
            if seq.status is SequenceStatus.FINISHED:
                # Its blocks are gone, unless they wait for these rows to be exported.
                block_table = self._held_export_table(seq)
                if block_table is None:
                    continue
            if seq.forward is not None:
                continue  # it never decodes
            # Rows whose KV stands, and whose next token is known (a beam's is not, yet).
            kept = item.num_new_tokens - item.num_draft_tokens + accepted.get(seq, 0)
            known = seq.num_prompt_tokens if seq.group.beam is not None else seq.num_tokens
            num_rows = min(kept, known - 1 - piece.start)
            if num_rows <= 0:
                continue
            wanted = 0
            if piece.sample and not paused and seq.status is not SequenceStatus.FINISHED \
                    and self._drafts_allowed(seq):
                # Chained drafts write the draft layer's KV at positions num_tokens - 1 on: only
                # into blocks the sequence holds already (allocating here would take blocks the
                # next step may need, and queue copy-on-write copies a step late).
                held = len(seq.block_table) * self.block_manager.block_size
                wanted = min(self.num_speculative_tokens, seq.max_num_tokens - seq.num_tokens - 1,
                             held - seq.num_tokens + 2)
            draft_slices.append(SeqSlice(seq.tokens_slice(piece.start + 1,
                                                          piece.start + 1 + num_rows),
                                         piece.start, block_table, sample=wanted > 0))
            sources.append(j)
            if wanted > 0:
                num_drafts.append(wanted)
                drafting.append(seq)
        if not draft_slices:
            return
        drafts = self.runner.propose(DraftInput(draft_slices, sources, num_drafts))
        for seq, count, row in zip(drafting, num_drafts, drafts.tolist()):
            seq.draft_token_ids = row[:count]
