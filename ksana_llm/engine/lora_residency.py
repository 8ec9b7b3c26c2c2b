"""Which LoRA adapter sits in which device slot, and which one leaves when another needs a slot.

An engine registers any number of adapters (each held in host memory by the runner) but has only
`max_loras` device slots: a step runs at most that many distinct adapters. The scheduler places a
waiting sequence's adapter before admitting it:

- an adapter already in a slot stays there;
- otherwise it takes a free slot, or else the least recently used slot whose adapter no running
  or swapped-out sequence holds (its weights are copied in before the step's forward);
- when every slot is held, the sequence waits and the scheduler admits others behind it, as vLLM
  does.

A sequence keeps its slot while it runs or is swapped out, so a step never sees an adapter move
under it; one preempted for recompute gives it up and is placed again when readmitted.
"""

from __future__ import annotations

from collections.abc import Collection, Iterable


class LoraResidency:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._slot_of: dict[int, int] = {}  # adapter id -> slot (1..num_slots)
        self._adapter_in: dict[int, int] = {}  # slot -> adapter id
        self._last_used: dict[int, int] = {}  # slot -> tick of its last use
        self._tick = 0
        self._loads: list[tuple[int, int]] = []  # (slot, adapter id) to copy in before the step

    def slot_of(self, lora_id: int) -> int | None:
        return self._slot_of.get(lora_id)

    @property
    def resident(self) -> dict[int, int]:
        """Slot -> adapter id, for the slots that hold one."""
        return dict(self._adapter_in)

    def touch(self, lora_ids: Iterable[int]) -> None:
        """These adapters were in use until now (they rank last for eviction): the scheduler
        says so when a sequence stops holding its adapter."""
        self._tick += 1
        for lora_id in lora_ids:
            slot = self._slot_of.get(lora_id)
            if slot is not None:
                self._last_used[slot] = self._tick

    def can_place(self, lora_id: int, held: Collection[int]) -> bool:
        """Whether `place` would give adapter `lora_id` a slot."""
        return lora_id in self._slot_of or self._free_slot(held) is not None

    def place(self, lora_id: int, held: Collection[int]) -> int | None:
        """The slot adapter `lora_id` runs in, loading it there if it is not resident; None
        when every slot holds an adapter in `held` (the adapters of running or swapped-out
        sequences, which must stay)."""
        slot = self._slot_of.get(lora_id)
        if slot is None:
            slot = self._free_slot(held)
            if slot is None:
                return None
            evicted = self._adapter_in.pop(slot, None)
            if evicted is not None:
                del self._slot_of[evicted]
            self._slot_of[lora_id], self._adapter_in[slot] = slot, lora_id
            # A slot replaced twice before a step runs needs only its last load.
            self._loads = [load for load in self._loads if load[0] != slot]
            self._loads.append((slot, lora_id))
        self.touch((lora_id,))
        return slot

    def _free_slot(self, held: Collection[int]) -> int | None:
        empty = [s for s in range(1, self.num_slots + 1) if s not in self._adapter_in]
        if empty:
            return empty[0]
        idle = [s for s, lora_id in self._adapter_in.items() if lora_id not in held]
        return min(idle, key=lambda s: self._last_used.get(s, 0)) if idle else None

    def take_loads(self) -> list[tuple[int, int]]:
        """The (slot, adapter id) copies placed since the last call, oldest first."""
        loads, self._loads = self._loads, []
        return loads

    def forget(self, lora_id: int) -> int | None:
        """Adapter `lora_id` is unregistered: its slot (if any) is free again; returns it."""
        slot = self._slot_of.pop(lora_id, None)
        if slot is not None:
            del self._adapter_in[slot]
            self._last_used.pop(slot, None)
            self._loads = [load for load in self._loads if load[0] != slot]
        return slot
