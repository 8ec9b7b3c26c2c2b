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
store them as MXFP4 (`*_blocks` / `*_scales`, rows not transposed), which the experts keep
packed, half a byte a number, with an E8M0 scale byte per block of 32
(`loader.mxfp4.mxfp4_weight`): tensor-parallel ranks take whole blocks of the intermediate
columns (2880 over 4 ranks: 736, 736, 704 and 704), dequantized only with more ranks than
blocks.
Both become the [gate; up] halves `FusedExperts` keeps.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.activation import clamped_swiglu
from ksana_llm.layers.moe import FusedExperts, SparseMoeBlock
from ksana_llm.layers.parallel import scale_aligned_split
from ksana_llm.layers.moe_routers import SoftmaxTopKRouter
from ksana_llm.loader.mxfp4 import BLOCK, dequantize_mxfp4, mxfp4_weight
from ksana_llm.loader.quantized import input_scale_group
from ksana_llm.loader.quantized_weight import QuantizedWeight
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


def keeps_mxfp4_codes(intermediate_size: int, parallel: ParallelContext) -> bool:
    """Whether MXFP4 experts load as FP4 codes: unless this rank's slice of the intermediate
    columns (down_proj's input, split in whole blocks of 32 where the even split would cut
    them: `layers.parallel.scale_aligned_split`) still starts inside a block -- more ranks
    than blocks -- where the codes would need groups smaller than the grouped kernel takes."""
    start, size = scale_aligned_split(intermediate_size, parallel, BLOCK)
    return start % BLOCK == 0 and size % BLOCK == 0


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
                               parallel=self.parallel, bias=True, activation=activation,
                               scale_group=input_scale_group(config))
        return SparseMoeBlock(router, experts, parallel=self.parallel)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        return super().load_weights(self._in_our_layout(weights), require_all=require_all)

    def _in_our_layout(self, weights: Iterable[tuple[str, torch.Tensor]]
                       ) -> Iterator[tuple[str, torch.Tensor]]:
        """The checkpoint's tensors as our modules take them: router renamed, sinks sliced to
        this rank's heads, expert stacks handed on expert by expert as gate / up / down
        matrices (MXFP4 ones dequantized once both their blocks and scales have come), so no
        whole stack is ever copied or dequantized at once (120b's is 4 GB in bf16)."""
        mxfp4: dict[str, dict[str, torch.Tensor]] = {}
        for name, tensor in weights:
            name = name.replace(".mlp.router.", ".mlp.gate.")
            part = next((p for p in _MXFP4_PARTS if name.endswith(p)), None)
            if part is not None:
                base = name[:-len(part)]
                parts = mxfp4.setdefault(base, {})
                parts[part] = tensor
                if len(parts) == 2:
                    del mxfp4[base]
                    if not self.skip_checkpoint_tensor(base):
                        yield from self._one_by_one(base, self._checked_stack(
                            base, parts["_scales"], "MXFP4 scales"), parts)
                continue
            if name.endswith(".self_attn.sinks"):
                heads = self.config.num_attention_heads // self.parallel.tp_size
                first = self.parallel.tp_rank * heads
                if tuple(tensor.shape) == (self.config.num_attention_heads,):
                    tensor = tensor[first:first + heads]
            elif name.endswith((".mlp.experts.gate_up_proj", ".mlp.experts.down_proj")):
                yield from self._one_by_one(name, self._checked_stack(name, tensor, "stack"))
                continue
            elif name.endswith(".mlp.experts.gate_up_proj_bias") and tensor.dim() == 2:
                tensor = halves_from_interleaved(tensor, 1)
            yield name, tensor
        if mxfp4:
            raise ValueError(f"MXFP4 tensors without their blocks or scales: "
                             f"{sorted(base + next(iter(p)) for base, p in mxfp4.items())}")

    def _checked_stack(self, name: str, tensor: torch.Tensor, what: str) -> torch.Tensor:
        if tensor.dim() < 3 or tensor.shape[0] != self.config.num_local_experts:
            raise ValueError(f"checkpoint tensor {name!r}: {what} of shape "
                             f"{tuple(tensor.shape)}, expected one per expert "
                             f"({self.config.num_local_experts})")
        return tensor

    def _one_by_one(self, base: str, stacked: torch.Tensor,
                    mxfp4: dict[str, torch.Tensor] | None = None
                    ) -> Iterator[tuple[str, torch.Tensor | QuantizedWeight]]:
        """A stack (`...experts.gate_up_proj` [E, H, 2I] with gate and up columns interleaved,
        or `...experts.down_proj` [E, I, H]; MXFP4: [E, out, in]) as each expert's
        `N.gate_proj.weight` / `N.up_proj.weight` / `N.down_proj.weight` ([out, in]). MXFP4
        values come as packed FP4 codes (see the module doc) or in bfloat16, which holds every
        one of them (e2m1 times a power of two) exactly."""
        prefix, proj = base.rsplit(".", 1)
        as_codes = mxfp4 is not None and keeps_mxfp4_codes(self.config.intermediate_size,
                                                           self.parallel)
        for expert in range(stacked.shape[0]):
            if mxfp4 is None:
                weight = stacked[expert].T
            else:
                blocks, scales = mxfp4["_blocks"][expert], mxfp4["_scales"][expert]
                try:
                    weight = mxfp4_weight(blocks, scales) if as_codes \
                        else dequantize_mxfp4(blocks, scales, torch.bfloat16)
                except ValueError as exc:
                    raise ValueError(f"checkpoint tensor {base!r}: {exc}") from exc
            if proj == "gate_up_proj":
                gate, up = _interleaved_rows(weight)
                yield f"{prefix}.{expert}.gate_proj.weight", gate
                yield f"{prefix}.{expert}.up_proj.weight", up
            else:
                yield f"{prefix}.{expert}.down_proj.weight", weight


def _interleaved_rows(weight: torch.Tensor | QuantizedWeight
                      ) -> tuple[torch.Tensor | QuantizedWeight, torch.Tensor | QuantizedWeight]:
    """(gate, up): the even and the odd rows."""
    if isinstance(weight, QuantizedWeight):
        rows = torch.arange(weight.shape[0])
        return weight.select_rows(rows[0::2]), weight.select_rows(rows[1::2])
    return weight[0::2], weight[1::2]
