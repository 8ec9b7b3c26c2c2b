"""The engine core's KV exports (prefill/decode disaggregation, `Sequence.export_kv`).

A request that exports its KV hands its prompt's rows to the runner (`ModelRunner.export_kv`,
a copy to the host) when it finishes, just before its blocks are freed; the copy rides on the
request's last output (`StepOutput.exported_kv`).

With speculative decoding the draft (MTP) layer's rows of the step that finished the request are
only computed at the end of that step (`SpeculativeSteps._propose`), after the request was freed.
So such an export waits: the request's blocks stay held (refcount) until the draft layer has run
over its rows, then the copy is made, the blocks released, and the step's outputs for the request
(built before) get the copy.

A mixin of `EngineCore`: it works on the core's `runner`, `block_manager`,
`num_speculative_tokens` and `num_exported_kv_tokens`.
"""

from __future__ import annotations

import dataclasses

from ksana_llm.engine.outputs import StepOutput
from ksana_llm.engine.request import FinishReason, Sequence


class KvExportSteps:
    def _init_exports(self) -> None:
        self.num_exported_kv_tokens = 0
        # Finished sequences whose export waits for this step's draft rows: their block tables.
        self._held_exports: dict[Sequence, list[int]] = {}

    def _export_on_free(self, seq: Sequence) -> None:
        """Called as `seq` is freed: export its prompt's KV now, or hold it for the draft layer.

        Nothing is exported (the output carries no KV, and a decode server computes the prompt
        itself) when the request was aborted, or preempted while its last token was on its way
        back (async scheduling): swapped out (its KV is in the host pool) or to be recomputed."""
        if not seq.export_kv or seq.group.exported_kv is not None or seq in self._held_exports \
                or seq.finish_reason is None or seq.finish_reason is FinishReason.ABORT \
                or not seq.block_table or seq.num_computed_tokens == 0:
            return
        if self.num_speculative_tokens and self.ngram is None:  # the MTP layer reads it next
            table = list(seq.block_table)
            self.block_manager.retain(table)
            self._held_exports[seq] = table
            return
        self._export(seq, seq.block_table)

    def _export(self, seq: Sequence, block_table: list[int]) -> None:
        num_tokens = min(seq.num_computed_tokens, seq.num_prompt_tokens)
        kv = self.runner.export_kv(block_table, seq.prompt_token_ids[:num_tokens])
        seq.group.exported_kv = dataclasses.replace(kv, long_rope=True) if seq.long_rope else kv
        self.num_exported_kv_tokens += num_tokens

    def _held_export_table(self, seq: Sequence) -> list[int] | None:
        """The blocks a finished sequence still holds for its export (None: it holds none)."""
        return self._held_exports.get(seq)

    def _finish_exports(self, outputs: list[StepOutput]) -> None:
        """Make the held exports (the draft layer has run), release their blocks, and put them
        on this step's finished outputs of their requests."""
        if not self._held_exports:
            return
        held, self._held_exports = self._held_exports, {}
        exported = {}
        for seq, table in held.items():
            self._export(seq, table)
            self.block_manager.release_blocks(table)
            exported[seq.request_id] = seq.group.exported_kv
        for out in outputs:
            if out.finished and out.request_id in exported:
                out.exported_kv = exported[out.request_id]
