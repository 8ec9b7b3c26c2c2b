"""CUDA graphs for pure-decode steps: one graph per batch-size bucket, replayed from static inputs.

A decode step of a small model is hundreds of tiny kernels; launched one by one from Python the
GPU mostly waits for the CPU. A graph records the launches once and replays them in one call.
Graphs need fixed shapes and fixed addresses, so:

- Only steps where every sequence computes one token (pure decode) with the Triton attention
  backend replay a graph; everything else runs eagerly.
- Batch sizes are rounded up to a bucket (1, 2, 4, 8, 16, 24, ... up to the largest); the extra
  rows are padding: slot -1 (`store_kv` skips it) and context length 0 (the decode kernel reads
  nothing and writes zeros for them), so they touch no KV block.
- Inputs live in static device buffers sized for the largest bucket; the block tables are padded
  to the widest a sequence can need (`max_model_len / block_size`), which is also what the decode
  kernel derives its split count from, so a graph's launches fit every step of its bucket.
- Each step's inputs are written into pinned host buffers with NumPy (no per-token Python loop)
  and reach the device in two asynchronous copies. Two host buffers alternate, each guarded by an
  event, so a copy still in flight is never overwritten.
- An engine with LoRA slots captures its graphs with every slot's adapters in them (a static
  per-row mask picks each row's slot, all zeros for the base model), as vLLM does: adapter
  requests decode through graphs too, and a base-model step pays for the idle slots' products.
- Graphs are captured largest first into one shared memory pool (they never run concurrently and
  their outputs are copied into one static buffer outside the pool), after an eager warm-up of
  the same bucket that compiles the kernels and builds lazy tables (RoPE).

`DecodeGraphs(capture=False)` runs the very same static-buffer forward eagerly: that is how the
padding and buffer logic is tested on CPU, and the fallback if a capture fails.
"""

from __future__ import annotations

import bisect
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch
from torch import nn

from ksana_llm.layers.attention import AttentionMetadata, KernelBatch
from ksana_llm.layers.lora import LoraBatch, LoraWeights
from ksana_llm.runner.host_arrays import fill_block_tables, longest_first

# Small buckets one by one (batch-1 latency matters), then every multiple of this.
_SMALL_BUCKETS = (1, 2, 4, 8)
BUCKET_STEP = 8

# (input ids, positions, metadata) -> final hidden states [T, hidden]
DecodeForward = Callable[[torch.Tensor, torch.Tensor, AttentionMetadata], torch.Tensor]


def graph_batch_sizes(max_batch_size: int) -> tuple[int, ...]:
    """The buckets: 1, 2, 4, 8, then multiples of 8, and `max_batch_size` itself."""
    if max_batch_size < 1:
        raise ValueError(f"cuda_graph_max_batch_size must be >= 1, got {max_batch_size}")
    sizes = {s for s in _SMALL_BUCKETS if s <= max_batch_size}
    sizes.update(range(2 * BUCKET_STEP, max_batch_size + 1, BUCKET_STEP))
    sizes.add(max_batch_size)
    return tuple(sorted(sizes))


def choose_bucket(batch_size: int, sizes: Sequence[int]) -> int | None:
    """The smallest bucket that holds `batch_size` rows; None when it exceeds the largest."""
    i = bisect.bisect_left(sizes, batch_size)
    return sizes[i] if i < len(sizes) else None


def unsupported_reason(model: nn.Module, device: torch.device, attention_backend: str
                       ) -> str | None:
    """Why decode steps of this model cannot be captured here, or None when they can.

    A model opts out with `supports_cuda_graphs = False` (host syncs in its forward). Without the
    attribute, a model is out when one of its modules says it `syncs_with_host`: MoE experts on
    their per-expert torch path size their matmuls from expert counts read back to the host,
    which a graph cannot do (dense experts on the Triton backend do not).
    """
    if device.type != "cuda":
        return f"device is {device.type}: CUDA graphs need a CUDA device"
    if attention_backend != "triton":
        return (f"attention backend is {attention_backend!r}: graphs need the triton backend "
                "(its decode launch has static shapes)")
    supported = getattr(model, "supports_cuda_graphs", None)
    if supported is None:
        # The backend is Triton here, so the step runs with the fused kernels.
        supported = not any(m.syncs_with_host(True) for m in model.modules()
                            if hasattr(m, "syncs_with_host"))
    if not supported:
        return f"{type(model).__name__} syncs with the host in its forward (no CUDA graphs)"
    if torch.distributed.is_available() and torch.distributed.is_initialized() \
            and torch.distributed.get_world_size() > 1:
        return "parallel runs stay eager for now (ranks would have to capture in lockstep)"
    return None


class DecodeInputs:
    """The static device buffers a captured decode graph reads, and their pinned host mirrors.

    Device layout: `longs` [3, B] int64 = input ids, positions, slots; `ints` [2B + B * W]
    int32 = the decode kernel's program order (`longest_first`), context lengths, then the
    block tables as [B, W]. B is the largest bucket, W the widest block
    table. A step fills the host mirror and copies the first `bucket` rows' worth of each.
    With LoRA slots (`lora_slots` > 0), `lora_mask` [B, lora_slots] marks each row's adapter
    (a row of False: the base model, and the padding rows).
    """

    def __init__(self, max_batch_size: int, max_blocks_per_seq: int, device: torch.device,
                 block_size: int, lora_slots: int = 0) -> None:
        b, w = max_batch_size, max_blocks_per_seq
        self.max_batch_size, self.width, self.block_size = b, w, block_size
        self.device = device
        self.lora_mask = torch.zeros(b, lora_slots, dtype=torch.bool, device=device) \
            if lora_slots else None
        self.longs = torch.zeros(3, b, dtype=torch.long, device=device)
        self.longs[2].fill_(-1)  # padding slots: no KV write
        # [b program order | b context lens | b x w block tables]: one copy fills all three
        self.ints = torch.zeros(2 * b + b * w, dtype=torch.int32, device=device)
        pin = device.type == "cuda"
        self._host_longs = [torch.zeros(3, b, dtype=torch.long, pin_memory=pin) for _ in range(2)]
        self._host_ints = [torch.zeros(2 * b + b * w, dtype=torch.int32, pin_memory=pin)
                           for _ in range(2)]
        self._host_lora = [torch.zeros(b, lora_slots, dtype=torch.bool, pin_memory=pin)
                           for _ in range(2)] if lora_slots else None
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0

    # ---- device views (fixed addresses: what the graphs read) ---------------------------------
    def input_ids(self, bucket: int) -> torch.Tensor:
        return self.longs[0, :bucket]

    def positions(self, bucket: int) -> torch.Tensor:
        return self.longs[1, :bucket]

    def slots(self, bucket: int) -> torch.Tensor:
        return self.longs[2, :bucket]

    def order(self, bucket: int) -> torch.Tensor:
        """The decode kernel's program order over the rows (`longest_first`)."""
        return self.ints[:bucket]

    def context_lens(self, bucket: int) -> torch.Tensor:
        b = self.max_batch_size
        return self.ints[b:b + bucket]

    def block_tables(self, bucket: int) -> torch.Tensor:
        b = self.max_batch_size
        return self.ints[2 * b:2 * b + bucket * self.width].view(bucket, self.width)

    def metadata(self, bucket: int, sliding_window: int | None,
                 kv_scales: tuple[float, ...] = (),
                 lora_weights: dict[str, LoraWeights] | None = None) -> AttentionMetadata:
        """Attention metadata over the static views of one bucket (no prefill part); with
        `lora_weights` (every adaptable projection's stacks), the adapters of every slot, picked
        per row by `lora_mask`."""
        tables = self.block_tables(bucket)
        batch = KernelBatch(
            decode_block_tables=tables, decode_context_lens=self.context_lens(bucket),
            prefill_block_tables=tables[:0],
            prefill_query_start_loc=torch.zeros(1, dtype=torch.int32, device=self.device),
            prefill_seq_lens=self.context_lens(0), decode_order=self.order(bucket))
        lora = None
        if lora_weights is not None and self.lora_mask is not None:
            lora = LoraBatch(lora_weights, self.lora_mask[:bucket])
        return AttentionMetadata(slot_mapping=self.slots(bucket), positions=self.positions(bucket),
                                 num_decodes=bucket, kernel_batch=batch,
                                 sliding_window=sliding_window, kv_scales=kv_scales, lora=lora)

    # ---- filling ---------------------------------------------------------------------------------
    def fits(self, block_tables: Sequence[Sequence[int]]) -> bool:
        """Whether these rows fit the buffers: not too many, every table within the width."""
        return len(block_tables) <= self.max_batch_size and all(
            len(t) <= self.width for t in block_tables)

    def fill(self, token_ids: Sequence[int], starts: Sequence[int],
             block_tables: Sequence[Sequence[int]], bucket: int,
             lora_slots: Sequence[int] | None = None) -> None:
        """Write one decode step (row i: token `token_ids[i]` at position `starts[i]`, whose
        sequence has `block_tables[i]`, with LoRA slot `lora_slots[i]`, 0 = none) into the device
        buffers, padded to `bucket` rows.

        Asynchronous on CUDA: two contiguous copies from a pinned host buffer, which is reused
        only once the copy that last read it has finished."""
        n, b, w, bs = len(starts), self.max_batch_size, self.width, self.block_size
        if not n <= bucket <= b:
            raise ValueError(f"decode rows: need rows <= bucket <= {b}, got {n} and {bucket}")
        turn = self._turn
        self._turn ^= 1
        event = self._copied[turn]
        if event is not None:
            event.synchronize()
        host_longs, host_ints = self._host_longs[turn], self._host_ints[turn]
        longs, ints = host_longs.numpy(), host_ints.numpy()

        pos = np.fromiter(starts, dtype=np.int64, count=n)
        tables = ints[2 * b:2 * b + bucket * w].reshape(bucket, w)
        # Columns past a row's own table keep stale values: the kernel reads only the blocks
        # its context length covers.
        fill_block_tables(tables, block_tables)
        longs[0, :n] = np.fromiter(token_ids, dtype=np.int64, count=n)
        longs[1, :n] = pos
        longs[2, :n] = tables[np.arange(n), pos // bs].astype(np.int64) * bs + pos % bs
        ints[b:b + n] = pos + 1
        ints[:bucket] = longest_first(pos, bucket)  # positions order as lengths do
        # Padding rows: token 0 at position 0, no KV slot, empty context (table rows unread).
        longs[0:2, n:bucket] = 0
        longs[2, n:bucket] = -1
        ints[b + n:b + bucket] = 0

        self.longs.copy_(host_longs, non_blocking=True)  # whole: contiguous, 24 bytes a row
        used = 2 * b + bucket * w
        self.ints[:used].copy_(host_ints[:used], non_blocking=True)
        if self.lora_mask is not None:
            host_lora = self._host_lora[turn]
            host_lora[:bucket].zero_()
            rows = [(i, slot - 1) for i, slot in enumerate(lora_slots or ()) if slot]
            if rows:
                host_lora[[r for r, _ in rows], [c for _, c in rows]] = True
            self.lora_mask[:bucket].copy_(host_lora[:bucket], non_blocking=True)
        if self.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.device))
            self._copied[turn] = done


class DecodeGraphs:
    """Decode forwards over `DecodeInputs`, one per bucket: replayed CUDA graphs (`capture=True`)
    or the same static-buffer forward run eagerly (`capture=False`)."""

    def __init__(self, forward: DecodeForward, inputs: DecodeInputs, *, sizes: Sequence[int],
                 sliding_window: int | None, capture: bool,
                 kv_scales: tuple[float, ...] = (),
                 lora_weights: dict[str, LoraWeights] | None = None) -> None:
        if not sizes or max(sizes) > inputs.max_batch_size:
            raise ValueError(f"graph batch sizes {tuple(sizes)} must be within the static "
                             f"buffers' {inputs.max_batch_size} rows")
        self.forward = forward
        self.inputs = inputs
        self.sizes = tuple(sorted(sizes))
        self.capture = capture
        # Allocated by the first (eager) run, outside any graph's pool: the forward's width.
        self.hidden: torch.Tensor | None = None
        self._meta = {bs: inputs.metadata(bs, sliding_window, kv_scales, lora_weights)
                      for bs in self.sizes}
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.capture_seconds = 0.0
        self.steps_run = 0  # decode steps served from the static buffers (graph replays)

    @property
    def max_batch_size(self) -> int:
        return self.sizes[-1]

    def _run(self, bucket: int) -> None:
        inputs = self.inputs
        out = self.forward(inputs.input_ids(bucket), inputs.positions(bucket), self._meta[bucket])
        if self.hidden is None:
            self.hidden = out.new_zeros(inputs.max_batch_size, out.shape[1])
        self.hidden[:bucket] = out

    def capture_all(self) -> None:
        """Warm up and capture every bucket, largest first, into one memory pool."""
        if not self.capture:
            return
        start = time.perf_counter()
        pool = None
        for bucket in reversed(self.sizes):
            self._run(bucket)  # warm-up: kernel compilation, lazy tables, cuBLAS workspaces
            torch.cuda.synchronize(self.inputs.device)
            graph = torch.cuda.CUDAGraph()
            # thread_local: only this thread's unsafe calls break the capture. Captures also
            # happen on waking from sleep, while another thread of the process (an RL
            # trainer's) may sync or allocate; "global" would fail the capture and raise in
            # that thread.
            with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
                self._run(bucket)
            if pool is None:
                pool = graph.pool()
            self._graphs[bucket] = graph
        torch.cuda.synchronize(self.inputs.device)
        self.capture_seconds = time.perf_counter() - start

    def run(self, token_ids: Sequence[int], starts: Sequence[int],
            block_tables: Sequence[Sequence[int]],
            patch: tuple[torch.Tensor, torch.Tensor] | None = None,
            lora_slots: Sequence[int] | None = None) -> torch.Tensor:
        """Hidden states [n, hidden] of one pure-decode step of n <= max_batch_size rows. The
        result is a view of a static buffer: read it before the next call. `patch` = (rows,
        token ids), on the device: input ids written over the host's (async scheduling).
        `lora_slots`: each row's adapter slot (graphs built with LoRA slots only)."""
        n = len(starts)
        bucket = choose_bucket(n, self.sizes)
        if bucket is None:
            raise ValueError(f"{n} decode rows exceed the largest graph bucket {self.sizes[-1]}")
        self.inputs.fill(token_ids, starts, block_tables, bucket, lora_slots)
        if patch is not None:
            self.inputs.input_ids(bucket).index_copy_(0, *patch)
        self.steps_run += 1
        if self.capture:
            self._graphs[bucket].replay()
        else:
            self._run(bucket)
        return self.hidden[:n]
