"""The scheduler's LoRA side: which waiting requests' adapters can take a device slot, when a
held adapter stops taking newer requests so that a slot drains for one that waited too long, and
when an adapter's slot was last used (for eviction). A mixin of `engine.scheduler.Scheduler`: it
reads the scheduler's `lora` (None without slots), `config`, `running` and `swapped`."""

from __future__ import annotations

from ksana_llm.engine.lora_residency import LoraResidency
from ksana_llm.engine.request import Sequence
from ksana_llm.engine.scheduler_records import SchedulerConfig


class AdapterAdmission:
    lora: LoraResidency | None
    config: SchedulerConfig
    running: list[Sequence]
    swapped: list[Sequence]

    def _held_adapters(self) -> dict[int, int]:
        """Adapter -> how many running and swapped-out sequences use it: their slots stay."""
        held: dict[int, int] = {}
        for queue in (self.running, self.swapped):
            for s in queue:
                if s.lora_id:
                    held[s.lora_id] = held.get(s.lora_id, 0) + 1
        return held

    def _adapter_admissible(self, seq: Sequence, held: dict[int, int], draining: set[int]
                            ) -> bool:
        """Whether `seq`'s adapter has (or can take) a slot, and takes new requests.

        A request whose adapter finds every slot held lets those behind it go ahead (vLLM's
        rule, which keeps batches full), but only for `lora_max_wait_steps` steps: then one
        held adapter, the one with the fewest requests (the first to drain), takes no newer
        requests until its slot frees for this one. vLLM never drains, so an adapter whose
        requests keep coming can hold its slot for ever; draining every held adapter at once
        (SGLang's fix) stalls all of them for one request.
        """
        if self.lora is None:  # (a registry without slots refuses adapter requests earlier)
            return False
        if seq.lora_id in draining:
            return False
        if self.lora.can_place(seq.lora_id, held):
            return True
        seq.num_lora_waits += 1
        limit = self.config.lora_max_wait_steps
        if limit is not None and seq.num_lora_waits > limit:
            if seq.lora_drain_target not in held:  # (0, or an adapter that drained meanwhile)
                seq.lora_drain_target = min(held, key=lambda a: (held[a], self.lora.slot_of(a)))
            draining.add(seq.lora_drain_target)
        return False

    def _release_adapter(self, seq: Sequence) -> None:
        """`seq` stops holding its adapter's slot: the slot's last use is now (for eviction)."""
        if seq.lora_id and self.lora is not None:
            self.lora.touch((seq.lora_id,))
