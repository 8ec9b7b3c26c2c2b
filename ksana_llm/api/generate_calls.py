"""`Engine`'s ways to run prompts to completion on top of `submit`: many prompts at once
(`generate_outputs`, `generate`, submitted as the bounded queue allows), and one at a time from
asyncio code (`generate_async`, `generate_output_async`, `stream_async`, which abort the request
when the caller stops listening).
"""

from __future__ import annotations

import asyncio
import dataclasses
from collections import deque
from collections.abc import AsyncIterator, Iterator
from typing import Any

from ksana_llm.api.outputs import Prompt, Request, RequestOutput, as_token_ids
from ksana_llm.api.request_handle import RequestHandle
from ksana_llm.api.request_intake import ROOM_POLL_S
from ksana_llm.engine.scheduler_records import QueueFullError
from ksana_llm.generation_config import GenerationConfig


class GenerateCalls:
    """Mixed into `Engine`, which provides `submit`, `abort`, `_enqueue`, `_requests` and
    `generation_config`."""

    _requests: Any
    generation_config: GenerationConfig

    def submit(self, request: Request | Prompt, *,
               loop: asyncio.AbstractEventLoop | None = None
               ) -> RequestHandle:  # pragma: no cover - Engine's
        raise NotImplementedError

    def abort(self, request_id: str) -> None:  # pragma: no cover - Engine's
        raise NotImplementedError

    def _enqueue(self, seq: Any, callback: Any, loop: asyncio.AbstractEventLoop | None,
                 plugin_info: Any) -> RequestHandle:  # pragma: no cover - Engine's
        raise NotImplementedError

    def _wait_for_queue_space(self) -> None:  # pragma: no cover - Engine's
        raise NotImplementedError

    def generate_outputs(self, prompts: Prompt | Request | list[Prompt | Request],
                         generation_config: GenerationConfig | list[GenerationConfig] | None = None,
                         *, use_tqdm: bool = True,
                         lora: str | None | list[str | None] = None) -> list[RequestOutput]:
        """Run many prompts to completion (submitted as the queue allows), in input order;
        `lora` names the LoRA adapter every prompt uses (None: the base model), or gives one
        per prompt (as vLLM's `lora_request` list). A `Request` among the prompts runs with its
        own settings (a config or adapter given beside it is refused)."""
        return self._run_prepared(self._prepare(prompts, generation_config, lora), use_tqdm)

    def _prepare(self, prompts: Prompt | Request | list[Prompt | Request],
                 generation_config: GenerationConfig | list[GenerationConfig] | None,
                 lora: str | None | list[str | None]) -> list[tuple[Any, Any, Any]]:
        """Every prompt validated (and preprocessed) before anything runs: (sequence, plugin
        info, the Request's callback) triples."""
        batch = self._as_batch(prompts)
        configs = list(generation_config) if isinstance(generation_config, (list, tuple)) \
            else [generation_config] * len(batch)
        if len(configs) != len(batch):
            raise ValueError("generation_config: give one config, or one per prompt")
        loras = list(lora) if isinstance(lora, (list, tuple)) else [lora] * len(batch)
        if len(loras) != len(batch):
            raise ValueError(f"lora: give one adapter name, or one per prompt ({len(batch)}), "
                             f"got {len(loras)}")
        requests = [_as_request(p, c, name) for p, c, name in zip(batch, configs, loras)]
        return [(*self._requests.sequence(request, self.generation_config), request.callback)
                for request in requests]

    def _run_prepared(self, prepared: list[tuple[Any, Any, Any]], use_tqdm: bool
                      ) -> list[RequestOutput]:
        handles: list[RequestHandle] = []
        progress = None
        if use_tqdm and len(prepared) > 1:
            from tqdm import tqdm

            progress = tqdm(total=len(prepared), desc="Generating", unit="req")
        pending = deque(prepared)
        try:
            while pending:
                handles += self._enqueue_many(pending)
                if pending:  # the queue is full (of ours, or other callers' requests)
                    self._wait_for_queue_space()
                    for h in handles:
                        if h.finished:
                            self._finish_one(h, progress)
            return [self._finish_one(h, progress) for h in handles]
        except BaseException:
            # Ctrl-C, or a failure: the requests already queued must not run on unseen.
            for h in handles:
                if not h.finished:
                    self.abort(h.id)
            raise
        finally:
            if progress is not None:
                progress.close()

    @staticmethod
    def _finish_one(handle: RequestHandle, progress: Any) -> RequestOutput:
        counted = handle.end_read  # each request ticks the progress bar once
        out = handle.result()
        if progress is not None and not counted:
            progress.update(1)
        return out

    @staticmethod
    def _as_batch(prompts: Prompt | Request | list[Prompt | Request]) -> list[Prompt | Request]:
        if _is_single(prompts):
            return [prompts]
        if isinstance(prompts, (list, tuple)) and prompts:
            return list(prompts)
        if getattr(prompts, "ndim", None) == 2 and len(prompts):  # a [batch, tokens] array
            return list(prompts)
        raise ValueError("prompt must be a string, a list of token ids, a prompt dict "
                         "({\"prompt_embeds\": tensor}, ...), a Request, or a non-empty list "
                         "of those")

    def generate(self, prompts: Prompt | Request | list[Prompt | Request],
                 generation_config: GenerationConfig | list[GenerationConfig] | None = None,
                 *, stream: bool = False, use_tqdm: bool = True,
                 lora: str | None | list[str | None] = None
                 ) -> str | list[str] | Iterator[str]:
        """One prompt -> its text; a list -> a list of texts; stream=True -> text deltas.
        `lora`: the LoRA adapter to use (None: the base model); as in `generate_outputs`, a list
        of prompts may take one config and one adapter per prompt; a `Request` runs with its
        own."""
        single = _is_single(prompts)
        if stream:
            if not single:
                raise ValueError("stream=True takes a single prompt")
            if isinstance(generation_config, (list, tuple)):
                raise ValueError("generation_config: stream=True takes one config")
            if isinstance(lora, (list, tuple)):
                raise ValueError("lora: stream=True takes one adapter name")
            return TextStream(self._submit_text_stream(
                _as_request(prompts, generation_config, lora)), self.abort)
        prepared = self._prepare(prompts, generation_config, lora)
        for seq, _, _ in prepared:
            _refuse_several(seq, "generate() returns one text per prompt", "use generate_outputs() "
                            "(each output's .sequences) or submit(request).deltas()")
        outputs = self._run_prepared(prepared, use_tqdm)
        return outputs[0].text if single else [o.text for o in outputs]

    def _submit_text_stream(self, request: Request) -> RequestHandle:
        """Submit a request whose text is streamed. A text stream carries one sequence: a
        request for several is refused before it is queued (a ValueError saying where they
        are streamed), as the rest would be lost unseen."""
        seq, plugin_info = self._requests.sequence(request, self.generation_config)
        _refuse_several(seq, *TEXT_STREAM_ONE_SEQUENCE)
        return self._enqueue(seq, request.callback, None, plugin_info)

    async def _submit_async(self, request: Request, one_sequence: tuple[str, str] | None = None
                            ) -> RequestHandle:
        """Queue a request for an asyncio caller, waiting (without blocking the loop) while the
        queue is full, as the blocking calls wait; `one_sequence` = (why, instead): a request
        for several sequences is a ValueError before it is queued."""
        seq, plugin_info = self._requests.sequence(request, self.generation_config)
        if one_sequence is not None:
            _refuse_several(seq, *one_sequence)
        loop = asyncio.get_running_loop()
        while True:
            try:
                return self._enqueue(seq, request.callback, loop, plugin_info)
            except QueueFullError:
                # Polled: the engine thread signals room to threading waiters only.
                await asyncio.sleep(ROOM_POLL_S)

    async def generate_async(self, prompt: Prompt | Request,
                             generation_config: GenerationConfig | None = None) -> str:
        """The prompt's text, awaited. One text per prompt, as `generate`: a request for
        several sequences is a ValueError before it is queued (the rest would be lost)."""
        handle = await self._submit_async(
            _as_request(prompt, generation_config),
            ("generate_async() returns one text", "use generate_output_async() (its "
             ".sequences) or submit(request, loop=...).adeltas()"))
        return (await self._awaited(handle)).text

    async def generate_output_async(self, prompt: Prompt | Request,
                                    generation_config: GenerationConfig | None = None) -> RequestOutput:
        handle = await self._submit_async(_as_request(prompt, generation_config))
        return await self._awaited(handle)

    async def _awaited(self, handle: RequestHandle) -> RequestOutput:
        """The handle's result; a caller cancelled while waiting aborts the request."""
        try:
            return await handle.aresult()
        except asyncio.CancelledError:
            self.abort(handle.id)
            raise

    async def stream_async(self, prompt: Prompt | Request,
                           generation_config: GenerationConfig | None = None) -> AsyncIterator[str]:
        handle = await self._submit_async(
            _as_request(prompt, generation_config), TEXT_STREAM_ONE_SEQUENCE)
        finished = False
        try:
            async for delta in handle.astream():
                yield delta
            finished = True
        finally:
            if not finished:  # the consumer stopped early or was cancelled: free the blocks
                self.abort(handle.id)


# Why a text stream takes one sequence, and what streams several.
TEXT_STREAM_ONE_SEQUENCE = (
    "a text stream carries one sequence", "stream them all with submit(request).deltas() "
    "(adeltas() for asyncio), each delta tagged with its sequence index")


def _is_single(prompts: Any) -> bool:
    """One prompt (or Request), not a batch of them."""
    return isinstance(prompts, (str, dict, Request)) or as_token_ids(prompts) is not None


def _as_request(prompt: Prompt | Request, generation_config: Any = None,
               lora: str | None = None) -> Request:
    """A prompt made a Request with these settings; a Request as it is. A Request carries its
    own config and adapter: others given beside it are refused, not silently dropped."""
    if not isinstance(prompt, Request):
        return Request.of(prompt, generation_config, lora=lora)
    if generation_config is not None:
        if prompt.generation_config is not None:
            raise ValueError("generation_config: a Request carries its own "
                             "(Request(prompt, generation_config=...))")
        prompt = dataclasses.replace(prompt, generation_config=generation_config)
    if lora is not None:
        if prompt.lora is not None:
            raise ValueError("lora: a Request names its own adapter (Request(prompt, lora=...))")
        prompt = dataclasses.replace(prompt, lora=lora)
    return prompt


def _refuse_several(seq: Any, why: str, instead: str) -> None:
    """A ValueError naming num_return_sequences when `seq`'s request returns several sequences
    to a call that gives back one: the others would be lost unseen."""
    n = seq.config.num_return_sequences
    if n > 1:
        raise ValueError(f"num_return_sequences: {why}, and this request returns {n}; {instead}")


class TextStream:
    """The text deltas of one submitted request. A caller that stops reading early aborts the
    request, so it does not run on to its token limit: an exception in the loop, `close()`,
    leaving a `with` block, or dropping the stream (even before its first delta). A `break`
    alone cannot be told from a pause: it aborts once the stream is dropped, at once for
    `for delta in engine.generate(..., stream=True)`, not while a name still holds it (use
    `with engine.generate(..., stream=True) as stream:` for that)."""

    def __init__(self, handle: RequestHandle, abort: Any) -> None:
        self.handle = handle
        self._abort = abort
        self._deltas = iter(handle)
        self._done = False

    def __iter__(self) -> TextStream:
        return self

    def __next__(self) -> str:
        try:
            return next(self._deltas)
        except StopIteration:
            self._done = True
            raise
        except BaseException:
            self.close()
            raise

    def __enter__(self) -> TextStream:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Stop reading: the request is aborted unless it already ended."""
        if not self._done:
            self._done = True
            self._abort(self.handle.id)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - at interpreter exit the engine may be gone
            pass
