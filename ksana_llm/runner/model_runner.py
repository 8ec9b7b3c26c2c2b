"""Runs one scheduled step on one device: owns the KV tensors, builds the batch
(`runner.batch_building`), runs the model (eagerly, or a captured CUDA graph for decode steps).
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch
from torch import nn

from ksana_llm.kernels.kv_quant import cache_dtype_for
from ksana_llm.loader.weight_map import load_weight_map
from ksana_llm.layers.fused_kernels import use_fused_kernels
from ksana_llm.layers.attention import AttentionMetadata, KVCache, KVCacheSpec
from ksana_llm.layers.kv_cache_layout import (allocate_kv_cache, block_runs, copy_cache_blocks,
                                              zero_cache_blocks)
from ksana_llm.runner.batch_building import BatchBuilding, EmbeddingOverrides
from ksana_llm.runner.captured_rows import CAPTURE_CHUNK_ELEMENTS, CapturedRows, capture_rows
from ksana_llm.runner.cuda_graphs import (DecodeGraphs, DecodeInputs, graph_batch_sizes,
                                          unsupported_reason)
from ksana_llm.runner.drafting import MtpDrafting, draft_layers_for
from ksana_llm.runner.fp8_cache import check_fp8_support
from ksana_llm.runner.kv_transfer import KvTransferSteps, TransferredKv
from ksana_llm.runner.logits_processing import to_device
from ksana_llm.runner.lora_slots import LoraSlots
from ksana_llm.runner.sleep_mode import SleepMode
from ksana_llm.runner.slices import SeqSlice
from ksana_llm.runner.weight_sync import WeightSync

logger = logging.getLogger("ksana_llm.runner")

# Largest decode batch captured by default (EngineConfig.max_num_seqs's default).
DEFAULT_GRAPH_MAX_BATCH_SIZE = 256



@dataclass(frozen=True)
class PendingInputs:
    """Input tokens the host does not know yet (async scheduling): the single token of slice
    `slices[j]` is row `source_rows[j]` of `source`, the previous step's sampled token ids, still
    on the device. Those slices carry a placeholder id the runner overwrites on the device."""

    slices: list[int]
    source_rows: list[int]
    source: torch.Tensor  # [B] int64 on the runner's device


@dataclass
class StepInput:
    slices: list[SeqSlice]
    swap_out: list[tuple[int, int]]  # (device block, host block), done before the forward
    swap_in: list[tuple[int, int]]  # (host block, device block)
    # (source, destination) device blocks to copy before the forward: copy-on-write of a shared
    # partial block when sequences fork (parallel sampling, beam search).
    copy_blocks: list[tuple[int, int]] = field(default_factory=list)
    pending: PendingInputs | None = None
    # KV received from another engine, written into these block tables before the forward.
    kv_imports: list[tuple[list[int], TransferredKv]] = field(default_factory=list)
    # (slot, adapter id): registered LoRA adapters to copy into device slots before the forward.
    lora_loads: list[tuple[int, int]] = field(default_factory=list)
    # Device blocks newly given to sequences, cleared after the swap-outs, before the rest.
    fresh_blocks: list[int] = field(default_factory=list)


@dataclass
class StepResult:
    """Next-token logits of the slices that asked for them, in slice order: one row each, or
    1 + num_draft_tokens rows for a slice with drafts."""

    sampled: list[int]  # indices into StepInput.slices
    logits: torch.Tensor | None  # [sum of sampled slices' rows, vocab] float32
    captured: dict[int, CapturedRows] = field(default_factory=dict)  # slice index -> its rows


def kv_bytes_per_block(model: nn.Module, block_size: int, dtype: torch.dtype,
                       num_draft_layers: int = 0) -> int:
    """One block of every layer's cache, the draft layers' (speculative decoding) included;
    `dtype` is the cache's (`kv_quant.kv_cache_dtype`)."""
    spec: KVCacheSpec = model.kv_cache_spec
    return (model.num_layers + num_draft_layers) * block_size * spec.bytes_per_token(dtype)


def resolve_attention_backend(requested: str, model: nn.Module, device: torch.device) -> str:
    """"torch" or "triton". "auto" takes Triton on CUDA when it is installed and the model's
    attention can use it (MLA has its own attention and says so in `attention_backends`)."""
    from ksana_llm.kernels import triton_available

    supported = getattr(model, "attention_backends", ("torch", "triton"))
    if requested == "auto":
        use_triton = device.type == "cuda" and "triton" in supported and triton_available()
        return "triton" if use_triton else "torch"
    if requested not in ("torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {requested!r}")
    if requested not in supported:
        raise ValueError(f"attention_backend {requested!r}: {type(model).__name__} supports "
                         f"{', '.join(supported)}")
    if requested == "triton" and not triton_available():
        raise ValueError("attention_backend 'triton' needs triton and a CUDA device "
                         "(or TRITON_INTERPRET=1 to run the kernels on the CPU)")
    return requested


def model_context_len(model: nn.Module) -> int | None:
    """The longest sequence the model serves, as far as the module knows it."""
    own = getattr(model, "max_context", None)
    if own is not None:
        return int(own)
    length = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(length) if length else None


class ModelRunner(BatchBuilding, MtpDrafting, KvTransferSteps, WeightSync, SleepMode):
    """`cuda_graphs`: replay captured CUDA graphs for pure-decode steps of the batch sizes
    `cuda_graph_sizes` names (an int: up to that many sequences, in the default buckets; a
    list: those sizes), when the device, backend and model allow it
    (`cuda_graph_status` says which, and why not). `max_model_len` bounds a sequence (default:
    the model's context, at most the whole cache): graphs pad block tables to that width."""

    def __init__(self, model: nn.Module, *, device: torch.device, dtype: torch.dtype,
                 num_blocks: int, block_size: int, num_host_blocks: int = 0,
                 attention_backend: str = "auto", max_model_len: int | None = None,
                 cuda_graphs: bool = True,
                 cuda_graph_sizes: int | Sequence[int] = DEFAULT_GRAPH_MAX_BATCH_SIZE,
                 num_speculative_tokens: int = 0, kv_cache_dtype: str = "auto",
                 kv_scales: Sequence[float] | None = None, max_loras: int = 0,
                 max_lora_rank: int = 16, lora_adapters: Sequence[tuple[int, str]] = (),
                 lora_weight_map: str | None = None, max_cpu_loras: int | None = None,
                 host_outputs: bool = True) -> None:
        self.model = model
        # False on a tensor-parallel worker rank: rank 0 alone reads captured rows' logits
        # and prompt log-probs, so the others make no host copies of them.
        self.host_outputs = host_outputs
        num_draft_layers = draft_layers_for(model, num_speculative_tokens)
        self.attention_backend = resolve_attention_backend(attention_backend, model, device)
        # The rest of the Triton path: fused RMSNorm (+ residual), in-place RoPE, and MoE experts
        # grouped into one launch per weight stack -- for this runner's forwards only (engines
        # may share a model), so set around each step (`layers.fused_kernels`).
        self.fused_kernels = self.attention_backend == "triton"
        # The torch backend attends over whole blocks, masking the tail of a sequence's last one;
        # a masked position still multiplies its V by a zero weight, and 0 * NaN is NaN. So a
        # NaN or inf a finished request left in a block (an fp16 overflow) would poison the
        # next owner's output: blocks are zeroed as they change hands. The Triton kernels load
        # only the positions they attend to.
        self.clears_fresh_blocks = self.attention_backend == "torch"
        self.device = device
        self.dtype = dtype
        self.cache_dtype = cache_dtype_for(kv_cache_dtype, dtype)
        check_fp8_support(self.cache_dtype, self.attention_backend, device)
        # Per layer (AttentionMetadata.kv_scale), not on the modules: engines may share a model.
        self.kv_scales = tuple(float(s) for s in kv_scales or ())
        self.block_size = block_size
        self.sliding_window = model.sliding_window
        # LoRA: `max_loras` adapter slots; `lora_adapters` are (adapter id, folder) registered
        # now; `lora_weight_map`: the model's weight-name map file, which renames adapters'
        # modules; `max_cpu_loras`: host copies kept (None: all).
        self.lora: LoraSlots | None = None
        if max_loras:
            self.lora = LoraSlots(model, num_slots=max_loras, max_rank=max_lora_rank,
                                  device=device, dtype=dtype,
                                  name_map=load_weight_map(lora_weight_map)
                                  if lora_weight_map else None,
                                  max_host_copies=max_cpu_loras)
            for lora_id, path in lora_adapters:
                self.lora.register(lora_id, path)
        self._capture_rows: dict[int, list[int]] = {}  # set by build()
        # Captured rows' logits are made this many float32 elements at a time (`captured_rows`).
        self.capture_chunk_elements = CAPTURE_CHUNK_ELEMENTS
        self._first_rows: list[int] = []  # set by build(): each slice's first row
        self._embedding_overrides: EmbeddingOverrides | None = None  # set by build()
        spec: KVCacheSpec = model.kv_cache_spec

        def cache_pair(blocks: int, **kwargs: object) -> KVCache:
            return tuple(allocate_kv_cache(blocks, block_size, spec.num_kv_heads, dim,
                                           dtype=self.cache_dtype, **kwargs)
                         for dim in (spec.head_dim, spec.v_dim))

        self.kv_caches: list[KVCache] = [cache_pair(num_blocks, device=device)
                                         for _ in range(model.num_layers)]
        # The draft (MTP) layers' caches share the block tables; swaps and copies move them too.
        self.draft_kv_caches: list[KVCache] = [cache_pair(num_blocks, device=device)
                                               for _ in range(num_draft_layers)]
        # Host swap space: left uncommitted until a block is swapped out, except on CUDA, where
        # it is pinned (committed at once) so swap copies can run asynchronously.
        pin = device.type == "cuda"
        self.host_caches: list[KVCache] = [
            cache_pair(num_host_blocks, zero=False, pin_memory=pin)
            for _ in range(model.num_layers + num_draft_layers)] if num_host_blocks else []
        # Speculative decoding: the last step's final hidden states and each slice's first row
        # in them, which the draft layers read (`runner.drafting`).
        self.last_hidden: torch.Tensor | None = None
        self.last_first_rows: list[int] = []
        capacity = num_blocks * block_size
        self.max_model_len = min(max_model_len or model_context_len(model) or capacity, capacity)
        self.decode_graphs: DecodeGraphs | None = None
        self.cuda_graph_status = "off: disabled (enable_cuda_graphs=False)"
        if cuda_graphs:
            reason = unsupported_reason(model, device, self.attention_backend)
            if reason is None:
                self.setup_cuda_graphs(cuda_graph_sizes)
            else:
                self.cuda_graph_status = f"off: {reason}"
        logger.info("CUDA graphs: %s", self.cuda_graph_status)

    # ---- LoRA adapters ---------------------------------------------------------------------------
    def register_lora(self, lora_id: int, path: str) -> None:
        """Read and check the adapter in folder `path`, and keep it in host memory as adapter
        `lora_id`; steps copy it into a device slot when they need it (`StepInput.lora_loads`)."""
        if self.lora is None:
            raise ValueError("this engine has no LoRA slots: set max_loras (or lora_modules)")
        self.lora.register(lora_id, path)

    def unregister_lora(self, lora_id: int) -> None:
        if self.lora is not None:
            self.lora.unregister(lora_id)

    def prepare_lora(self, lora_id: int) -> None:
        """Make sure a step can copy adapter `lora_id` into a slot: its host copy is read again
        if max_cpu_loras dropped it. A ValueError if its folder can no longer be read (then only
        that adapter's requests fail, not the step)."""
        if self.lora is not None:
            self.lora.host_copy(lora_id)

    # ---- CUDA graphs -----------------------------------------------------------------------------
    def setup_cuda_graphs(self, sizes: int | Sequence[int], *, capture: bool = True) -> None:
        """Static decode buffers for up to the largest bucket's sequences, and (capture=True)
        one captured graph per bucket: `sizes` lists the buckets, or (an int) is the largest,
        with `graph_batch_sizes`' buckets below it. capture=False runs the same static-buffer
        forward eagerly (CPU tests of the padding logic). A failed capture leaves decode steps
        eager."""
        if self.attention_backend != "triton":
            raise ValueError("CUDA graphs need attention_backend 'triton'")
        sizes = graph_batch_sizes(sizes) if isinstance(sizes, int) else tuple(sorted(set(sizes)))
        if not sizes or sizes[0] < 1:
            raise ValueError(f"cuda_graph_sizes must be batch sizes >= 1, got {list(sizes)}")
        max_batch_size = sizes[-1]
        width = -(-self.max_model_len // self.block_size)
        lora_weights = None
        if self.lora is not None:
            # Every projection's stacks exist before the capture, so adapters loaded later are
            # written into tensors the graphs already read.
            lora_weights = self.lora.allocate_all()
        inputs = DecodeInputs(max_batch_size, width, self.device, self.block_size,
                              lora_slots=self.lora.num_slots if self.lora else 0)
        graphs = DecodeGraphs(self._decode_forward, inputs, sizes=sizes,
                              sliding_window=self.sliding_window, kv_scales=self.kv_scales,
                              capture=capture, lora_weights=lora_weights)
        try:
            # Captured on the model's GPU whatever this thread's current device is.
            with torch.inference_mode(), use_fused_kernels(self.fused_kernels), \
                    torch.cuda.device(self.device) if self.device.type == "cuda" \
                    else contextlib.nullcontext():
                graphs.capture_all()
        except Exception as exc:  # noqa: BLE001 - any capture failure means: run eagerly
            logger.warning("CUDA graph capture failed; decode steps run eagerly: %s", exc)
            self.decode_graphs = None
            self.cuda_graph_status = f"off: capture failed ({type(exc).__name__}: {exc})"[:500]
            return
        self.decode_graphs = graphs
        self.cuda_graph_status = (
            f"on: {len(sizes)} graphs for decode batches of 1..{max_batch_size}, block tables "
            f"{width} wide, captured in {graphs.capture_seconds:.1f} s" if capture
            else f"static decode buffers for 1..{max_batch_size} rows, run eagerly (no capture)")

    def _decode_forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                        meta: AttentionMetadata) -> torch.Tensor:
        return self.model(input_ids, positions, self.kv_caches, meta)

    def _graph_eligible(self, slices: list[SeqSlice]) -> bool:
        """Pure decode (one token each), nothing captured or overridden, within the buffers.
        (A one-token prompt chunk of a LongRoPE-long sequence, which samples nothing, needs its
        row marked; a graph's rows have no marks: layers.rotary_longrope.)"""
        graphs = self.decode_graphs
        return graphs is not None and len(slices) <= graphs.max_batch_size and all(
            s.num_tokens == 1 and not s.capture and s.embeddings is None
            and (s.sample or not s.long_rope) for s in slices
        ) and graphs.inputs.fits([s.block_table for s in slices])

    def _execute_decode_graph(self, slices: list[SeqSlice],
                              pending: PendingInputs | None) -> StepResult:
        # Graph rows are the slices, in order.
        patch = None if pending is None else self._patch_values(pending, pending.slices)
        hidden = self.decode_graphs.run([s.token_ids[0] for s in slices],
                                        [s.start for s in slices],
                                        [s.block_table for s in slices], patch=patch,
                                        lora_slots=[s.lora_slot for s in slices]
                                        if self.lora is not None else None)
        self._keep_hidden(hidden, list(range(len(slices))))
        sampled = [i for i, s in enumerate(slices) if s.sample]
        if not sampled:
            return StepResult([], None)
        if len(sampled) < len(slices):
            hidden = hidden.index_select(0, to_device(sampled, torch.long, self.device))
        return StepResult(sampled, self.model.compute_logits(hidden))

    # ---- swap ------------------------------------------------------------------------------------
    def _copy_blocks(self, mapping: list[tuple[int, int]], to_host: bool) -> None:
        """Swap out ((device, host) pairs) or in ((host, device) pairs), queued on the stream:
        the host caches are pinned on CUDA and only ever touched by these copies, so nothing
        waits for the device (async scheduling keeps running ahead through swaps)."""
        if not mapping:
            return
        runs = block_runs(mapping)
        for device_pair, host_pair in zip(self.kv_caches + self.draft_kv_caches, self.host_caches):
            for device_cache, host_cache in zip(device_pair, host_pair):
                if to_host:
                    copy_cache_blocks(device_cache, host_cache, runs)
                else:
                    copy_cache_blocks(host_cache, device_cache, runs)

    def _clear_blocks(self, blocks: list[int]) -> None:
        if not blocks or not self.clears_fresh_blocks:
            return
        index = to_device(blocks, torch.long, self.device)
        for pair in self.kv_caches + self.draft_kv_caches:
            for cache in pair:
                zero_cache_blocks(cache, index)

    def _copy_device_blocks(self, mapping: list[tuple[int, int]]) -> None:
        if not mapping:
            return
        src = to_device([a for a, _ in mapping], torch.long, self.device)
        dst = to_device([b for _, b in mapping], torch.long, self.device)
        for k_cache, v_cache in self.kv_caches + self.draft_kv_caches:
            k_cache[dst] = k_cache[src]
            v_cache[dst] = v_cache[src]

    # ---- one step --------------------------------------------------------------------------------
    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepResult:
        with use_fused_kernels(self.fused_kernels):
            return self._execute(step)

    def _execute(self, step: StepInput) -> StepResult:
        self._copy_blocks(step.swap_out, to_host=True)
        self._clear_blocks(step.fresh_blocks)  # (a block swapped out may be handed on at once)
        self._copy_blocks(step.swap_in, to_host=False)
        self._copy_device_blocks(step.copy_blocks)
        self._import_kv(step.kv_imports)
        for slot, lora_id in step.lora_loads:
            self.lora.activate(slot, lora_id)
        if not step.slices:
            return StepResult([], None)
        self.last_hidden = None  # (a step whose drafting had nothing to do left it)
        if self._graph_eligible(step.slices):
            return self._execute_decode_graph(step.slices, step.pending)
        input_ids, _, meta, rows, sampled = self.build(step.slices)
        meta = self._to_device(meta)  # carries the positions to the device too
        overrides = self._embedding_overrides
        if overrides is not None:
            overrides = (overrides[0].to(self.device, non_blocking=True),
                         overrides[1].to(self.device, self.dtype, non_blocking=True))
        # Every copy to the device here is non-blocking: a blocking one waits for the stream,
        # which (async scheduling) still holds the previous step's forward and sampling.
        rows_t = to_device(rows, torch.long, self.device) if sampled else None
        input_ids = input_ids.to(self.device, non_blocking=True)
        if step.pending is not None:
            rows_of = self._first_rows
            target, values = self._patch_values(step.pending,
                                                [rows_of[i] for i in step.pending.slices])
            input_ids.index_copy_(0, target, values)
        hidden = self.model(input_ids, meta.positions, self.kv_caches, meta,
                            embedding_overrides=overrides)
        self._keep_hidden(hidden, self._first_rows)
        captured = capture_rows(self.model, step.slices, self._capture_rows, hidden,
                                chunk_elements=self.capture_chunk_elements,
                                to_host=self.host_outputs) \
            if self._capture_rows else {}
        if not sampled:
            return StepResult([], None, captured)
        return StepResult(sampled, self.model.compute_logits(hidden.index_select(0, rows_t)), captured)

    def _keep_hidden(self, hidden: torch.Tensor, first_rows: list[int]) -> None:
        if self.draft_kv_caches:
            self.last_hidden, self.last_first_rows = hidden, list(first_rows)

    def _patch_values(self, pending: PendingInputs, rows: list[int]
                      ) -> tuple[torch.Tensor, torch.Tensor]:
        """(input rows, their token ids): the pending tokens, gathered on the device."""
        if len(rows) != len(pending.source_rows):
            raise ValueError("pending inputs: one source row per pending slice")
        values = pending.source.index_select(0, to_device(pending.source_rows, torch.long,
                                                          self.device))
        return to_device(rows, torch.long, self.device), values
