"""vLLM's `--runner`, `--convert` and `--task`: what a model is served for. ksana-llm serves
every API a model has (a language model generates and embeds; a sequence-classification model
classifies, scores and embeds), so these flags do not switch anything on or off: they check
that the model has what they ask for, so that a vLLM command line fails here where vLLM's
would, rather than starting a server that cannot answer the requests it was started for."""

from __future__ import annotations

from typing import Any

RUNNERS = ("auto", "generate", "pooling")
CONVERTS = ("auto", "none", "embed", "classify")
TASKS = ("auto", "generate", "embed", "embedding", "classify", "score")


def check_model_task(model: Any, *, runner: str | None = None, convert: str | None = None,
                     task: str | None = None) -> None:
    """ValueError naming the flag when the loaded `model` cannot do what it asks for."""
    architecture = next(iter(getattr(model.hf_config, "architectures", None) or []), "model")
    if model.classifier is not None and "generate" in (runner, task):
        flag = "--runner" if runner == "generate" else "--task"
        raise ValueError(f"{flag} generate: {architecture} is a sequence-classification "
                         "model, which does not generate; leave the flag out to serve "
                         "/classify, /score and /rerank")
    if model.classifier is None and "classify" in (convert, task):
        flag = "--convert" if convert == "classify" else "--task"
        raise ValueError(f"{flag} classify: {architecture} has no classification head; serve "
                         "a *ForSequenceClassification checkpoint, or make a causal-LM "
                         "reranker one with --hf-overrides '{\"architectures\": [...For"
                         "SequenceClassification], \"classifier_from_token\": [...]}'")


def check_model_task_args(args: Any, model: Any) -> None:
    """`check_model_task` with the command line's flags."""
    check_model_task(model, runner=getattr(args, "runner", None),
                     convert=getattr(args, "convert", None), task=getattr(args, "task", None))
