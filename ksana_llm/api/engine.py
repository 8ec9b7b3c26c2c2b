"""`Engine`: the Python front of the engine core, stepping it on a background thread.

Callers validate and tokenize on their own thread; the engine thread is the only one that touches
the core. Requests cross over through a small locked inbox, outputs come back through handles.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ksana_llm.api.forward_targets import resolve_target
from ksana_llm.api.model import Model
from ksana_llm.api.outputs import (AsyncDeliveries, ForwardHandle, ForwardOutput, ForwardTarget,
                                   Prompt, Request, RequestHandle, RequestOutput)
from ksana_llm.api.stats import EngineStats, StatsTracker
from ksana_llm.config import EngineConfig
from ksana_llm.distributed.executor import DistributedRunner, WorkerFailure
from ksana_llm.engine.core import TIMEOUT_STOP_REASON, EngineCore
from ksana_llm.engine.outputs import StepOutput
from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.request import ForwardSpec, Sequence
from ksana_llm.engine.scheduler import QueueFullError, QueueTimeoutError, SchedulerConfig
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.memory import available_host_bytes, plan_device_blocks
from ksana_llm.runner.model_runner import ModelRunner, kv_bytes_per_block
from ksana_llm.runner.sampler import Sampler

logger = logging.getLogger("ksana_llm.engine")

__all__ = ["Engine", "EngineDeadError", "QueueFullError"]


class EngineDeadError(RuntimeError):
    """The engine stopped (shutdown, or an internal error); it accepts no more requests."""


def _as_config(value: GenerationConfig | dict[str, Any] | None,
               default: GenerationConfig) -> GenerationConfig:
    if value is None:
        return default
    if isinstance(value, GenerationConfig):
        return value
    if isinstance(value, dict):
        return default.replace(**value)
    raise ValueError(f"generation_config must be a GenerationConfig or a dict, got {type(value).__name__}")


class Engine:
    """Continuous-batching generation over one model.

    `max_batch_size` is the token budget of one forward step (as in the KTransformers guide);
    `max_queue_size` bounds the waiting requests (beyond it `submit` raises QueueFullError);
    `scheduler` is "fifo" or "priority". Any other `EngineConfig` field may be passed by name,
    or a whole `config`.
    """

    def __init__(self, model: Model | str | None = None, tokenizer: Any = None,
                 generation_config: GenerationConfig | None = None, *,
                 max_batch_size: int | None = None, max_queue_size: int | None = None,
                 scheduler: str | None = None, config: EngineConfig | None = None,
                 **engine_kwargs: Any) -> None:
        overrides = dict(engine_kwargs)
        if max_batch_size is not None:
            overrides["max_step_tokens"] = max_batch_size
        if max_queue_size is not None:
            overrides["max_queue_size"] = max_queue_size
        if scheduler is not None:
            overrides["scheduler_policy"] = scheduler
        base = config or EngineConfig()
        self.config = EngineConfig(**{**base.model_dump(), **overrides})
        if not isinstance(model, Model):
            model = Model.from_pretrained(
                model if model is not None else self.config.model, device=self.config.device,
                dtype=self.config.dtype, tensor_parallel_size=self.config.tensor_parallel_size,
                pipeline_parallel_size=self.config.pipeline_parallel_size)
        self.model = model
        self.tokenizer = tokenizer or model.tokenizer
        self.generation_config = generation_config or GenerationConfig()
        self._core = self._build_core()
        self._stats = StatsTracker()
        self._inbox: list[tuple[Sequence, RequestHandle]] = []
        self._aborts: list[str] = []
        self._handles: dict[str, RequestHandle] = {}
        # The core's queue as of the last step (picked-up inbox requests count as waiting until
        # then), guarded by _wake: what admission control sees from callers' threads.
        self._num_waiting = 0
        self._num_running = 0
        self._wake = threading.Condition()
        self._stopping = False
        self._dead: BaseException | None = None
        self._ids = itertools.count()
        self._grammar_compiler: Any = None  # built on the first structured-output request
        self._grammar_lock = threading.Lock()
        self._thread = threading.Thread(target=self._loop, name="ksana-llm-engine", daemon=True)
        self._thread.start()

    def _build_core(self) -> EngineCore:
        cfg, model = self.config, self.model
        per_block = kv_bytes_per_block(model.module, cfg.block_token_num, model.dtype)
        # CUDA: what remains after a profiled run of the largest step; CPU: a share of RAM.
        num_blocks = cfg.num_device_blocks or plan_device_blocks(
            model.module, device=model.device, dtype=model.dtype, block_size=cfg.block_token_num,
            max_step_tokens=cfg.max_step_tokens, max_num_seqs=cfg.max_num_seqs,
            attention_backend=cfg.attention_backend, ratio=cfg.block_device_memory_ratio,
            reserved_ratio=cfg.reserved_device_memory_ratio)
        # A sequence can never outgrow the model's context, nor the whole KV pool.
        max_model_len = min(cfg.max_model_len or model.max_context, model.max_context,
                            num_blocks * cfg.block_token_num)
        num_host_blocks = 0
        if cfg.preempt_mode == 0:
            # The swap pool mirrors the device pool, but never more than half the free host RAM
            # (a GPU's cache can be larger than the machine's memory).
            num_host_blocks = min(int(num_blocks * cfg.block_host_memory_factor),
                                  available_host_bytes() // 2 // per_block)
        block_manager = BlockManager(num_blocks, cfg.block_token_num,
                                     enable_prefix_caching=cfg.enable_prefix_caching,
                                     num_host_blocks=num_host_blocks)
        runner_kwargs = dict(num_blocks=num_blocks, block_size=cfg.block_token_num,
                             num_host_blocks=num_host_blocks,
                             attention_backend=cfg.attention_backend,
                             max_model_len=max_model_len, cuda_graphs=cfg.enable_cuda_graphs,
                             cuda_graph_max_batch_size=cfg.cuda_graph_max_batch_size
                             or cfg.max_num_seqs)
        runner = ModelRunner(model.module, device=model.device, dtype=model.dtype, **runner_kwargs)
        if model.runtime is not None:
            # A parallel run: every step also goes to the worker ranks, which build the same
            # runner (same block count, so block tables mean the same thing everywhere).
            runner = DistributedRunner(runner, model.runtime, runner_kwargs, model.workers,
                                       on_failure=self._on_worker_failure)
        scheduler_config = SchedulerConfig(
            max_step_tokens=cfg.max_step_tokens, max_num_seqs=cfg.max_num_seqs,
            split_fuse_token_num=cfg.split_fuse_token_num, preempt_mode=cfg.preempt_mode,
            policy=cfg.scheduler_policy,
            # Admission control happens in submit(); requests it admits to start at once sit in
            # the core's waiting list until the next step, so the core's bound leaves them room.
            max_queue_size=cfg.max_queue_size + cfg.max_num_seqs)
        self.max_model_len = max_model_len
        logger.info("KV cache: %d blocks of %d tokens (%.0f MiB), %d host blocks", num_blocks,
                    cfg.block_token_num, num_blocks * per_block / 2**20, num_host_blocks)
        overlap = cfg.overlap_output_processing
        if overlap is None:
            overlap = model.device.type == "cuda"
        return EngineCore(runner, block_manager, scheduler_config, self.tokenizer,
                          max_model_len=self.max_model_len, sampler=Sampler(cfg.seed),
                          overlap_outputs=overlap)

    # ---- validation (caller's thread) -------------------------------------------------------------
    def _tokenize(self, prompt: Prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt must be a non-empty string or list of token ids")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, (list, tuple)) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return list(prompt)
        raise ValueError("prompt must be a non-empty string or a non-empty list of token ids")

    def _check_token_ids(self, token_ids: list[int], prompt: Prompt) -> None:
        """Every id the model will embed must be in its vocabulary: an id past the embedding
        table would fail the whole step, and with it every request in the batch."""
        vocab = self.model.vocab_size
        bad = [t for t in token_ids if not 0 <= t < vocab]
        if not bad:
            return
        if isinstance(prompt, str):
            raise ValueError(f"prompt: the tokenizer gave token ids outside the model's vocabulary "
                             f"[0, {vocab}): {bad[:5]} (does the tokenizer match the model?)")
        raise ValueError(f"prompt token ids must be in [0, {vocab}); got {bad[:5]}")

    def _make_sequence(self, request: Request) -> tuple[Sequence, Any]:
        """Validate and build the request's first sequence (caller's thread); also returns what
        the model's plugin preprocess gave (for its postprocess), or None."""
        config = _as_config(request.generation_config, self.generation_config)
        token_ids = self._tokenize(request.prompt)
        embeddings = self._check_embeddings(request.input_embeddings, len(token_ids))
        plugin_info = None
        plugin = getattr(self.model, "plugin", None)
        if plugin is not None:
            plugin_info = plugin.run_preprocess(
                token_ids, generation_config=config,
                prompt=request.prompt if isinstance(request.prompt, str) else None,
                input_embeddings=embeddings, additional_params=request.additional_params)
            token_ids, config = plugin_info.token_ids, plugin_info.generation_config
            embeddings = plugin_info.input_embeddings
        self._check_token_ids(token_ids, request.prompt)
        if len(token_ids) >= self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len (the model's context, "
                             f"bounded by the KV cache) is {self.max_model_len}, leaving no room "
                             "to generate")
        if isinstance(request.priority, bool) or not isinstance(request.priority, int):
            raise ValueError(f"priority must be an integer, got {request.priority!r}")
        self._check_config(config)
        request_id = request.request_id or f"req-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        eos = () if config.ignore_eos else self.model.eos_token_ids
        seq = Sequence(request_id, token_ids, config, eos_token_ids=eos, priority=request.priority)
        if embeddings is not None:
            seq.embeddings = (tuple(embeddings[0]), embeddings[1])
        if config.prompt_logprobs is not None:
            seq.prompt_logprobs = {}
        if config.structured_output is not None:
            # Compiled here, so an invalid schema is a ValueError in the caller's thread.
            seq.matcher = self._grammar().matcher(config.structured_output)
        return seq, plugin_info

    def _check_config(self, config: GenerationConfig) -> None:
        """What GenerationConfig cannot check alone: limits of this model and engine."""
        vocab = self.model.vocab_size
        bad = [t for t in config.logit_bias if t >= vocab]
        if bad:
            raise ValueError(f"logit_bias token ids must be in [0, {vocab}); got {bad[:5]}")
        if config.num_sequences > self.config.max_num_seqs:
            what = "num_beams" if config.use_beam_search else (
                "best_of" if config.best_of else "num_return_sequences")
            raise ValueError(f"{what} must be <= max_num_seqs ({self.config.max_num_seqs}), "
                             f"got {config.num_sequences}")

    def _check_embeddings(self, value: Any, num_tokens: int) -> tuple[list[int], Any] | None:
        """`Request.input_embeddings` -> (positions, rows on the model's device and dtype)."""
        if value is None:
            return None
        import torch

        hidden = int(self.model.hf_config.hidden_size)
        try:
            positions, rows = value
        except (TypeError, ValueError):
            raise ValueError("input_embeddings must be (positions, tensor of [len(positions), "
                             "hidden_size])") from None
        if not isinstance(positions, (list, tuple)) or not positions or not all(
                isinstance(p, int) and not isinstance(p, bool) and 0 <= p < num_tokens
                for p in positions) or len(set(positions)) != len(positions):
            raise ValueError(f"input_embeddings positions must be distinct prompt positions in "
                             f"[0, {num_tokens}), got {positions!r}")
        if not isinstance(rows, torch.Tensor) or tuple(rows.shape) != (len(positions), hidden):
            shape = tuple(rows.shape) if isinstance(rows, torch.Tensor) else type(rows).__name__
            raise ValueError(f"input_embeddings rows must be a tensor of shape "
                             f"({len(positions)}, {hidden}), got {shape}")
        return list(positions), rows.detach().to(self.model.device, self.model.dtype)

    @property
    def grammar_compiler(self) -> Any:
        """The engine's structured-output compiler (a `ksana_llm.structured.GrammarCompiler`):
        callers that validate a spec early (the server) compile through it, so the compile at
        submit is a cache hit."""
        return self._grammar()

    def _grammar(self) -> Any:
        """The structured-output compiler, built on first use (it needs xgrammar and a scan of
        the tokenizer's vocabulary)."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                if self.tokenizer is None:
                    raise ValueError("structured_output needs a tokenizer; this model has none")
                from ksana_llm.structured import GrammarCompiler

                self._grammar_compiler = GrammarCompiler(
                    self.tokenizer, self.model.vocab_size,
                    stop_token_ids=list(self.model.eos_token_ids) or None)
            return self._grammar_compiler

    def submit_forward(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]], *,
                       request_id: str | None = None,
                       loop: asyncio.AbstractEventLoop | None = None) -> ForwardHandle:
        """Queue a forward-only request (no sampling, no prefix-cache hits); returns its handle.
        Raises ValueError naming the bad field, QueueFullError, EngineDeadError."""
        token_ids = self._tokenize(prompt)
        if len(token_ids) > self.max_model_len:
            raise ValueError(f"prompt is {len(token_ids)} tokens; max_model_len (the model's "
                             f"context, bounded by the KV cache) is {self.max_model_len}")
        if not isinstance(targets, (list, tuple)) or not targets:
            raise ValueError("targets must be a non-empty list of ForwardTarget")
        resolved = [resolve_target(j, t, len(token_ids), self.model.vocab_size)
                    for j, t in enumerate(targets)]
        targets = [t for t, _ in resolved]
        positions = [ps for _, ps in resolved]
        spec = ForwardSpec(tuple(sorted({p for ps in positions for p in ps})),
                           logits=any(t.target_name == "logits" for t in targets),
                           hidden=any(t.target_name == "layernorm" for t in targets))
        request_id = request_id or f"fwd-{next(self._ids)}-{uuid.uuid4().hex[:8]}"
        seq = Sequence(request_id, token_ids, self.generation_config, forward=spec)
        return ForwardHandle(self._enqueue(seq, None, loop, None), list(targets), positions)

    def forward(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]], *,
                request_id: str | None = None) -> ForwardOutput:
        """Run the prompt through the model once and return the requested rows (see ForwardTarget)."""
        return self.submit_forward(prompt, targets, request_id=request_id).result()

    async def forward_async(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]], *,
                            request_id: str | None = None) -> ForwardOutput:
        handle = self.submit_forward(prompt, targets, request_id=request_id,
                                     loop=asyncio.get_running_loop())
        try:
            return await handle.aresult()
        except asyncio.CancelledError:
            self.abort(handle.id)
            raise

    # ---- submission ------------------------------------------------------------------------------
    def submit(self, request: Request | Prompt, *,
               loop: asyncio.AbstractEventLoop | None = None) -> RequestHandle:
        """Queue a request; returns its handle at once. Raises ValueError for bad input,
        QueueFullError when `max_queue_size` requests are already waiting."""
        if not isinstance(request, Request):
            request = Request(request)
        seq, plugin_info = self._make_sequence(request)
        return self._enqueue(seq, request.callback, loop, plugin_info)

    def _enqueue(self, seq: Sequence, callback: Any, loop: asyncio.AbstractEventLoop | None,
                 plugin_info: Any) -> RequestHandle:
        handle = RequestHandle(seq.request_id, seq.prompt_token_ids, seq.config,
                               callback=callback, loop=loop)
        handle.plugin_info = plugin_info
        handle.output.metrics.arrival_time = seq.arrival_time
        with self._wake:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine is not running: {self._dead or 'shut down'}")
            if seq.request_id in self._handles:
                raise ValueError(f"request_id {seq.request_id!r} is already in use")
            if self._num_queued() >= self.config.max_queue_size:
                raise QueueFullError(f"the waiting queue is full ({self.config.max_queue_size} "
                                     "requests); retry later")
            self._inbox.append((seq, handle))
            self._handles[seq.request_id] = handle
            self._wake.notify()
        return handle

    def _num_queued(self) -> int:
        """Requests that would wait if one more came now: those not yet running, less the free
        sequence slots they are about to take (so a request that starts at once never counts
        as queued, however quickly the next one arrives). Call with _wake held."""
        free_slots = max(0, self.config.max_num_seqs - self._num_running)
        return max(0, self._num_waiting + len(self._inbox) - free_slots)

    def abort(self, request_id: str) -> None:
        """Stop a request; its handle finishes with finish_reason "abort" and its blocks are freed."""
        with self._wake:
            self._aborts.append(request_id)
            self._wake.notify()

    # ---- generation -------------------------------------------------------------------------------
    def generate_outputs(self, prompts: Prompt | list[Prompt],
                         generation_config: GenerationConfig | list[GenerationConfig] | None = None,
                         *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Run many prompts to completion (submitted as the queue allows), in input order."""
        batch = self._as_batch(prompts)
        configs = generation_config if isinstance(generation_config, list) else [generation_config] * len(batch)
        if len(configs) != len(batch):
            raise ValueError("generation_config: give one config, or one per prompt")
        # Validate (and preprocess) everything before running anything.
        prepared = [self._make_sequence(Request(p, c)) for p, c in zip(batch, configs)]
        handles: list[RequestHandle] = []
        progress = None
        if use_tqdm and len(prepared) > 1:
            from tqdm import tqdm

            progress = tqdm(total=len(prepared), desc="Generating", unit="req")
        pending = deque(prepared)
        try:
            while pending:
                try:
                    seq, plugin_info = pending[0]
                    handles.append(self._enqueue(seq, None, None, plugin_info))
                    pending.popleft()
                except QueueFullError:
                    self._wait_one(handles, progress)
            return [self._finish_one(h, progress) for h in handles]
        finally:
            if progress is not None:
                progress.close()

    def _wait_one(self, handles: list[RequestHandle], progress: Any) -> None:
        for h in handles:
            if not h.finished:
                self._finish_one(h, progress)
                return

    @staticmethod
    def _finish_one(handle: RequestHandle, progress: Any) -> RequestOutput:
        already = handle.finished
        out = handle.result()
        if progress is not None and not already:
            progress.update(1)
        return out

    @staticmethod
    def _as_batch(prompts: Prompt | list[Prompt]) -> list[Prompt]:
        if isinstance(prompts, str) or (isinstance(prompts, list) and prompts
                                        and all(isinstance(t, int) for t in prompts)):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts:
            return list(prompts)
        raise ValueError("prompt must be a string, a list of token ids, or a non-empty list of those")

    def generate(self, prompts: Prompt | list[Prompt], generation_config: GenerationConfig | None = None,
                 *, stream: bool = False, use_tqdm: bool = True) -> str | list[str] | Iterator[str]:
        """One prompt -> its text; a list -> a list of texts; stream=True -> text deltas."""
        single = isinstance(prompts, str) or (isinstance(prompts, list) and bool(prompts)
                                              and all(isinstance(t, int) for t in prompts))
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            return iter(self.submit(Request(prompts, generation_config)))
        outputs = self.generate_outputs(prompts, generation_config, use_tqdm=use_tqdm)
        return outputs[0].text if single else [o.text for o in outputs]

    async def generate_async(self, prompt: Prompt | Request,
                             generation_config: GenerationConfig | None = None) -> str:
        return (await self.generate_output_async(prompt, generation_config)).text

    async def generate_output_async(self, prompt: Prompt | Request,
                                    generation_config: GenerationConfig | None = None) -> RequestOutput:
        request = prompt if isinstance(prompt, Request) else Request(prompt, generation_config)
        handle = self.submit(request, loop=asyncio.get_running_loop())
        try:
            return await handle.aresult()
        except asyncio.CancelledError:
            self.abort(handle.id)
            raise

    async def stream_async(self, prompt: Prompt | Request,
                           generation_config: GenerationConfig | None = None) -> AsyncIterator[str]:
        request = prompt if isinstance(prompt, Request) else Request(prompt, generation_config)
        handle = self.submit(request, loop=asyncio.get_running_loop())
        finished = False
        try:
            async for delta in handle.astream():
                yield delta
            finished = True
        finally:
            if not finished:  # the consumer stopped early or was cancelled: free the blocks
                self.abort(handle.id)

    # ---- introspection and lifecycle --------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats.snapshot(self._core.stats(), num_inbox=len(self._inbox))

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine, when it died rather than being shut down."""
        return self._dead

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step loop; unfinished requests fail with EngineDeadError. In a parallel run
        the worker ranks are told to stop too."""
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is not self._thread:
            self._thread.join(timeout)
            if isinstance(self._core.runner, DistributedRunner) and not self._thread.is_alive():
                self._core.runner.close()

    def _on_worker_failure(self, message: str) -> None:
        """A worker rank died (seen between steps): the engine cannot go on, so it stops and
        every waiting request fails with that reason; health turns unhealthy."""
        with self._wake:
            if self._dead is None:
                self._dead = WorkerFailure(message)
            self._stopping = True
            self._wake.notify()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.shutdown()

    # ---- the engine thread ------------------------------------------------------------------------
    def _loop(self) -> None:
        core = self._core
        try:
            while True:
                with self._wake:
                    while not (self._inbox or self._aborts or self._stopping or core.has_work()):
                        self._wake.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    self._num_waiting += len(inbox)
                    aborts, self._aborts = self._aborts, []
                for seq, handle in inbox:
                    try:
                        core.add(seq)
                    except (QueueFullError, ValueError) as exc:
                        self._handles.pop(seq.request_id, None)
                        handle.fail(exc)
                for request_id in aborts:
                    self._dispatch(core.abort(request_id))
                if self.config.waiting_timeout_ms is not None:
                    self._dispatch(core.expire_waiting(self.config.waiting_timeout_ms / 1000))
                if core.has_work():
                    self._dispatch_step(core.step(early=self._dispatch_step))
                with self._wake:
                    self._num_waiting = len(core.scheduler.waiting) + len(core.scheduler.swapped)
                    self._num_running = len(core.scheduler.running)
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiter
            logger.exception("engine step loop failed")
            self._dead = exc
        finally:
            self._fail_all(self._dead or EngineDeadError("the engine was shut down"))

    def _dispatch_step(self, outputs: list[StepOutput]) -> None:
        self._stats.record_outputs(outputs)
        self._dispatch(outputs)

    def _dispatch(self, outputs: list) -> None:
        now = time.monotonic()
        batch = AsyncDeliveries()
        try:
            for out in outputs:
                self._deliver(out, now, batch)
        finally:
            batch.flush()

    def _deliver(self, out: StepOutput, now: float, batch: AsyncDeliveries) -> None:
        handle = self._handles.get(out.request_id)
        if handle is None:
            return
        if out.finished and out.stop_reason == TIMEOUT_STOP_REASON and not out.new_token_ids:
            del self._handles[out.request_id]
            handle.fail(QueueTimeoutError(
                f"request {out.request_id} waited over {self.config.waiting_timeout_ms} ms "
                "(waiting_timeout_ms) without being scheduled"), batch)
            return
        handle.deliver(out, now, self._postprocess(handle) if out.finished else None, batch)
        if out.finished:
            del self._handles[out.request_id]
            self._stats.record_finished(handle.output)

    def _postprocess(self, handle: RequestHandle) -> Any:
        """The model plugin's postprocess for a finishing request, or None (no plugin, or a
        forward-only request)."""
        plugin = getattr(self.model, "plugin", None)
        if plugin is None or handle.forward_result is not None:
            return None
        return lambda output: plugin.run_postprocess(handle.plugin_info, output)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            self._stopping = True
            pending = list(self._handles.values())
            self._handles.clear()
            self._inbox.clear()
        for handle in pending:
            handle.fail(error)
