"""Sequence classification with a `*ForSequenceClassification` model: what `Engine.classify`
and `POST /classify` return. The class logits are the model's `score` head applied to the
prompt's last-token hidden state after the final norm (`models.sequence_classification`),
which the engine computes as it computes an embedding: one forward-only prefill, batched with
whatever else runs."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ksana_llm.models.sequence_classification import ClassifierHead


@dataclass
class ClassificationOutput:
    """One prompt's classification (vLLM's `ClassificationOutput`, plus the raw logits and the
    label). `probs`: the head's activation of `logits` (softmax over classes; a sigmoid per
    label for one label or multi-label models; the logits themselves for regression);
    `label`: the `id2label` name of the most probable class; `num_prompt_tokens`: the tokens
    computed (after any truncation)."""

    probs: list[float]
    logits: list[float]
    label: str
    num_prompt_tokens: int

    @property
    def num_classes(self) -> int:
        return len(self.probs)


def classification_from_hidden(head: ClassifierHead, hidden: torch.Tensor,
                               num_prompt_tokens: int) -> ClassificationOutput:
    """A prompt's classification from its last-token hidden state (`[hidden]` or `[1, hidden]`)."""
    logits = head.logits(hidden.flatten())
    probs = head.probabilities(logits)
    return ClassificationOutput(probs=probs.tolist(), logits=logits.tolist(),
                                label=head.labels[int(torch.argmax(logits))],
                                num_prompt_tokens=num_prompt_tokens)
