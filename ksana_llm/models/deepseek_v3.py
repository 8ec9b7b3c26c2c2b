"""DeepSeek-V3 / R1: multi-head latent attention, DeepSeek MoE, first dense layers, MTP weights.

- Every layer attends with MLA (`layers/mla.py`); the paged cache keeps one compressed latent
  per token (`kv_lora_rank + qk_rope_head_dim` numbers, no V cache).
- Layers below `first_k_dense_replace` have a dense MLP of `intermediate_size`; the rest a MoE
  block: group-limited sigmoid routing (`n_group` / `topk_group`, `e_score_correction_bias`,
  `routed_scaling_factor`, `norm_topk_prob`) over `n_routed_experts` experts of
  `moe_intermediate_size`, plus `n_shared_experts` always-on experts fused into one MLP.
- RoPE covers only `qk_rope_head_dim`, interleaved when `rope_interleave`; YaRN scaling changes
  the table and the softmax scale (`layers/rotary_yarn.py`).
- Multi-token prediction: hub checkpoints carry `num_nextn_predict_layers` extra layers as
  `model.layers.{num_hidden_layers + i}.*` (a decoder layer plus `enorm`, `hnorm`, `eh_proj`,
  `shared_head.{norm,head}` and `embed_tokens`). They load into `self.mtp` and draft tokens
  for speculative decoding (`draft_hidden` / `draft_logits`, driven by `runner.drafting`); the
  main forward does not run them. Checkpoints saved by transformers drop them
  (while keeping `num_nextn_predict_layers`), so a checkpoint without any MTP tensor loads with
  `self.mtp = None`; one with only some of them fails like any incomplete checkpoint.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import Any

import torch
from torch import nn

from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.attention import AttentionMetadata, KVCache, KVCacheSpec
from ksana_llm.layers.mla import MLADims, MultiLatentAttention
from ksana_llm.layers.moe import FusedExperts, GatedMLP, SparseMoeBlock
from ksana_llm.layers.moe_routers import GroupedTopKRouter
from ksana_llm.layers.norm import RMSNorm
from ksana_llm.loader.quantized import input_scale_group
from ksana_llm.layers.parallel import SINGLE
from ksana_llm.layers.rotary import rope_settings
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, Rope
from ksana_llm.models.weight_loading import expected_keys, place_tensor

# checkpoint part -> (fused parameter, part index): dense / shared-expert gate+up (and MLA's own).
_MLP_FUSED_PARTS = MappingProxyType({"gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1)})


def check_moe_layer_spacing(config: Any) -> None:
    """ValueError naming the field for layer layouts no DeepSeek implementation here covers."""
    if getattr(config, "moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={config.moe_layer_freq!r} is not supported (DeepSeek "
                         "V2 and V3 use 1)")
    first_dense = getattr(config, "first_k_dense_replace", 0) or 0
    if first_dense < 0:
        raise ValueError(f"first_k_dense_replace must be >= 0, got {first_dense}")


def num_mtp_layers(config: Any) -> int:
    return int(getattr(config, "num_nextn_predict_layers", 0) or 0)


def deepseek_moe_block(config: Any, router: nn.Module,
                       parallel: ParallelContext = SINGLE) -> SparseMoeBlock:
    """Under tensor parallelism every rank routes (the router is replicated) and keeps a slice
    of every expert's (and the shared experts') intermediate columns; the block all-reduces the
    partial sums once."""
    act = getattr(config, "hidden_act", "silu")
    hidden, num_experts = config.hidden_size, config.n_routed_experts
    experts = FusedExperts(num_experts, hidden, config.moe_intermediate_size, act,
                           parallel=parallel, scale_group=input_scale_group(config))
    num_shared = getattr(config, "n_shared_experts", 0) or 0
    # The shared experts are always on and unweighted: one MLP n_shared times as wide.
    shared = GatedMLP(hidden, config.moe_intermediate_size * num_shared, act, parallel=parallel,
                      reduce_output=False, scale_group=input_scale_group(config)) \
        if num_shared else None
    return SparseMoeBlock(router, experts, shared, shared_expert_name="shared_experts",
                          parallel=parallel)


class MtpSharedHead(nn.Module):
    def __init__(self, config: Any) -> None:
        super().__init__()
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.head = nn.Linear(config.hidden_size, config.vocab_size, bias=False)


class DeepseekV3MtpLayer(LlamaDecoderLayer):
    """One multi-token-prediction depth: `eh_proj([enorm(embed(token)); hnorm(h_prev)])` through a
    decoder layer (always MoE), then `shared_head.norm`; `shared_head.head` gives the draft's
    logits. Names match the checkpoint's `model.layers.{N + i}.*`."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__(config, attention, mlp)
        hidden, eps = config.hidden_size, config.rms_norm_eps
        self.embed_tokens = nn.Embedding(config.vocab_size, hidden)
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = MtpSharedHead(config)

    def forward(self, rope: Rope, input_ids: torch.Tensor, previous_hidden: torch.Tensor,
                kv_cache: KVCache, meta: AttentionMetadata) -> torch.Tensor:
        """Hidden states (after `shared_head.norm`) for tokens `input_ids` given the previous
        depth's hidden states at the same rows; `shared_head.head` turns them into logits."""
        joined = torch.cat((self.enorm(self.embed_tokens(input_ids)), self.hnorm(previous_hidden)),
                           dim=-1)
        hidden, residual = super().forward(rope, self.eh_proj(joined), None, kv_cache, meta)
        return self.shared_head.norm(hidden, residual)[0]


class DeepseekV3Mtp(nn.Module):
    def __init__(self, layers: Iterable[nn.Module]) -> None:
        super().__init__()
        self.layers = nn.ModuleList(layers)


class _LoadIfPresent(nn.Module):
    """Stands in for a submodule the checkpoint may omit entirely, while the checkpoint loads.

    `load_checkpoint` sends it every tensor under its prefix (it is a custom loader) and asks for
    its expected keys only at the end: none if no tensor came, all of the target's otherwise. The
    target is held outside the module tree meanwhile, so its own custom loaders (MoE experts)
    are not required when it is absent."""

    takes_quantized_weights = True  # passed on to place_tensor, which knows where FP8 may go

    def __init__(self, target: nn.Module, fused_parts: Mapping[str, tuple[str, int]]) -> None:
        super().__init__()
        self.__dict__["target"] = target  # not registered: see the docstring
        self.fused_parts = fused_parts
        self.filled = False

    def expected_checkpoint_keys(self) -> list[str]:
        return sorted(expected_keys(self.target)) if self.filled else []

    def load_checkpoint_tensor(self, local_name: str, tensor: torch.Tensor) -> list[str]:
        """Place one tensor the way `load_checkpoint` does: a nested custom loader, a part of a
        fused projection, or a parameter of the same name."""
        self.filled = True
        try:
            return place_tensor(self.target, local_name, tensor, self.fused_parts)
        except ValueError as exc:
            raise ValueError(f"MTP layers: {exc}") from None


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Tensor parallelism splits MLA's heads and every expert's columns (see `layers/mla.py`,
    `deepseek_moe_block`); pipeline parallelism splits the layers, and the last stage keeps the
    MTP layers. The MTP layers' own embedding and head are not split."""

    # MLA over the paged latents: the torch backend's gathers, or the Triton attention kernels
    # with the latent as the one KV "head" (MultiLatentAttention._kernel_attention).
    attention_backends = ("torch", "triton")

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        check_moe_layer_spacing(config)
        self.check_routing(config)
        if num_mtp_layers(config) < 0:
            raise ValueError(f"num_nextn_predict_layers must be >= 0, got {num_mtp_layers(config)}")
        super().__init__(config, parallel)
        self.mla_dims = MLADims.from_config(config)
        # Llama's RoPE table spans head_dim and knows no YaRN (uses_rope is False for that
        # reason): MLA ropes only qk_rope_head_dim, with DeepSeek's scaling.
        theta, scaling = rope_settings(config)
        self.model.rotary_emb = build_rotary(self.mla_dims.qk_rope_head_dim,
                                             config.max_position_embeddings, theta, scaling)
        first = config.num_hidden_layers
        self.mtp: DeepseekV3Mtp | None = None
        if num_mtp_layers(config) and self.parallel.is_last_stage:
            self.mtp = DeepseekV3Mtp(
                DeepseekV3MtpLayer(config, self.make_attention(config, first + i),
                                   deepseek_moe_block(config, self.make_router(config),
                                                      self.parallel))
                for i in range(num_mtp_layers(config)))

    # ---- building blocks (DeepSeek-V2 overrides the routing and the RoPE layout) --------------
    @staticmethod
    def check_routing(config: Any) -> None:
        """ValueError naming the field for routing this class does not implement."""
        for field, supported in (("topk_method", "noaux_tc"), ("scoring_func", "sigmoid")):
            value = getattr(config, field, supported)
            if value != supported:
                raise ValueError(f"{field}={value!r} is not supported (DeepSeek-V3 uses "
                                 f"{supported!r})")

    def make_router(self, config: Any) -> nn.Module:
        return GroupedTopKRouter(
            config.hidden_size, config.n_routed_experts, config.num_experts_per_tok,
            n_group=config.n_group or 1, topk_group=config.topk_group or 1,
            renormalize=bool(config.norm_topk_prob),
            routed_scaling_factor=config.routed_scaling_factor)

    def interleaved_rope(self, config: Any) -> bool:
        """Whether the checkpoint's rope dims pair up as (0, 1), (2, 3), ... (DeepSeek's own
        layout) rather than as halves."""
        return bool(getattr(config, "rope_interleave", False))

    def uses_rope(self, config: Any) -> bool:
        return False  # installed in __init__ instead (see there)

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return MultiLatentAttention(config, layer_idx, parallel=self.parallel,
                                    interleaved_rope=self.interleaved_rope(config))

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        if layer_idx < (getattr(config, "first_k_dense_replace", 0) or 0):
            return LlamaMLP(config, layer_idx, parallel=self.parallel)
        return deepseek_moe_block(config, self.make_router(config), self.parallel)

    # ---- facts the runner needs --------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        return 1

    @property
    def head_dim(self) -> int:
        return self.mla_dims.latent_dim

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return self.mla_dims.cache_spec()

    @property
    def sliding_window(self) -> int | None:
        return None

    # ---- multi-token prediction (speculative decoding) ----------------------------------------
    @property
    def num_draft_layers(self) -> int:
        """Draft layers the runner keeps a KV cache for: the first MTP layer, which drafts every
        speculative token (as vLLM does with DeepSeek's single MTP layer); 0 without MTP
        weights or off the last pipeline stage."""
        return 0 if self.mtp is None else 1

    def draft_hidden(self, input_ids: torch.Tensor, previous_hidden: torch.Tensor,
                     positions: torch.Tensor, kv_cache: KVCache, meta: AttentionMetadata
                     ) -> torch.Tensor:
        """The MTP layer's hidden states for rows at `positions`: row p reads the hidden state
        the main model (or the previous draft) gave position p and the id of token p + 1, and
        leads to token p + 2."""
        if self.mtp is None:  # the runner checks num_draft_layers first
            raise RuntimeError("this checkpoint has no MTP layers to draft with")
        rope = self.model.rotary_emb.cos_sin(positions, previous_hidden.dtype)
        return self.mtp.layers[0](rope, input_ids, previous_hidden, kv_cache, meta)

    def draft_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """Float32 logits of the MTP layer's own head (not split under tensor parallelism)."""
        return self.mtp.layers[0].shared_head.head(hidden).float()

    # ---- weights -------------------------------------------------------------------------------
    @property
    def fused_parts(self) -> Mapping[str, tuple[str, int]]:  # type: ignore[override]
        return MappingProxyType({**_MLP_FUSED_PARTS, **self.mla_dims.fused_parts})

    def _renamed(self, weights: Iterable[tuple[str, torch.Tensor]]
                 ) -> Iterator[tuple[str, torch.Tensor]]:
        """`model.layers.{N + i}.*` (MTP depth i) -> `mtp.layers.{i}.*`."""
        first = self.config.num_hidden_layers
        pattern = re.compile(r"model\.layers\.(\d+)\.(.*)")
        for name, tensor in weights:
            match = pattern.fullmatch(name)
            if match is not None and int(match.group(1)) >= first:
                depth = int(match.group(1)) - first
                if depth >= num_mtp_layers(self.config):
                    raise ValueError(f"checkpoint tensor {name!r}: layer {match.group(1)} is beyond "
                                     f"num_hidden_layers + num_nextn_predict_layers")
                name = f"mtp.layers.{depth}.{match.group(2)}"
            yield name, tensor

    def skip_checkpoint_tensor(self, name: str) -> bool:
        """Also the MTP layers' tensors, on pipeline stages other than the last."""
        if name.startswith("mtp.") and not self.parallel.is_last_stage:
            return True
        return super().skip_checkpoint_tensor(name)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]], *,
                     require_all: bool = True) -> set[str]:
        """A checkpoint without MTP tensors drops the MTP layers; a weight update
        (`require_all` False) keeps them, updated or not. The keys filled."""
        mtp = self.mtp
        stand_in = None if mtp is None else _LoadIfPresent(mtp, self.fused_parts)
        if stand_in is not None:
            self.mtp = stand_in  # type: ignore[assignment]
        try:
            filled = self.load_checkpoint_tensors(self._renamed(weights),
                                                  require_all=require_all)
        finally:
            if stand_in is not None:
                self.mtp = mtp if stand_in.filled or not require_all else None
        self.prepare_for_inference()
        return filled
