"""Checkpoint loading for the Llama family: how HF-named tensors reach `LlamaForCausalLM`'s
parameters.

Split from `models/llama.py` so that the model file holds the compute and this one the weight
rules every family built on Llama inherits: q/k/v and gate/up parts loaded into their fused
matmuls, tensors skipped (a stored RoPE table, another pipeline stage's), and transformers' rule
for a tied LM head that the checkpoint stores anyway. `LlamaWeightLoading` is a mixin: it reads
the model's `config`, `parallel`, `model` (a `LlamaModel`), `tie_word_embeddings` and
`lm_head`, and calls its `prepare_for_inference` once the weights are in place.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType

import torch

from ksana_llm.layers.parallel import ParallelLMHead
from ksana_llm.loader.multimodal_text import language_model_tensors
from ksana_llm.loader.quantized_weight import dense
from ksana_llm.models.weight_loading import load_checkpoint

logger = logging.getLogger("ksana_llm.model")

# checkpoint part -> (fused parameter, part index): q/k/v and gate/up each load into one matmul
_FUSED_PARTS = MappingProxyType({
    "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
})


class LlamaWeightLoading:
    """`load_weights` and the rules behind it; families override `fused_parts` and
    `skip_checkpoint_tensor`."""

    # checkpoint part -> (fused parameter, part index)
    fused_parts: Mapping[str, tuple[str, int]] = _FUSED_PARTS

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Tensors we compute ourselves (old checkpoints store the RoPE table), share, or that
        another pipeline stage holds."""
        if "rotary_emb.inv_freq" in name:
            return True
        return not self._stage_holds(name)

    def _stage_holds(self, name: str) -> bool:
        ctx = self.parallel
        if ctx.pp_size == 1:
            return True
        if name.startswith("model.layers."):
            index = int(name.split(".", 3)[2])
            return self.model.first_layer <= index < self.model.end_layer \
                or index >= self.config.num_hidden_layers  # extra layers (MTP): the family decides
        if name.startswith(("model.embed_tokens.", "lm_head.")):
            return ctx.is_first_stage
        if name.startswith("model.norm."):
            return ctx.is_last_stage
        return True

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        """Copy checkpoint tensors (HF names) into the parameters; every parameter must be set
        unless `require_all` is False (a weight update of some tensors). The keys filled."""
        if getattr(self.config, "multimodal_checkpoint", None):  # served for its text
            weights = language_model_tensors(weights)
        filled = self.load_checkpoint_tensors(weights, require_all=require_all)
        self.prepare_for_inference()
        return filled

    def load_checkpoint_tensors(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                                require_all: bool = True) -> set[str]:
        """`load_checkpoint`, with transformers' rule for a tied model whose checkpoint stores
        an LM head too: the head is the embedding when the two are equal (PyTorch .bin files
        store both names for one tensor), else the stored head is used and the model untied."""
        stored_head: dict[str, torch.Tensor] = {}
        filled = load_checkpoint(self, self._tied_head_set_aside(weights, stored_head),
                                 self.fused_parts, self.skip_checkpoint_tensor,
                                 require_all=require_all)
        if "lm_head.weight" in stored_head:
            self._untie_if_different(stored_head["lm_head.weight"])
        return filled

    def _tied_head_set_aside(self, weights: Iterable[tuple[str, torch.Tensor]],
                             aside: dict[str, torch.Tensor]
                             ) -> Iterator[tuple[str, torch.Tensor]]:
        embedding_seen = False
        for name, tensor in weights:
            embedding_seen = embedding_seen or name == "model.embed_tokens.weight"
            if name == "lm_head.weight" and self.tie_word_embeddings and self._stage_holds(name):
                aside[name] = tensor  # compared once the embedding is loaded
            else:
                yield name, tensor
        if not embedding_seen and "lm_head.weight" in aside:
            # transformers ties the two either way: a tied checkpoint may store only the head.
            yield "model.embed_tokens.weight", aside.pop("lm_head.weight")

    def _untie_if_different(self, stored: torch.Tensor) -> None:
        embedding = self.model.embed_tokens.weight
        with torch.device("meta"):
            head = ParallelLMHead(self.config.vocab_size, embedding.shape[1], self.parallel)
        head = head.to(embedding.dtype).to_empty(device=embedding.device)
        head.load_checkpoint_tensor("weight", dense(stored))  # its shape checked
        if embedding.is_meta or head.weight.is_meta:
            return  # a weight update's dry run (models.weight_update): no values to compare
        if torch.equal(head.weight, embedding):
            return
        logger.warning("tie_word_embeddings is set, but the checkpoint's lm_head.weight differs "
                       "from the embedding: using the stored LM head, untied (as transformers "
                       "does); set tie_word_embeddings=false in config.json to silence this")
        self.lm_head = head
        self.tie_word_embeddings = False
