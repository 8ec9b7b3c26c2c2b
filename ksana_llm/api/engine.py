"""`Engine`: the Python front of the engine core, stepping it on a background thread.

Callers validate and tokenize on their own thread; the engine thread is the only one that touches
the core. Requests cross over through a small locked inbox, outputs come back through handles.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from contextlib import nullcontext
from typing import Any

import torch

from ksana_llm.api.chat import ChatMixin
from ksana_llm.api.core_builder import build_core
from ksana_llm.api.exit_hook import ExitHook
from ksana_llm.api.forward_calls import ForwardCalls
from ksana_llm.api.pooling_calls import PoolingCalls
from ksana_llm.api.profile_control import ProfileControl
from ksana_llm.api.generation_defaults import model_generation_config
from ksana_llm.api.lora_control import LoraControl
from ksana_llm.api.lora_registry import LoraRegistry, startup_adapters
from ksana_llm.api.model import Model
from ksana_llm.api.output_delivery import OutputDelivery
from ksana_llm.api.request_handle import RequestHandle
from ksana_llm.api.request_builder import RequestBuilder
from ksana_llm.api.request_intake import EngineDeadError, RequestIntake
from ksana_llm.api.sleep_control import SleepControl
from ksana_llm.api.stats import EngineStats, StatsTracker
from ksana_llm.api.weight_control import WeightControl
from ksana_llm.config import EngineConfig, ReasoningConfig
from ksana_llm.distributed.executor import DistributedRunner, WorkerFailure
from ksana_llm.engine.request import Sequence
from ksana_llm.engine.scheduler_records import QueueFullError
from ksana_llm.engine.scheduling_policy import SchedulingPolicy
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.cpu_threads import openmp_pool_releaser
from ksana_llm.runner.gc_heap import freeze_startup_heap, thaw_heap
from ksana_llm.runner.kv_transfer import KvLayout

logger = logging.getLogger("ksana_llm.engine")

__all__ = ["Engine", "EngineDeadError", "QueueFullError"]


# While asleep (sleep mode) with requests queued, how often their waiting_timeout_ms is checked.
ASLEEP_EXPIRY_CHECK_S = 0.05
# How often the step loop looks for requests nobody can read any more (see _abort_unreadable).
UNREADABLE_CHECK_S = 0.5


class Engine(RequestIntake, OutputDelivery, LoraControl, WeightControl, SleepControl, ForwardCalls,
             PoolingCalls, ChatMixin, ProfileControl):
    """Continuous-batching generation over one model.

    `max_batch_size` is the token budget of one forward step (as in the KTransformers guide);
    `max_queue_size` bounds the waiting requests (beyond it `submit` raises QueueFullError);
    `scheduler` orders the requests: "fifo", "priority", or a `SchedulingPolicy` of your own
    (an instance, its class, or its import path "module:Class"). Any other `EngineConfig` field may be passed by name,
    or a whole `config`. LoRA adapters: `lora_modules` (name -> folder) load at start-up, a
    request names one (`Request(lora=...)`, `generate(..., lora=...)`); see `LoraControl`.
    New weights while serving: `update_weights` (see `WeightControl`); device memory given
    back while idle: `sleep` / `wake_up` (see `SleepControl`).
    `tokenizer`: a tokenizer object, or the folder of one, used instead of the model's own;
    `skip_tokenizer_init=True` (vLLM's) uses none: token-id prompts, outputs without text.
    """

    def __init__(self, model: Model | str | None = None, tokenizer: Any = None,
                 generation_config: GenerationConfig | dict[str, Any] | None = None, *,
                 max_batch_size: int | None = None, max_queue_size: int | None = None,
                 scheduler: str | SchedulingPolicy | type[SchedulingPolicy] | None = None,
                 config: EngineConfig | None = None,
                 **engine_kwargs: Any) -> None:
        overrides = dict(engine_kwargs)
        if isinstance(tokenizer, (str, os.PathLike)):  # a folder, as vLLM's LLM(tokenizer=...)
            overrides["tokenizer"] = str(tokenizer)
            tokenizer = None
        if max_batch_size is not None:
            overrides["max_step_tokens"] = max_batch_size
        if max_queue_size is not None:
            overrides["max_queue_size"] = max_queue_size
        if scheduler is not None:
            overrides["scheduler_policy"] = scheduler
        base = config or EngineConfig()
        # Errors name the keywords as the caller spelled them (max_batch_size, scheduler).
        self.config = base.updated(overrides, spelled={
            **({"max_step_tokens": "max_batch_size"} if max_batch_size is not None else {}),
            **({"scheduler_policy": "scheduler"} if scheduler is not None else {})})
        if self.config.skip_tokenizer_init and (tokenizer is not None
                                                or self.config.tokenizer is not None):
            raise ValueError("tokenizer: not with skip_tokenizer_init, which uses none")
        if isinstance(model, Model):
            model.check_load_settings(self.config, given=overrides)
            # The settings that shaped the loaded model are the model's, whatever `config` said.
            self.config = self.config.model_copy(update={"device": str(model.device),
                                                         "dtype": model.dtype_name,
                                                         "load_format": model.load_format})
            if self.config.tokenizer_revision is not None and self.config.tokenizer is None:
                raise ValueError("tokenizer_revision applies while a model (or a tokenizer) "
                                 "loads; this engine was given a loaded model and no tokenizer")
            if tokenizer is None and self.config.tokenizer is not None:
                model = model.with_tokenizer(self.config.tokenizer,
                                             revision=self.config.tokenizer_revision,
                                             download_dir=self.config.download_dir,
                                             token=self.config.hf_token,
                                             trust_remote_code=self.config.trust_remote_code)
            if self.config.skip_tokenizer_init:
                model = model.without_tokenizer()
        else:
            model = Model.from_pretrained(
                model if model is not None else self.config.model, device=self.config.device,
                dtype=self.config.dtype, tensor_parallel_size=self.config.tensor_parallel_size,
                pipeline_parallel_size=self.config.pipeline_parallel_size,
                quantization=self.config.quantization, tokenizer=self.config.tokenizer,
                hf_overrides=self.config.hf_overrides, load_format=self.config.load_format,
                revision=self.config.revision, download_dir=self.config.download_dir,
                skip_tokenizer_init=self.config.skip_tokenizer_init,
                trust_remote_code=self.config.trust_remote_code,
                tokenizer_revision=self.config.tokenizer_revision, hf_token=self.config.hf_token)
            try:
                self._start(model, tokenizer, generation_config)
            except BaseException:
                # Refused after loading (a setting, an adapter): the worker ranks this engine
                # started must not outlive it, nor its process group block the next engine.
                model.release_workers()
                raise
            return
        self._start(model, tokenizer, generation_config)

    def _start(self, model: Model, tokenizer: Any, generation_config: GenerationConfig | dict | None
               ) -> None:
        """Everything after the model is loaded: the core, the request builder, the step loop."""
        self.model = model
        model.add_engine(self)
        self.tokenizer = tokenizer or model.tokenizer
        # Defaults: the model folder's generation_config.json, as transformers' generate() and
        # vLLM's LLM use them; a dict changes some of them, a GenerationConfig replaces them.
        model_defaults = model_generation_config(model.path)
        if isinstance(generation_config, dict):
            generation_config = model_defaults.replace(**generation_config)
        elif generation_config is not None and not isinstance(generation_config, GenerationConfig):
            raise ValueError("generation_config must be a GenerationConfig or a dict, got "
                             f"{type(generation_config).__name__}")
        self.generation_config = generation_config or model_defaults
        self._lora = LoraRegistry(self.config.num_lora_slots)
        adapters = startup_adapters(self._lora, self.config.lora_modules)
        # The memory profile and graph captures launch Triton kernels, which run on the
        # current GPU, not their tensors': make it the model's for the build.
        with torch.cuda.device(model.device) if model.device.type == "cuda" else nullcontext():
            model.check_workers_free()
            self._core = build_core(model, self.config, self.tokenizer,
                                    self._on_worker_failure,
                                    lora_adapters=[(info.lora_id, info.path)
                                                   for info in adapters])
        for info in adapters:
            self._lora.commit(info)
        self.max_model_len = self._core.max_model_len
        runner = self._core.runner
        self._requests = RequestBuilder(
            model, self.tokenizer, max_model_len=self.max_model_len,
            max_num_seqs=self.config.max_num_seqs,
            kv_layout=None if isinstance(runner, DistributedRunner) else runner.kv_layout,
            lora=self._lora, priority_scheduling=self.scheduling_policy.uses_priority,
            logits_processors=self._core.sampler.logits_processors,
            logprobs_mode=self._core.sampler.logprobs_mode,
            max_logprobs=self.config.max_logprobs)
        if self.config.reasoning_config is not None:
            self._watch_thinking(self.config.reasoning_config)
        self._stats = StatsTracker()
        self._inbox: list[tuple[Sequence, RequestHandle]] = []
        self._aborts: list[str] = []
        self._commands: list[tuple[Callable[[], Any], Future]] = []  # see _on_engine_thread
        self._handles: dict[str, RequestHandle] = {}
        # The core's queue as of the last step (picked-up inbox requests count as waiting until
        # then), guarded by _wake: what admission control sees from callers' threads.
        self._num_waiting = 0
        self._num_running = 0
        self._waiting_blocked = False
        self._wake = threading.Condition()
        # Signalled (on _wake's lock) after every step: callers waiting for room in the queue.
        self._queue_space = threading.Condition(self._wake)
        self._stopping = False
        self._free_kv_when_stopped = False  # set by shutdown(), not by _stop_step_loop()
        self._dead: BaseException | None = None
        # The model was loaded on this thread, steps run on the engine's: this thread's OpenMP
        # workers would compete with the step's for the cores (see runner.cpu_threads). Freed
        # here, and again whenever a caller's thread submits (it may have run torch since).
        self._release_openmp_pool = openmp_pool_releaser()
        self._release_openmp_pool()
        if self.config.freeze_gc_heap:
            freeze_startup_heap()
        self._thread = threading.Thread(target=self._loop, name="ksana-llm-engine", daemon=True)
        self._thread.start()
        self._exit_hook = ExitHook(self)  # a script may end without shutdown(), mid-step

    def set_reasoning_config(self, reasoning_config: ReasoningConfig | dict[str, Any]) -> None:
        """The text that opens and ends the model's thinking block, for the requests submitted
        from now on (what `EngineConfig.reasoning_config` sets at start; `build_app` sets its
        reasoning parser's tags on an engine without one)."""
        if isinstance(reasoning_config, dict):
            reasoning_config = ReasoningConfig(**reasoning_config)
        self._watch_thinking(reasoning_config)
        self.config = self.config.model_copy(update={"reasoning_config": reasoning_config})

    def _watch_thinking(self, config: ReasoningConfig) -> None:
        self._requests.watch_thinking(config.reasoning_start_str, config.reasoning_end_str,
                                      config.reasoning_end_tag)

    def get_tokenizer(self) -> Any:
        """The engine's tokenizer (vLLM's `LLM.get_tokenizer`); None for an engine without one."""
        return self.tokenizer

    @property
    def kv_layout(self) -> KvLayout | None:
        """What this engine's KV rows look like, which KV given as `Request.imported_kv` must
        match; None for a parallel engine, which cannot export or import KV."""
        return self._requests.kv_layout

    @property
    def scheduling_policy(self) -> SchedulingPolicy:
        """The policy ordering this engine's requests (see `ksana_llm.SchedulingPolicy`)."""
        return self._core.scheduler.policy

    @property
    def grammar_compiler(self) -> Any:
        """The engine's structured-output compiler (a `ksana_llm.structured.GrammarCompiler`):
        callers that validate a spec early (the server) compile through it, so the compile at
        submit is a cache hit."""
        return self._requests.grammar()

    def reset_prefix_cache(self) -> int:
        """Forget every cached prompt prefix (vLLM's `LLM.reset_prefix_cache`): later requests
        compute their prompts in full, as on a fresh engine (a cold-cache benchmark, say).
        Running requests go on undisturbed. Returns how many KV blocks were cached."""
        return self._on_engine_thread(self._core.block_manager.reset_prefix_cache)

    # ---- introspection and lifecycle --------------------------------------------------------------
    def stats(self) -> EngineStats:
        return self._stats.snapshot(
            self._core.stats(), num_inbox=len(self._inbox), max_loras=self._lora.num_slots,
            lora_names=self._lora.names())

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and self._dead is None and not self._stopping

    @property
    def failure(self) -> BaseException | None:
        """What stopped the engine, when it died rather than being shut down."""
        return self._dead

    def shutdown(self, timeout: float = 30.0) -> None:
        """Stop the step loop; unfinished requests fail (their handles raise RequestError,
        caused by an EngineDeadError), and later calls raise EngineDeadError. The KV cache's
        memory is freed (the weights stay: they are the Model's, which another engine may
        serve). In a parallel run the worker ranks are told to stop too."""
        # Set first: a shutdown from the engine thread (a callback), or one whose wait runs
        # out, leaves the freeing to the loop as it ends.
        self._free_kv_when_stopped = True
        self._stop_profile_at_shutdown()
        if not self._stop_step_loop(timeout):
            return
        if isinstance(self._core.runner, DistributedRunner):
            self._core.runner.close()
        self._free_kv_memory()

    def _free_kv_memory(self) -> None:
        runner = self._core.runner
        if isinstance(runner, DistributedRunner):
            runner = runner.local  # rank 0's own KV cache (the workers' ends with them)
        try:
            runner.release_kv_memory()
        except Exception:  # noqa: BLE001 - after a CUDA error the device may refuse; stopped all the same
            logger.warning("freeing the KV cache at shutdown failed", exc_info=True)

    def _stop_step_loop(self, timeout: float = 30.0) -> bool:
        """Stop the engine thread and wait for it; True when it has ended (a call from the
        engine thread itself only asks it to stop). The core and its KV cache are left as
        they are: tests and profilers drive a stopped engine's core by hand from here."""
        self._exit_hook.cancel()
        with self._wake:
            self._stopping = True
            self._wake.notify()
        if threading.current_thread() is self._thread:
            return False
        self._thread.join(timeout)
        return not self._thread.is_alive()

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
        commands: list[tuple[Callable[[], Any], Future]] = []  # taken, not yet run
        asleep = False  # sleep mode: requests wait (only commands change it, on this thread)
        unreadable_checked = time.monotonic()
        try:
            # Inside the guard: a thread that dies here must fail its callers, not leave them
            # waiting for steps that never come.
            self._bind_device()
            while True:
                with self._wake:
                    while not (self._inbox or self._aborts or self._commands or self._stopping
                               or (core.has_work() and not asleep)):
                        if asleep and self.config.waiting_timeout_ms is not None \
                                and core.has_work():
                            # Asleep with queued requests: nothing steps, so look at their
                            # waiting time now and then.
                            self._wake.wait(timeout=ASLEEP_EXPIRY_CHECK_S)
                            break
                        self._wake.wait()
                    if self._stopping:
                        break
                    inbox, self._inbox = self._inbox, []
                    self._num_waiting += len(inbox)
                    aborts, self._aborts = self._aborts, []
                    commands, self._commands = self._commands, []
                for seq, handle in inbox:
                    try:
                        if not self._lora_still_loaded(seq):
                            raise ValueError("lora: the request's LoRA adapter was unloaded")
                        core.add(seq)
                    except Exception as exc:  # noqa: BLE001 - only this request is refused
                        # QueueFullError, ValueError, or anything a setting that slipped past
                        # validation raises: the request fails, everyone else is served on.
                        if not isinstance(exc, (QueueFullError, ValueError)):
                            logger.exception("request %s was refused", seq.request_id)
                        self._handles.pop(seq.request_id, None)
                        handle.fail(exc)
                for request_id in aborts:
                    # Step outputs (deferred or in flight) may come first: count them.
                    self._dispatch_step(core.abort(request_id))
                self._run_commands(commands)
                commands = []
                asleep = self._schedules_nothing()
                if self.config.waiting_timeout_ms is not None:
                    self._dispatch(core.expire_waiting(self.config.waiting_timeout_ms / 1000))
                if core.has_work() and not asleep:
                    self._dispatch_step(core.step(early=self._dispatch_step))
                self._free_unlisted_loras()  # unloaded adapters whose last request ended
                if time.monotonic() - unreadable_checked > UNREADABLE_CHECK_S:
                    unreadable_checked = time.monotonic()
                    self._abort_unreadable()
                with self._wake:
                    self._num_waiting = len(core.scheduler.waiting) + len(core.scheduler.swapped)
                    self._num_running = len(core.scheduler.running)
                    # (Asleep, no free slot takes a waiting request either.)
                    self._waiting_blocked = core.scheduler.waiting_blocked or asleep
                    self._queue_space.notify_all()
        except BaseException as exc:  # noqa: BLE001 - any failure must reach every waiter
            logger.exception("engine step loop failed")
            self._dead = exc
        finally:
            if self._dead is None:
                self._release_unfinished()
            with self._wake:  # taken before the failure: their callers must not wait forever
                self._commands[:0] = commands
            self._fail_all(self._dead or EngineDeadError("the engine was shut down"))
            if self._free_kv_when_stopped:
                self._free_kv_memory()
            if self.config.freeze_gc_heap:
                thaw_heap()

    def _bind_device(self) -> None:
        """The current CUDA device is per thread: make it the model's on the engine thread, so
        kernels and events that use the current stream (Triton launches, graph captures) run on
        the model's GPU."""
        device = self._core.runner.device
        if device.type == "cuda":
            # set_device refuses a device without an index ("cuda", the default): give it one.
            torch.cuda.set_device(device.index if device.index is not None
                                  else torch.cuda.current_device())

    def _release_unfinished(self) -> None:
        """On shutdown, finish what the core still holds so its blocks are free and `stats()`
        shows an idle engine (their callers fail with EngineDeadError next)."""
        try:
            for request_id in list(self._core.groups):
                self._core.abort(request_id)
        except Exception:  # noqa: BLE001 - shutting down either way; the waiters still fail
            logger.exception("releasing unfinished requests at shutdown failed")

    def _on_engine_thread(self, work: Callable[[], Any]) -> Any:
        """Run `work` on the engine thread between two steps and return its result (or raise
        its exception) here."""
        if threading.current_thread() is self._thread:
            return work()
        future: Future = Future()
        with self._wake:
            if self._dead is not None or self._stopping:
                raise EngineDeadError(f"the engine is not running: {self._dead or 'shut down'}")
            self._commands.append((work, future))
            self._wake.notify()
        return future.result()

    @staticmethod
    def _run_commands(commands: list[tuple[Callable[[], Any], Future]]) -> None:
        for work, future in commands:
            try:
                future.set_result(work())
            except Exception as exc:  # noqa: BLE001 - the caller re-raises it
                future.set_exception(exc)

    def _fail_all(self, error: BaseException) -> None:
        with self._wake:
            self._stopping = True
            self._queue_space.notify_all()
            pending = list(self._handles.values())
            self._handles.clear()
            self._inbox.clear()
            commands, self._commands = self._commands, []
        for _, future in commands:
            future.set_exception(error)
        for handle in pending:
            try:
                handle.fail(error)
            except Exception:  # noqa: BLE001  one broken handle must not leave the rest waiting
                logger.exception("failing request %s raised", handle.id)
