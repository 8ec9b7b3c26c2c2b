"""Shanghai AI Lab's InternLM 2 / 2.5 (`InternLM2ForCausalLM`) and InternLM 3
(`InternLM3ForCausalLM`): Llama's block under other names. Both ship their modeling code
(transformers has no class for them, and we run no remote code): their configs are read as
plain keys.

- InternLM 2: `tok_embeddings`, `attention.wqkv` / `attention.wo`, `feed_forward.w1` / `w3` /
  `w2`, `attention_norm` / `ffn_norm`, `output`. The fused `wqkv` interleaves its rows per KV
  head, [q for each of that head's query heads | k | v], head_dim rows each; its rows are taken
  apart into q, k and v as it loads (dense or quantized), so tensor parallelism shards them like
  any Llama's. `bias` puts biases on wqkv and wo. LoRA adapters trained on these names load
  (`lora_module_name`; a wqkv adapter's B rows reordered as the weight's).
- InternLM 3: Llama's names; `qkv_bias` biases q/k/v, `bias` the output projection and the MLP.
- RoPE "dynamic" scaling (both) changes nothing within `max_position_embeddings`, which bounds
  the served context.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ksana_llm.loader.quantized_weight import QuantizedWeight
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, head_dim_of
from ksana_llm.models.phi3 import split_rows

# InternLM 2's names -> Llama's (the fused wqkv is taken apart separately).
_INTERNLM2_NAMES = ((".attention.wo.", ".self_attn.o_proj."),
                    (".feed_forward.w1.", ".mlp.gate_proj."),
                    (".feed_forward.w3.", ".mlp.up_proj."),
                    (".feed_forward.w2.", ".mlp.down_proj."),
                    (".attention_norm.", ".input_layernorm."),
                    (".ffn_norm.", ".post_attention_layernorm."),
                    ("model.tok_embeddings.", "model.embed_tokens."))


class InternLM2ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        bias = bool(getattr(config, "bias", False))
        return LlamaAttention(config, layer_idx, qkv_bias=bias, o_bias=bias,
                              parallel=self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(self._llama_named(weights), require_all=require_all)

    def _llama_named(self, weights: Iterable[tuple[str, torch.Tensor]]
                     ) -> Iterator[tuple[str, torch.Tensor]]:
        for name, tensor in weights:
            if ".attention.wqkv." in name:
                prefix, kind = name.split(".attention.wqkv.")
                for part, piece in zip(("q_proj", "k_proj", "v_proj"),
                                       self._split_wqkv(name, tensor)):
                    yield f"{prefix}.self_attn.{part}.{kind}", piece
                continue
            if name.startswith("output."):
                name = "lm_head." + name[len("output."):]
            for theirs, ours in _INTERNLM2_NAMES:
                if theirs in f".{name}":
                    name = f".{name}".replace(theirs, ours, 1)[1:]
                    break
            yield name, tensor

    def _split_wqkv(self, name: str, tensor: torch.Tensor | QuantizedWeight
                    ) -> list[torch.Tensor | QuantizedWeight]:
        """wqkv's rows as q, k, v."""
        heads, kv_heads, d = self._heads()
        if tensor.shape[0] != (heads + 2 * kv_heads) * d:
            raise ValueError(f"checkpoint tensor {name!r}: {tensor.shape[0]} rows, expected "
                             f"{(heads + 2 * kv_heads) * d} (q, k, v heads x head_dim)")
        return split_rows(self._qkv_rows(tensor), [heads * d, kv_heads * d, kv_heads * d])

    def _heads(self) -> tuple[int, int, int]:
        """(query heads, KV heads, head_dim)."""
        heads = self.config.num_attention_heads
        return heads, getattr(self.config, "num_key_value_heads", None) or heads, \
            head_dim_of(self.config)

    def _qkv_rows(self, rows: torch.Tensor | QuantizedWeight) -> torch.Tensor | QuantizedWeight:
        """wqkv-ordered rows (per KV head h: [h's query heads | k_h | v_h]) as [q | k | v]."""
        heads, kv_heads, d = self._heads()
        group = heads // kv_heads
        blocks = torch.arange((heads + 2 * kv_heads) * d).view(kv_heads, group + 2, d)
        order = torch.cat((blocks[:, :group].reshape(-1), blocks[:, group].reshape(-1),
                           blocks[:, group + 1].reshape(-1)))
        if isinstance(rows, QuantizedWeight):
            return rows.select_rows(order)
        return rows if rows.is_meta else rows.index_select(0, order.to(rows.device))

    # ---- LoRA adapters (trained on InternLM 2's own module names) -----------------------------
    def lora_module_name(self, module: str) -> str:
        """An adapter's module under our names: `attention.wqkv` is the fused qkv_proj."""
        if module.endswith(".attention.wqkv"):
            return module.removesuffix(".attention.wqkv") + ".self_attn.qkv_proj"
        for theirs, ours in _INTERNLM2_NAMES:
            if theirs in f".{module}.":
                return f".{module}.".replace(theirs, ours, 1)[1:-1]
        return module

    def loaded_output_rows(self, module: str, rows: torch.Tensor | QuantizedWeight
                           ) -> torch.Tensor | QuantizedWeight:
        """A wqkv adapter's B rows in our fused q | k | v order; other modules' as stored."""
        return self._qkv_rows(rows) if module.endswith(".attention.wqkv") else rows


class InternLM3ForCausalLM(LlamaForCausalLM):
    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, qkv_bias=bool(getattr(config, "qkv_bias", False)),
                              o_bias=bool(getattr(config, "bias", False)), parallel=self.parallel)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, layer_idx, parallel=self.parallel,
                        bias=bool(getattr(config, "bias", False)))
