"""The forward-only calls of `Engine` (`/forward`, embeddings): a mixin, as `GenerateCalls` is."""

from __future__ import annotations

import asyncio
from typing import Any

import torch

from ksana_llm.api.classification import ClassificationOutput, classification_from_hidden
from ksana_llm.api.embeddings import EMBEDDING_TARGETS, embedding_from_hidden
from ksana_llm.api.forward_outputs import ForwardHandle, ForwardOutput, ForwardTarget
from ksana_llm.api.request import Prompt, as_token_ids
from ksana_llm.api.scoring import cross_encoder_prompt, pair_scores, score_pairs
from ksana_llm.engine.scheduler_records import QueueFullError
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.models.sequence_classification import ClassifierHead


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

    def embed(self, prompts: Prompt | list[Prompt], *, lora: str | None = None,
              truncate_prompt_tokens: int | None = None) -> torch.Tensor:
        """One embedding per prompt, [n, hidden_size] float32 on the CPU, in input order: the
        final norm's hidden state at the prompt's last token, L2-normalised (`api.embeddings`).
        `truncate_prompt_tokens` (vLLM's): embed each prompt's last k tokens (-1: as many as
        max_model_len). Prompts are queued as the queue allows; a bad one raises ValueError
        (naming the problem) and the ones already queued are aborted."""
        outputs = self._last_token_states(prompts, lora, truncate_prompt_tokens)
        return torch.stack([embedding_from_hidden(out.targets[0].tensor) for out in outputs])

    def classify(self, prompts: Prompt | list[Prompt], *, lora: str | None = None,
                 truncate_prompt_tokens: int | None = None) -> list[ClassificationOutput]:
        """vLLM's `LLM.classify`, for a `*ForSequenceClassification` model: one
        `ClassificationOutput` (class probabilities, logits, label) per prompt, in input order,
        from its last-token hidden state (`api.classification`). Queued and refused as `embed`
        queues and refuses; ValueError for a model without a classification head."""
        head = self._classifier("classify")
        outputs = self._last_token_states(prompts, lora, truncate_prompt_tokens)
        return [classification_from_hidden(head, out.targets[0].tensor,
                                           len(out.prompt_token_ids)) for out in outputs]

    def _check_cross_encoder(self) -> None:
        labels = self._classifier("score").num_labels
        if labels != 1:
            raise ValueError(f"score: this classification model has {labels} labels; scoring "
                             "pairs needs a one-label model (a cross-encoder)")

    def _classifier(self, what: str) -> ClassifierHead:
        head = self._requests.model.classifier
        if head is None:
            raise ValueError(f"{what} needs a sequence-classification model "
                             "(*ForSequenceClassification); this one is a language model")
        return head

    def _last_token_states(self, prompts: Prompt | list[Prompt], lora: str | None,
                           truncate_prompt_tokens: int | None) -> list[ForwardOutput]:
        """Each prompt's forward output holding its last-token final-norm state, in order;
        prompts queued as the queue allows (waiting for the oldest when it is full). A bad one
        raises ValueError and the ones already queued are aborted."""
        batch = self._as_batch(prompts)
        handles: list[ForwardHandle] = []
        outputs: list[ForwardOutput] = []
        try:
            for prompt in batch:
                while True:
                    try:
                        handles.append(self.submit_forward(
                            prompt, list(EMBEDDING_TARGETS), lora=lora,
                            truncate_prompt_tokens=truncate_prompt_tokens))
                        break
                    except QueueFullError:  # make room: wait for the oldest one
                        outputs.append(handles[len(outputs)].result())
            outputs += [handle.result() for handle in handles[len(outputs):]]
        except BaseException:
            for handle in handles:
                if not handle.finished:
                    self.abort(handle.id)
            raise
        return outputs

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
        first, second = self._texts(text_1, "text_1"), self._texts(text_2, "text_2")
        pairs = score_pairs(len(first), len(second))
        if self._requests.model.classifier is not None:
            self._check_cross_encoder()
            first, second = ([t if isinstance(t, str) else as_token_ids(t) for t in texts]
                             for texts in (first, second))
            prompts = [cross_encoder_prompt(self._requests.tokenizer, first[i], second[j])
                       for i, j in pairs]
            return [out.probs[0] for out in self.classify(
                prompts, lora=lora, truncate_prompt_tokens=truncate_prompt_tokens)]
        vectors = self.embed(first + second, lora=lora,
                             truncate_prompt_tokens=truncate_prompt_tokens)
        return pair_scores(vectors[:len(first)], vectors[len(first):], pairs)

    def _texts(self, value: Prompt | list[Prompt], field: str) -> list[Prompt]:
        try:
            texts = self._as_batch(value)
        except ValueError as exc:
            raise ValueError(f"{field}: {exc}") from None
        if not all(isinstance(text, str) or as_token_ids(text) is not None for text in texts):
            raise ValueError(f"{field}: each text must be a string or a list of token ids")
        return texts
