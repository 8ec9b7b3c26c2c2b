"""`Engine.embed`, `classify` and `score` (vLLM's `LLM.embed` / `classify` / `score`), each
also as a coroutine (`embed_async`, ...) for asyncio callers: every prompt a forward-only
request for its last-token state after the final norm (`ForwardCalls.submit_forward`), made
into an embedding (`api.embeddings`), a classification (`api.classification`) or a pair score
(`api.scoring`). A mixin of `Engine`, as `ForwardCalls` is.

Prompts are queued as the queue allows: when it is full, the call waits for its own oldest
request to finish, or, holding none, for room; so a call with more prompts than the queue
holds runs rather than failing. A bad prompt raises ValueError naming the problem, and the
requests already queued are aborted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import torch

from ksana_llm.api.classification import ClassificationOutput, classification_from_hidden
from ksana_llm.api.embeddings import EMBEDDING_TARGETS, embedding_from_hidden
from ksana_llm.api.forward_outputs import ForwardHandle, ForwardOutput
from ksana_llm.api.request import Prompt, as_token_ids
from ksana_llm.api.request_intake import ROOM_POLL_S
from ksana_llm.api.scoring import cross_encoder_prompt, pair_scores, score_pairs
from ksana_llm.engine.scheduler_records import QueueFullError
from ksana_llm.models.sequence_classification import ClassifierHead


class PoolingCalls:
    """Mixed into `Engine`, which provides `_requests`, `submit_forward`, `abort`,
    `_wait_for_queue_space` and `GenerateCalls._as_batch` (no stubs here:
    they would come before the real methods in the engine's MRO)."""

    _requests: Any
    _as_batch: Any
    submit_forward: Any
    abort: Any
    _wait_for_queue_space: Any

    # ---- embeddings --------------------------------------------------------------------------
    def embed(self, prompts: Prompt | list[Prompt], *, lora: str | None = None,
              truncate_prompt_tokens: int | None = None) -> torch.Tensor:
        """One embedding per prompt, [n, hidden_size] float32 on the CPU, in input order: the
        final norm's hidden state at the prompt's last token, L2-normalised (`api.embeddings`).
        `truncate_prompt_tokens` (vLLM's): embed each prompt's last k tokens (-1: as many as
        max_model_len)."""
        return _embeddings(self._last_token_states(prompts, lora, truncate_prompt_tokens))

    async def embed_async(self, prompts: Prompt | list[Prompt], *, lora: str | None = None,
                          truncate_prompt_tokens: int | None = None) -> torch.Tensor:
        """`embed` for asyncio callers: the event loop runs on while the engine computes."""
        return _embeddings(await self._last_token_states_async(prompts, lora,
                                                               truncate_prompt_tokens))

    # ---- classification ----------------------------------------------------------------------
    def classify(self, prompts: Prompt | list[Prompt], *, lora: str | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationOutput]:
        """vLLM's `LLM.classify`, for a `*ForSequenceClassification` model: one
        `ClassificationOutput` (class probabilities, logits, label) per prompt, in input order,
        from its last-token hidden state (`api.classification`); ValueError for a model
        without a classification head."""
        head = self._classifier("classify")
        return _classifications(head, self._last_token_states(prompts, lora,
                                                              truncate_prompt_tokens))

    async def classify_async(self, prompts: Prompt | list[Prompt], *, lora: str | None = None,
                             truncate_prompt_tokens: int | None = None
                             ) -> list[ClassificationOutput]:
        """`classify` for asyncio callers."""
        head = self._classifier("classify")
        return _classifications(head, await self._last_token_states_async(
            prompts, lora, truncate_prompt_tokens))

    # ---- scores ------------------------------------------------------------------------------
    def score(self, text_1: Prompt | list[Prompt], text_2: Prompt | list[Prompt], *,
              lora: str | None = None, truncate_prompt_tokens: int | None = None) -> list[float]:
        """vLLM's `LLM.score`: one float per pair. A language model scores as an embedding
        model: the cosine similarity of the pair's embeddings (`embed`), in [-1, 1]. A one-label
        sequence-classification model (a cross-encoder reranker) reads each pair as one prompt
        (`api.scoring.cross_encoder_prompt`) and scores it with its probability (`classify`).
        Pairs: one `text_1` against every `text_2`, or the i-th of two equally long lists
        together (`api.scoring`). A text is a string or a list of token ids;
        `truncate_prompt_tokens` keeps each text's (a cross-encoder: each pair's) last k tokens.
        ValueError: a shape error names the field at fault; a text the engine refuses (empty,
        too long) raises `embed`'s error."""
        prompts, finish = self._score_plan(text_1, text_2)
        return finish(self._last_token_states(prompts, lora, truncate_prompt_tokens))

    async def score_async(self, text_1: Prompt | list[Prompt], text_2: Prompt | list[Prompt],
                          *, lora: str | None = None,
                          truncate_prompt_tokens: int | None = None) -> list[float]:
        """`score` for asyncio callers."""
        prompts, finish = self._score_plan(text_1, text_2)
        return finish(await self._last_token_states_async(prompts, lora,
                                                          truncate_prompt_tokens))

    def _score_plan(self, text_1: Prompt | list[Prompt], text_2: Prompt | list[Prompt]
                    ) -> tuple[list[Prompt], Callable[[list[ForwardOutput]], list[float]]]:
        """The prompts to compute for the pairs, and what makes their outputs the scores."""
        first, second = self._texts(text_1, "text_1"), self._texts(text_2, "text_2")
        pairs = score_pairs(len(first), len(second))
        head = self._requests.model.classifier
        if head is None:
            def cosines(outputs: list[ForwardOutput]) -> list[float]:
                vectors = _embeddings(outputs)
                return pair_scores(vectors[:len(first)], vectors[len(first):], pairs)

            return first + second, cosines
        if head.num_labels != 1:
            raise ValueError(f"score: this classification model has {head.num_labels} labels; "
                             "scoring pairs needs a one-label model (a cross-encoder)")
        first, second = ([t if isinstance(t, str) else as_token_ids(t) for t in texts]
                         for texts in (first, second))
        prompts: list[Prompt] = [cross_encoder_prompt(self._requests.tokenizer, first[i],
                                                      second[j]) for i, j in pairs]
        return prompts, lambda outputs: [out.probs[0]
                                         for out in _classifications(head, outputs)]

    def _texts(self, value: Prompt | list[Prompt], field: str) -> list[Prompt]:
        try:
            texts = self._as_batch(value)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
        if not all(isinstance(text, str) or as_token_ids(text) is not None for text in texts):
            raise ValueError(f"{field}: each text must be a string or a list of token ids")
        return texts

    def _classifier(self, what: str) -> ClassifierHead:
        head = self._requests.model.classifier
        if head is None:
            raise ValueError(f"{what} needs a sequence-classification model "
                             "(*ForSequenceClassification); this one is a language model")
        return head

    # ---- the requests ------------------------------------------------------------------------
    def _submit_last_token(self, prompt: Prompt, lora: str | None, keep: int | None,
                           loop: asyncio.AbstractEventLoop | None = None
                           ) -> ForwardHandle | None:
        """The prompt's forward request, queued; None when the queue is full."""
        try:
            return self.submit_forward(prompt, list(EMBEDDING_TARGETS), lora=lora,
                                       truncate_prompt_tokens=keep, loop=loop)
        except QueueFullError:
            return None

    def _last_token_states(self, prompts: Prompt | list[Prompt], lora: str | None,
                           keep: int | None) -> list[ForwardOutput]:
        """Each prompt's forward output holding its last-token final-norm state, in order."""
        handles: list[ForwardHandle] = []
        outputs: list[ForwardOutput] = []
        try:
            for prompt in self._as_batch(prompts):
                while (handle := self._submit_last_token(prompt, lora, keep)) is None:
                    if len(outputs) < len(handles):  # make room: wait for our oldest
                        outputs.append(handles[len(outputs)].result())
                    else:  # the queue is full of others' requests
                        self._wait_for_queue_space()
                handles.append(handle)
            outputs += [handle.result() for handle in handles[len(outputs):]]
        except BaseException:
            self._abort_unfinished(handles)
            raise
        return outputs

    async def _last_token_states_async(self, prompts: Prompt | list[Prompt], lora: str | None,
                                       keep: int | None) -> list[ForwardOutput]:
        """`_last_token_states` for asyncio callers (cancelling it aborts the requests)."""
        loop = asyncio.get_running_loop()
        handles: list[ForwardHandle] = []
        outputs: list[ForwardOutput] = []
        try:
            for prompt in self._as_batch(prompts):
                while (handle := self._submit_last_token(prompt, lora, keep, loop)) is None:
                    if len(outputs) < len(handles):
                        outputs.append(await handles[len(outputs)].aresult())
                    else:
                        await asyncio.sleep(ROOM_POLL_S)
                handles.append(handle)
            outputs += [await handle.aresult() for handle in handles[len(outputs):]]
        except BaseException:
            self._abort_unfinished(handles)
            raise
        return outputs

    def _abort_unfinished(self, handles: list[ForwardHandle]) -> None:
        for handle in handles:
            if not handle.finished:
                self.abort(handle.id)


def _embeddings(outputs: list[ForwardOutput]) -> torch.Tensor:
    return torch.stack([embedding_from_hidden(out.targets[0].tensor) for out in outputs])


def _classifications(head: ClassifierHead, outputs: list[ForwardOutput]
                     ) -> list[ClassificationOutput]:
    return [classification_from_hidden(head, out.targets[0].tensor, len(out.prompt_token_ids))
            for out in outputs]
