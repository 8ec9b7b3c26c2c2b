"""The forward-only calls of `Engine` (KsanaLLM's `/forward`): a mixin, as `GenerateCalls` is.
Embeddings, scores and classifications, built on them, are `api/pooling_calls.py`."""

from __future__ import annotations

import asyncio
from typing import Any


from ksana_llm.api.forward_outputs import ForwardHandle, ForwardOutput, ForwardTarget
from ksana_llm.api.request import Prompt
from ksana_llm.generation_config import GenerationConfig


class ForwardCalls:
    """Mixed into `Engine`, which provides `_requests`, `_enqueue`, `abort` and
    `generation_config`, and `GenerateCalls` `_as_batch` (no stub here: one would come before
    the real method in the engine's MRO)."""

    _requests: Any
    generation_config: GenerationConfig
    _as_batch: Any

    def _enqueue(self, seq: Any, callback: Any, loop: asyncio.AbstractEventLoop | None,
                 plugin_info: Any) -> Any:  # pragma: no cover - Engine's
        raise NotImplementedError

    def abort(self, request_id: str) -> None:  # pragma: no cover - Engine's
        raise NotImplementedError

    def submit_forward(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]], *,
                       request_id: str | None = None,
                       loop: asyncio.AbstractEventLoop | None = None,
                       lora: str | None = None,
                       truncate_prompt_tokens: int | None = None,
                       priority: int = 0) -> ForwardHandle:
        """Queue a forward-only request (no sampling, no prefix-cache hits); returns its handle.
        `truncate_prompt_tokens` keeps the prompt's last k tokens (-1: max_model_len); target
        positions are those of the kept prompt. `priority` ranks it as `Request.priority` does
        (an engine with a priority scheduler). Raises ValueError naming the bad field,
        QueueFullError, EngineDeadError."""
        seq, targets, positions = self._requests.forward_sequence(
            prompt, targets, request_id, self.generation_config, lora=lora,
            truncate_prompt_tokens=truncate_prompt_tokens, priority=priority)
        return ForwardHandle(self._enqueue(seq, None, loop, None), list(targets), positions)

    def forward(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]], *,
                request_id: str | None = None, lora: str | None = None) -> ForwardOutput:
        """Run the prompt through the model once and return the requested rows (see ForwardTarget)."""
        return self.submit_forward(prompt, targets, request_id=request_id, lora=lora).result()

    async def forward_async(self, prompt: Prompt, targets: list[ForwardTarget | dict[str, Any]], *,
                            request_id: str | None = None, lora: str | None = None
                            ) -> ForwardOutput:
        handle = self.submit_forward(prompt, targets, request_id=request_id,
                                     loop=asyncio.get_running_loop(), lora=lora)
        try:
            return await handle.aresult()
        except asyncio.CancelledError:
            self.abort(handle.id)
            raise
