"""An engine's LoRA adapters: registered adapters in host memory, `max_loras` device slots of
stacked A/B weights per projection, and the per-step token mask that picks each token's slot
(see ksana_llm.layers.lora).

Registering an adapter reads its folder, checks every module against the model and keeps, in
host memory, the slices this rank's shards need, already in the model's dtype (pinned on CUDA).
Activating it copies those into a device slot (the scheduler decides when and where, see
engine.lora_residency). Slot 0 means "no adapter"; adapters run in slots 1..max_loras.
With `max_cpu_loras` (vLLM's), at most that many host copies are kept, least recently used
dropped first; activating an adapter whose copy was dropped reads its folder again.

A projection gets its stacks the first time an adapter targets it, so a model whose adapters
touch only q/v pays nothing for the MLP. Under tensor parallelism every rank reads the adapter
from its folder: column-parallel layers split B's rows like their weight's, row-parallel layers
split A's columns (their partial deltas join the layer's all-reduce).
"""

from __future__ import annotations

import dataclasses

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass

import torch
from torch import nn

from ksana_llm.layers.linear import MergedLinear
from ksana_llm.layers.lora import LoraBatch, LoraWeights
from ksana_llm.layers.parallel import RowParallelLinear
from ksana_llm.loader.lora import LoraAdapter, load_lora_adapter
from ksana_llm.loader.multimodal_text import language_model_name
from ksana_llm.loader.weight_map import WeightMap

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")
# The part index of an adapter module that covers a fused projection whole (a checkpoint that
# stores q/k/v as one matmul, like Qwen v1's `c_attn` or Baichuan's `W_pack`): its A feeds every
# part, and its B's rows split into the parts.
WHOLE = -1


@dataclass(frozen=True)
class _Projection:
    """An adaptable projection: its module and, per checkpoint module name, the part index
    (0 for an unfused projection)."""

    name: str
    module: MergedLinear | RowParallelLinear
    parts: Mapping[str, int]

    @property
    def num_parts(self) -> int:
        return len(self.module.out_sizes) if isinstance(self.module, MergedLinear) else 1


def adaptable_projections(model: nn.Module) -> dict[str, tuple[_Projection, int]]:
    """Checkpoint module name (`model.layers.3.self_attn.q_proj`) -> (projection, part index)
    for every projection the decoder layers apply adapters to: those of attention and MLP
    modules that take the step's adapters (`accepts_lora`). A fused projection is also listed
    under its own name (`...self_attn.qkv_proj`), with part index WHOLE."""
    fused_by_module: dict[str, list[tuple[str, int]]] = {}
    for part, (fused, index) in getattr(model, "fused_parts", {}).items():
        fused_by_module.setdefault(fused, []).append((part, index))
    found: dict[str, tuple[_Projection, int]] = {}
    for layer_name, layer in model.named_modules():
        for role in ("self_attn", "mlp"):
            block = getattr(layer, role, None)
            if block is None or not getattr(block, "accepts_lora", False):
                continue
            for child_name, child in block.named_children():
                name = f"{layer_name}.{role}.{child_name}"
                if isinstance(child, MergedLinear):
                    parts = {f"{layer_name}.{role}.{part}": index
                             for part, index in fused_by_module.get(child_name, [])}
                    parts[name] = WHOLE
                elif isinstance(child, RowParallelLinear):
                    parts = {name: 0}
                else:
                    continue
                projection = _Projection(name, child, parts)
                child.lora_name = name
                for checkpoint_name, index in parts.items():
                    found[checkpoint_name] = (projection, index)
    return found


def lora_device_bytes(model: nn.Module, *, num_slots: int, max_rank: int, dtype: torch.dtype,
                      max_step_tokens: int) -> int:
    """What `num_slots` slots take once every adaptable projection has its stacks (as under
    CUDA graphs), plus the largest step's low-rank products."""
    if not num_slots:
        return 0
    element = torch.empty((), dtype=dtype).element_size()
    projections = {p.name: p for p, _ in adaptable_projections(model).values()}
    stacks = widest = 0
    for projection in projections.values():
        rows = num_slots * projection.num_parts * max_rank
        out_features, in_features = (projection.module.weight.shape[0],
                                     projection.module.local_in_features)
        stacks += rows * (in_features + out_features) * element
        widest = max(widest, rows)
    return stacks + 2 * max_step_tokens * widest * element


@dataclass(frozen=True)
class _SlotWrite:
    """One part of one projection of a registered adapter, as this rank writes it into a slot:
    A's rows and the columns [column, column + width) of the transposed B's rows."""

    projection: _Projection
    part: int
    a: torch.Tensor  # [rank, local in_features]
    b_t: torch.Tensor  # [rank, width]
    column: int


class LoraSlots:
    def __init__(self, model: nn.Module, *, num_slots: int, max_rank: int,
                 device: torch.device, dtype: torch.dtype,
                 name_map: WeightMap | None = None, max_host_copies: int | None = None) -> None:
        if num_slots < 1 or max_rank < 1:
            raise ValueError("max_loras and max_lora_rank must be at least 1")
        if max_host_copies is not None and max_host_copies < 1:
            raise ValueError(f"max_cpu_loras must be at least 1, got {max_host_copies}")
        self.model = model
        self.num_slots = num_slots
        self.max_rank = max_rank
        self.device = device
        self.dtype = dtype
        self.projections = adaptable_projections(model)
        # The model's weight-name map (Qwen v1, Baichuan, ...): adapters name the checkpoint's
        # modules, which the map renames as it renames their weights.
        self.name_map = name_map
        self.weights: dict[str, LoraWeights] = {}  # projection name -> its stacks
        self.paths: dict[int, str] = {}  # adapter id -> its folder, for every registered one
        # adapter id -> its host copy, least recently used first (at most max_host_copies)
        self.registered: OrderedDict[int, list[_SlotWrite]] = OrderedDict()
        self.max_host_copies = max_host_copies
        self.num_host_reloads = 0  # host copies read again after being dropped
        self.resident: dict[int, int] = {}  # slot -> adapter id

    # ---- registering and activating ------------------------------------------------------------
    def register(self, lora_id: int, path: str) -> None:
        """Read and check the adapter in `path`, and keep it as adapter `lora_id` (replacing
        what had that id). A bad adapter is a ValueError and changes nothing."""
        writes = self._read(path)
        self.paths[lora_id] = path
        self._keep(lora_id, writes)

    def _read(self, path: str) -> list[_SlotWrite]:
        adapter = load_lora_adapter(path)
        if adapter.max_rank > self.max_rank:
            raise ValueError(f"LoRA adapter {path!r} has rank {adapter.max_rank}, more than "
                             f"max_lora_rank ({self.max_rank})")
        return [write for projection, index, weights in self._placements(adapter)
                for write in self._slot_writes(projection, index, weights.a, weights.b)]

    def _keep(self, lora_id: int, writes: list[_SlotWrite]) -> None:
        """Hold `writes` as the adapter's host copy, dropping the least recently used copies
        past max_host_copies."""
        self.registered[lora_id] = writes
        self.registered.move_to_end(lora_id)
        while self.max_host_copies is not None and len(self.registered) > self.max_host_copies:
            self.registered.popitem(last=False)

    def host_copy(self, lora_id: int) -> list[_SlotWrite]:
        """Registered adapter `lora_id`'s host copy (now the most recently used), read again
        from its folder if max_cpu_loras dropped it. A folder that can no longer be read is a
        ValueError naming it, and changes nothing."""
        if lora_id not in self.paths:
            raise ValueError(f"LoRA adapter id {lora_id} is not registered")
        writes = self.registered.get(lora_id)
        if writes is None:
            path = self.paths[lora_id]
            try:
                writes = self._read(path)
            except Exception as exc:  # noqa: BLE001 - any failure to read it is this adapter's
                raise ValueError(f"LoRA adapter {path!r} could not be read again from its folder "
                                 f"(max_cpu_loras had dropped its host copy): {exc}") from exc
            self.num_host_reloads += 1
        self._keep(lora_id, writes)
        return writes

    def has_host_copy(self, lora_id: int) -> bool:
        return lora_id in self.registered

    def unregister(self, lora_id: int) -> None:
        """Forget adapter `lora_id`; a slot holding it is cleared."""
        self.registered.pop(lora_id, None)
        self.paths.pop(lora_id, None)
        for slot, resident in list(self.resident.items()):
            if resident == lora_id:
                self.clear(slot)

    @torch.inference_mode()  # the stacks may be inference tensors (made during a step)
    def activate(self, slot: int, lora_id: int) -> None:
        """Copy registered adapter `lora_id` into `slot` (1..num_slots), replacing what was
        there. On CUDA the copies are queued on the stream, after the steps already queued."""
        writes = self.host_copy(lora_id)
        self.clear(slot)
        for write in writes:
            stacks = self._stacks(write.projection)
            first = (slot - 1) * stacks.block + write.part * self.max_rank
            rows = slice(first, first + write.a.shape[0])  # this part's rank rows of the slot
            stacks.a[rows].copy_(write.a, non_blocking=True)
            stacks.b_t[rows, write.column:write.column + write.b_t.shape[1]].copy_(
                write.b_t, non_blocking=True)
        self.resident[slot] = lora_id

    @torch.inference_mode()
    def clear(self, slot: int) -> None:
        self._check_slot(slot)
        for stacks in self.weights.values():
            rows = slice((slot - 1) * stacks.block, slot * stacks.block)
            stacks.a[rows].zero_()
            stacks.b_t[rows].zero_()
        self.resident.pop(slot, None)

    def _check_slot(self, slot: int) -> None:
        if not 1 <= slot <= self.num_slots:
            raise ValueError(f"LoRA slot {slot} is outside 1..{self.num_slots} (max_loras)")

    def _placements(self, adapter: LoraAdapter) -> list[tuple[_Projection, int, object]]:
        """Where each of the adapter's modules goes; every module is checked before anything
        is kept, so a bad adapter changes nothing."""
        out = []
        taken: dict[tuple[str, int], str] = {}  # (projection, part) -> the module filling it
        text_of_multimodal = getattr(getattr(self.model, "config", None),
                                     "multimodal_checkpoint", None)
        for checkpoint_module, weights in adapter.modules.items():
            if text_of_multimodal:
                # Served for its text: the language model's modules under a causal LM's names;
                # the vision tower's (not loaded) are nothing to adapt.
                checkpoint_module = language_model_name(checkpoint_module)
                if checkpoint_module is None:
                    continue
            module = self._our_name(checkpoint_module)
            target = self.projections.get(module) if module is not None else None
            if target is None:
                if self._on_other_stage(module):
                    continue
                raise ValueError(f"LoRA adapter {adapter.path!r}: module {checkpoint_module!r} "
                                 "cannot be adapted here (supported: the q/k/v/o and gate/up/down "
                                 "projections of the decoder layers)")
            projection, index = target
            self._check_shapes(adapter.path, checkpoint_module, projection, index, weights.a,
                               weights.b)
            # A model that reorders a projection's output rows as it loads (GLM's q/k rotary
            # rows) reorders B's rows the same way.
            reorder = getattr(self.model, "loaded_output_rows", None)
            if reorder is not None:
                weights = dataclasses.replace(weights, b=reorder(checkpoint_module, weights.b))
            parts = range(projection.num_parts) if index == WHOLE else (index,)
            for part in parts:
                other = taken.setdefault((projection.name, part), checkpoint_module)
                if other != checkpoint_module:
                    raise ValueError(f"LoRA adapter {adapter.path!r}: {other} and "
                                     f"{checkpoint_module} both adapt {projection.name}")
            out.append((projection, index, weights))
        return out

    def _our_name(self, module: str) -> str | None:
        """The module's name in our model (None: the weight map drops it): as the model names
        its own checkpoint's modules (InternLM 2's), or through the weight map."""
        rename = getattr(self.model, "lora_module_name", None)
        if rename is not None:
            module = rename(module)
        if self.name_map is None:
            return module
        mapped = self.name_map.map_name(module + ".weight")
        return None if mapped is None else mapped.removesuffix(".weight")

    def _on_other_stage(self, module: str | None) -> bool:
        """A decoder layer another pipeline stage runs (this stage holds a placeholder)."""
        match = _LAYER_INDEX.match(module or "")
        layers = getattr(getattr(self.model, "model", None), "layers", None)
        if match is None or layers is None or int(match[1]) >= len(layers):
            return False
        layer = layers[int(match[1])]
        return not hasattr(layer, "self_attn")

    @staticmethod
    def _check_shapes(path: str, module: str, projection: _Projection, index: int,
                      a: torch.Tensor, b: torch.Tensor) -> None:
        linear = projection.module
        if isinstance(linear, MergedLinear):
            in_features = linear.local_in_features
            out_features = sum(linear.full_sizes) if index == WHOLE else linear.full_sizes[index]
        else:
            in_features, out_features = linear.in_features, linear.weight.shape[0]
        fits = a.shape[1] == in_features and b.shape[0] == out_features
        if not fits:
            raise ValueError(f"LoRA adapter {path!r}: {module} has lora_A {tuple(a.shape)} and "
                             f"lora_B {tuple(b.shape)}, which do not fit the model's projection")

    def allocate_all(self) -> dict[str, LoraWeights]:
        """Stacks for every adaptable projection now (the CUDA graphs read them), the dict the
        steps use."""
        for projection, _ in self.projections.values():
            self._stacks(projection)
        return self.weights

    def _stacks(self, projection: _Projection) -> LoraWeights:
        stacks = self.weights.get(projection.name)
        if stacks is None:
            linear = projection.module
            block = projection.num_parts * self.max_rank
            zeros = dict(device=self.device, dtype=self.dtype)
            stacks = LoraWeights(
                torch.zeros(self.num_slots * block, linear.local_in_features, **zeros),
                torch.zeros(self.num_slots * block, linear.weight.shape[0], **zeros),
                self.num_slots)
            self.weights[projection.name] = stacks
        return stacks

    def _slot_writes(self, projection: _Projection, index: int, a: torch.Tensor,
                     b: torch.Tensor) -> list[_SlotWrite]:
        """What this rank writes for one adapter module: a fused projection's parts (the same A,
        each its own rows of B) cut to this rank's shards, in host memory."""
        if index == WHOLE:
            linear = projection.module
            return [write for part, rows in enumerate(b.split(linear.full_sizes, dim=0))
                    for write in self._slot_writes(projection, part, a, rows)]
        linear = projection.module
        if isinstance(linear, MergedLinear):
            first_out, size = linear.shards[index]
            a_rows, b_t, column = a, b[first_out:first_out + size].t(), linear.offsets[index]
        else:
            local_in = linear.local_in_features
            a_rows = a[:, linear.in_start:linear.in_start + local_in]
            b_t, column = b.t(), 0
        return [_SlotWrite(projection, index, self._host(a_rows), self._host(b_t), column)]

    def _host(self, tensor: torch.Tensor) -> torch.Tensor:
        """A host copy in the slots' dtype; pinned on CUDA so activation copies run async."""
        host = tensor.to(dtype=self.dtype, device="cpu", copy=True).contiguous()
        return host.pin_memory() if self.device.type == "cuda" else host

    # ---- one step ----------------------------------------------------------------------------
    def batch(self, slice_slots: list[int], token_slice: torch.Tensor) -> LoraBatch | None:
        """The step's adapters: slice i's tokens use slot `slice_slots[i]` (0 = none), token t
        belongs to slice `token_slice[t]`. None when no slice uses an adapter. Only the run of
        slots from the lowest to the highest used is computed. Built on the host; the runner
        moves the mask."""
        used = [slot for slot in slice_slots if slot]
        if not used:
            return None
        lo, hi = min(used), max(used)
        # Column j of the mask is slot lo + j; a token without an adapter gets no 1 (the
        # extra first column, dropped, takes its write).
        column = torch.tensor([slot - lo + 1 if slot else 0 for slot in slice_slots],
                              dtype=torch.long)[token_slice]
        mask = torch.zeros(token_slice.shape[0], hi - lo + 2, dtype=torch.bool)
        mask[torch.arange(token_slice.shape[0]), column] = True
        return LoraBatch(self.weights, mask[:, 1:].contiguous(), first_slot=lo - 1)
