"""`Engine.start_profile` / `stop_profile` (vLLM's): torch.profiler over the engine's steps.

The profiler starts and stops on the engine thread, between two steps, so a trace holds whole
steps (the scheduling, batch building, forward and sampling of each: CPU operators, and the
device's kernels on CUDA). The trace is written by the caller's thread after the profiler has
stopped, so the steps go on while it is saved. In a tensor-parallel run it is rank 0's view;
the worker ranks are not traced.
"""

from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from ksana_llm.api.engine_thread import EngineThreadWork

logger = logging.getLogger("ksana_llm.api")


@dataclass
class _RunningProfile:
    profiler: torch.profiler.profile
    path: str  # where its trace goes


class ProfileControl(EngineThreadWork):
    """Mixed into `Engine`, which provides `config`, `model` and `_on_engine_thread`."""

    config: Any
    model: Any
    _profile: _RunningProfile | None = None  # set on the engine thread only

    def start_profile(self, profile_prefix: str | None = None) -> None:
        """Start tracing the steps; `stop_profile` writes the trace. Needs the engine's
        `profiler_config` (serve: `--profiler-config` or VLLM_TORCH_PROFILER_DIR);
        `profile_prefix` starts the trace's file name (default "ksana_llm")."""
        settings = self.config.profiler_config
        if settings is None:
            raise ValueError("profiler_config: profiling is off; start the engine with a "
                             "profiler_config (serve --profiler-config '{\"profiler\": \"torch\", "
                             "\"torch_profiler_dir\": \"DIR\"}')")
        if profile_prefix is not None and (not profile_prefix or os.sep in profile_prefix):
            raise ValueError(f"profile_prefix must be a file name prefix, got {profile_prefix!r}")
        os.makedirs(settings.torch_profiler_dir, exist_ok=True)
        name = f"{profile_prefix or 'ksana_llm'}-{os.getpid()}-{time.strftime('%Y%m%d-%H%M%S')}"
        suffix = ".pt.trace.json.gz" if settings.torch_profiler_use_gzip else ".pt.trace.json"
        path = os.path.join(settings.torch_profiler_dir, name + suffix)
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.model.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)

        def start() -> None:
            if self._profile is not None:
                raise ValueError("start_profile: a profile is already running; stop_profile "
                                 "first")
            profiler = torch.profiler.profile(
                activities=activities, record_shapes=settings.torch_profiler_record_shapes,
                profile_memory=settings.torch_profiler_with_memory,
                with_stack=settings.torch_profiler_with_stack,
                with_flops=settings.torch_profiler_with_flops)
            profiler.start()
            self._profile = _RunningProfile(profiler, path)

        self._on_engine_thread(start)

    def stop_profile(self) -> str:
        """Stop tracing and write the trace (Chrome / Perfetto JSON); returns its path."""
        def stop() -> _RunningProfile:
            running = self._profile
            if running is None:
                raise ValueError("stop_profile: no profile is running; start_profile first")
            self._profile = None
            running.profiler.stop()
            return running

        stopped = self._on_engine_thread(stop)
        stopped.profiler.export_chrome_trace(stopped.path)
        return stopped.path

    @property
    def is_profiling(self) -> bool:
        return self._profile is not None

    def _stop_profile_at_shutdown(self) -> None:
        """A profile still running when the engine stops: its trace is written, not lost."""
        if self._profile is None:
            return
        try:
            logger.info("the running profile's trace: %s", self.stop_profile())
        except Exception:  # noqa: BLE001 - shutting down either way
            logger.warning("writing the running profile's trace at shutdown failed",
                           exc_info=True)
