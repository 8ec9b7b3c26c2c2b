"""OpenAI GPT-OSS (`GptOssForCausalLM`: gpt-oss-20b, gpt-oss-120b) on the Llama block.

- Attention: biased q/k/v/o projections, YaRN RoPE, sliding-window (128) and full layers
  alternating as `layer_types` lists them, and a learned sink logit per head (`self_attn.sinks`)
  in the softmax's denominator.
- Every layer's MLP is a mixture of experts: a biased router whose softmax over the top k logits
  weighs the experts (`mlp.router`, loaded into our `mlp.gate`), experts with biases, and a
  clamped SwiGLU (`layers.activation.clamped_swiglu`, `swiglu_alpha` / `swiglu_limit`).
- RMSNorms multiply their weight in float32 before the cast back.

Checkpoints: the experts are stacked, transposed (`gate_up_proj` [E, H, 2I], `down_proj`
[E, I, H]) with gate and up columns interleaved (gate at even indices); released checkpoints
store them as MXFP4 (`*_blocks` / `*_scales`, rows not transposed), dequantized here as they
load (`loader.mxfp4`). Both become the [gate; up] halves `FusedExperts` keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.activation import clamped_swiglu
from ksana_llm.layers.moe import FusedExperts, SparseMoeBlock
from ksana_llm.layers.moe_routers import SoftmaxTopKRouter
from ksana_llm.loader.mxfp4 import dequantize_mxfp4
from ksana_llm.models.gemma import PerLayerWindows, layer_types
from ksana_llm.models.llama import LlamaAttention, LlamaForCausalLM

# transformers' defaults where a config leaves them out (the released configs set no alpha)
SWIGLU_ALPHA = 1.702
SWIGLU_LIMIT = 7.0
_MXFP4_PARTS = ("_blocks", "_scales")


def halves_from_interleaved(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate and up interleaved along `dim` (gate at even indices) -> [gate; up] halves."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat([pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)], dim=dim)


class GptOssForCausalLM(PerLayerWindows, LlamaForCausalLM):
    norm_weights_in_float32 = True

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        self._types = layer_types(config)  # checked before any weight is built
        super().__init__(config, parallel)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, layer_window=self._window_of(config, layer_idx),
                              sinks=True, parallel=self.parallel)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        hidden, num_experts = config.hidden_size, config.num_local_experts
        router = SoftmaxTopKRouter(hidden, num_experts, config.num_experts_per_tok,
                                   renormalize=True, bias=True)
        activation = clamped_swiglu(float(getattr(config, "swiglu_alpha", SWIGLU_ALPHA)),
                                    float(getattr(config, "swiglu_limit", SWIGLU_LIMIT)))
        experts = FusedExperts(num_experts, hidden, config.intermediate_size,
                               parallel=self.parallel, bias=True, activation=activation)
        return SparseMoeBlock(router, experts, parallel=self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(self._in_our_layout(weights), require_all=require_all)

    def _in_our_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as our modules take them: router renamed, sinks sliced to
        this rank's heads, experts de-interleaved and untransposed (MXFP4 ones dequantized
        once both their blocks and scales have come)."""
        mxfp4: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            if name.endswith(_MXFP4_PARTS):
                base, part = name[:-7], name[-7:]
                parts = mxfp4.setdefault(base, {})
                parts[part] = tensor
                if len(parts) == 2:
                    del mxfp4[base]
                    if self.skip_checkpoint_tensor(base):
                        continue
                    yield base, self._dequantized_experts(base, parts)
                continue
            if name.endswith(".self_attn.sinks"):
                heads = self.config.num_attention_heads // self.parallel.tp_size
                first = self.parallel.tp_rank * heads
                if tuple(tensor.shape) == (self.config.num_attention_heads,):
                    tensor = tensor[first:first + heads]
            elif name.endswith(".mlp.experts.gate_up_proj") and tensor.dim() == 3:
                tensor = halves_from_interleaved(tensor.transpose(1, 2), 1)
            elif name.endswith(".mlp.experts.gate_up_proj_bias") and tensor.dim() == 2:
                tensor = halves_from_interleaved(tensor, 1)
            elif name.endswith(".mlp.experts.down_proj") and tensor.dim() == 3:
                tensor = tensor.transpose(1, 2)
            yield name, tensor
        if mxfp4:
            raise ValueError(f"MXFP4 tensors without their blocks or scales: "
                             f"{sorted(base + next(iter(p)) for base, p in mxfp4.items())}")

    @staticmethod
    def _dequantized_experts(base: str, parts: dict[str, torch.Tensor]) -> torch.Tensor:
        """MXFP4 experts ([E, out, in] once dequantized) in our layout. bfloat16 holds every
        e2m1 value times a power of two exactly."""
        try:
            values = dequantize_mxfp4(parts["_blocks"], parts["_scales"], torch.bfloat16)
        except ValueError as exc:
            raise ValueError(f"checkpoint tensor {base!r}: {exc}") from exc
        return halves_from_interleaved(values, 1) if base.endswith("gate_up_proj") else values
