"""Sequence-classification checkpoints (transformers' `*ForSequenceClassification`): a causal
LM's decoder with a `score` head in place of the LM head. Classifiers, reward models and
cross-encoder rerankers built on Llama, Mistral and Qwen2/3 ship this way.

transformers computes `score(final_norm(hidden))` at every position and keeps the last
non-padding token's row; for one unpadded sequence that is the last token's. The engine runs
the decoder as any model's (the `layernorm` forward target at the last position, as an
embedding is computed) and applies the head here, on the CPU in float32: a [num_labels, hidden]
product, nothing a GPU would notice. The decoder is built with a tied LM head (the embeddings;
such a checkpoint has no `lm_head.weight`), which only a generation request would read, and a
classification model refuses generation.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from ksana_llm.loader.quantized_weight import dense

# The checkpoints' architectures, with the causal LM whose decoder they share.
BACKBONES = {
    "LlamaForSequenceClassification": "LlamaForCausalLM",
    "MistralForSequenceClassification": "MistralForCausalLM",
    "Qwen2ForSequenceClassification": "Qwen2ForCausalLM",
    "Qwen3ForSequenceClassification": "Qwen3ForCausalLM",
    "GemmaForSequenceClassification": "GemmaForCausalLM",
    "Gemma2ForSequenceClassification": "Gemma2ForCausalLM",
    "Gemma3TextForSequenceClassification": "Gemma3ForCausalLM",
}
_HEAD_PREFIX = "score."
# How transformers' loss (`config.problem_type`) reads the logits, and so what turns them into
# the probabilities vLLM's classify API returns: softmax over classes, an independent sigmoid
# per label, or the raw values (a regression or reward score has no probability).
ACTIVATIONS = ("softmax", "sigmoid", "identity")


def classification_architecture(hf_config: Any) -> str | None:
    """The config's sequence-classification architecture, or None for any other model."""
    for arch in getattr(hf_config, "architectures", None) or []:
        if arch in BACKBONES:
            return arch
    return None


def backbone_config(hf_config: Any) -> Any:
    """The config the decoder is built from: a copy with a tied LM head (the checkpoint has
    none of its own; see the module docstring). Other configs come back as they are."""
    if classification_architecture(hf_config) is None:
        return hf_config
    config = copy.copy(hf_config)
    config.tie_word_embeddings = True
    return config


def _activation(hf_config: Any, num_labels: int) -> str:
    problem = getattr(hf_config, "problem_type", None)
    if problem == "regression":
        return "identity"
    if problem == "multi_label_classification" or num_labels == 1:
        return "sigmoid"  # one label: a binary classifier's (a reranker's) logit
    return "softmax"


@dataclass(frozen=True)
class ClassifierHead:
    """The `score` head: `weight` [num_labels, hidden] (and `bias`, which transformers' heads
    do not have but a converted checkpoint may), float32 on the CPU; `labels` the config's
    `id2label` names in class order; `activation` one of `ACTIVATIONS`."""

    weight: torch.Tensor
    bias: torch.Tensor | None
    labels: tuple[str, ...]
    activation: str

    @property
    def num_labels(self) -> int:
        return int(self.weight.shape[0])

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[num_labels] (or [n, num_labels]) float32 logits of last-token hidden states."""
        return torch.nn.functional.linear(hidden.float(), self.weight, self.bias)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        if self.activation == "softmax":
            return torch.softmax(logits, dim=-1)
        if self.activation == "sigmoid":
            return torch.sigmoid(logits)
        return logits


@dataclass(frozen=True)
class HeadFromTokens:
    """vLLM's conversion of a causal-LM reranker (Qwen3-Reranker, bge-reranker-v2-gemma,
    mxbai-rerank-v2) into a classifier, asked for through the config (`--hf-overrides`):
    `classifier_from_token` names vocabulary tokens whose LM-head rows make the `score` head.
    `method` "no_post_processing": one label per token, its row as it is; "from_2_way_softmax"
    (two tokens, what `is_original_qwen3_reranker` means): one label whose logit is the second
    token's minus the first's, so its sigmoid is the second token's share of a softmax over
    the two, the yes-probability the model card computes."""

    token_ids: tuple[int, ...]
    method: str


CONVERSION_METHODS = ("from_2_way_softmax", "no_post_processing")


# Where `Model.from_pretrained` puts `classifier_from_token`'s ids, looked up in the tokenizer
# the model serves with (every rank of a parallel run reads them from its config).
TOKEN_IDS_KEY = "classifier_from_token_ids"


def classifier_token_ids(hf_config: Any, tokenizer: Any) -> list[int] | None:
    """The ids of the config's `classifier_from_token` in `tokenizer` (None without the key).
    ValueError naming the key for a malformed list, a missing tokenizer or an unknown token."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    if tokens is None:
        return None
    if not isinstance(tokens, (list, tuple)) or not tokens \
            or not all(isinstance(token, str) and token for token in tokens):
        raise ValueError(f"classifier_from_token must be a non-empty list of tokens, got "
                         f"{tokens!r}")
    if tokenizer is None:
        raise ValueError("classifier_from_token: the model has no tokenizer to look its tokens "
                         "up in; pass one (tokenizer=..., --tokenizer)")
    ids = []
    for token in tokens:
        token_id = tokenizer.convert_tokens_to_ids(token)
        # An unknown token comes back as the unknown token's id (or None): look it up again.
        if not isinstance(token_id, int) or tokenizer.convert_ids_to_tokens(token_id) != token:
            raise ValueError(f"classifier_from_token: {token!r} is not a token of the model's "
                             "vocabulary")
        ids.append(token_id)
    return ids


def head_from_tokens(hf_config: Any) -> HeadFromTokens | None:
    """The config's LM-head conversion (its token ids as `classifier_token_ids` found them);
    None without `classifier_from_token`. ValueError naming the key at fault."""
    tokens = getattr(hf_config, "classifier_from_token", None)
    original_qwen3 = getattr(hf_config, "is_original_qwen3_reranker", False)
    method = getattr(hf_config, "method", None)
    if not isinstance(original_qwen3, bool):
        raise ValueError(f"is_original_qwen3_reranker must be true or false, got "
                         f"{original_qwen3!r}")
    if tokens is None:
        if original_qwen3 or method is not None:
            raise ValueError("classifier_from_token: is_original_qwen3_reranker and method "
                             "convert the LM head's rows of these tokens; name them")
        return None
    method = method or ("from_2_way_softmax" if original_qwen3 else "no_post_processing")
    if method not in CONVERSION_METHODS:
        raise ValueError(f"method must be one of {', '.join(CONVERSION_METHODS)}, got "
                         f"{method!r}")
    ids = getattr(hf_config, TOKEN_IDS_KEY, None)
    if not isinstance(ids, (list, tuple)) or len(ids) != len(tokens):
        raise ValueError("classifier_from_token: its token ids were not looked up (load the "
                         "model with Model.from_pretrained, which finds them in its tokenizer)")
    if method == "from_2_way_softmax" and len(ids) != 2:
        raise ValueError(f"classifier_from_token: from_2_way_softmax (is_original_qwen3_"
                         f"reranker) takes two tokens (no, yes), got {len(ids)}")
    return HeadFromTokens(tuple(int(i) for i in ids), method)


class HeadTensors:
    """Takes the `score.*` tensors out of a checkpoint's stream (the decoder has no place for
    them) and builds the head from them once the stream is spent; with `from_tokens`, takes the
    LM head's rows of those tokens instead (the LM head itself is dropped: the decoder's is a
    stand-in, see the module docstring), or the embeddings' rows when they are the LM head."""

    def __init__(self, hf_config: Any, from_tokens: HeadFromTokens | None = None) -> None:
        self.hf_config = hf_config
        self.from_tokens = from_tokens
        self.tensors: dict[str, torch.Tensor] = {}
        self.token_rows: dict[str, torch.Tensor] = {}  # "lm_head" / "embed_tokens" -> rows

    def decoder_tensors(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        for name, tensor in weights:
            if name.startswith(_HEAD_PREFIX):
                self.tensors[name[len(_HEAD_PREFIX):]] = tensor
                continue
            if self.from_tokens is not None and name in _TOKEN_ROW_SOURCES:
                rows = dense(tensor)[list(self.from_tokens.token_ids)]
                self.token_rows[_TOKEN_ROW_SOURCES[name]] = rows.detach().to("cpu",
                                                                             torch.float32)
                if name == "lm_head.weight":
                    continue
            yield name, tensor

    def head(self) -> ClassifierHead:
        """ValueError when the checkpoint had no `score.weight` (or, converting, no LM head)
        or one of the wrong shape."""
        if self.from_tokens is not None:
            return self._head_from_token_rows()
        unknown = sorted(set(self.tensors) - {"weight", "bias"})
        if unknown:
            raise ValueError(f"checkpoint tensor 'score.{unknown[0]}' has no place in a "
                             "sequence-classification head (score.weight, score.bias)")
        if "weight" not in self.tensors:
            raise ValueError(f"{classification_architecture(self.hf_config)} checkpoint has no "
                             "score.weight (the classification head)")
        weight = dense(self.tensors["weight"]).detach().to("cpu", torch.float32).contiguous()
        hidden = int(self.hf_config.hidden_size)
        if weight.dim() != 2 or weight.shape[1] != hidden:
            raise ValueError(f"score.weight: shape {tuple(weight.shape)}, expected "
                             f"[num_labels, {hidden}]")
        bias = self.tensors.get("bias")
        if bias is not None:
            bias = dense(bias).detach().to("cpu", torch.float32).contiguous()
            if tuple(bias.shape) != (weight.shape[0],):
                raise ValueError(f"score.bias: shape {tuple(bias.shape)}, expected "
                                 f"[{weight.shape[0]}]")
        num_labels = int(weight.shape[0])
        return ClassifierHead(weight, bias, _labels(self.hf_config, num_labels),
                              _activation(self.hf_config, num_labels))

    def _head_from_token_rows(self) -> ClassifierHead:
        rows = self.token_rows.get("lm_head", self.token_rows.get("embed_tokens"))
        if rows is None:
            raise ValueError("classifier_from_token: the checkpoint has no lm_head.weight or "
                             "model.embed_tokens.weight to take the tokens' rows from")
        if self.from_tokens.method == "from_2_way_softmax":
            rows = rows[1:2] - rows[0:1]
        num_labels = int(rows.shape[0])
        return ClassifierHead(rows.contiguous(), None, _labels(self.hf_config, num_labels),
                              _activation(self.hf_config, num_labels))


# Where a converted reranker's rows come from: the LM head, or the embeddings it is tied to.
_TOKEN_ROW_SOURCES = {"lm_head.weight": "lm_head", "model.embed_tokens.weight": "embed_tokens"}


def _labels(hf_config: Any, num_labels: int) -> tuple[str, ...]:
    """`id2label`'s names (keys may be ints or, read from JSON, strings); LABEL_i where it has
    none, as transformers names them."""
    names = {int(k): str(v) for k, v in (getattr(hf_config, "id2label", None) or {}).items()}
    return tuple(names.get(i, f"LABEL_{i}") for i in range(num_labels))
