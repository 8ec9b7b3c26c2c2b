"""The Llama family (Llama 1/2/3, Yi, SmolLM2, Mistral-style configs) with our own layers.

Parameter names follow the Hugging Face checkpoints, except that q/k/v and gate/up are fused
into one matmul each (`qkv_proj`, `gate_up_proj`); `load_weights` (models/llama_weights.py)
maps the parts into place. The attention block is in models/llama_attention.py.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ksana_llm.layers.activation import get_gated_activation
from ksana_llm.layers.attention import AttentionMetadata, KVCache, KVCacheSpec
from ksana_llm.distributed.context import ParallelContext
from ksana_llm.layers.lora import LoraBatch
from ksana_llm.layers.linear import (FEW_ROWS, MergedLinear, packed_linear, prepack_cpu_weight,
                                     prepack_fits, prepacked_wins_few_rows)
from ksana_llm.layers.norm import RMSNorm
from ksana_llm.layers.parallel import (SINGLE, ParallelLMHead, RowParallelLinear,
                                       VocabParallelEmbedding, kv_head_shard,
                                       scale_aligned_split, tp_all_gather_rows)
from ksana_llm.loader.quantized import input_scale_group
from ksana_llm.layers.pipeline import PipelineGap, recv_hidden, send_hidden
from ksana_llm.layers.rotary import RotaryEmbedding, rope_settings
from ksana_llm.layers.rotary_yarn import build_rotary
from ksana_llm.models.llama_attention import LlamaAttention, Rope, head_dim_of
from ksana_llm.models.llama_weights import LlamaWeightLoading

logger = logging.getLogger("ksana_llm.model")

EmbeddingOverrides = tuple[torch.Tensor, torch.Tensor]  # rows of the batch, their embeddings



def embed_tokens(embedding: nn.Embedding, input_ids: torch.Tensor,
                 overrides: EmbeddingOverrides | None) -> torch.Tensor:
    """Token embeddings, with some rows replaced (plugins: image features and the like)."""
    hidden = embedding(input_ids)
    if overrides is not None:
        hidden = hidden.index_copy(0, overrides[0], overrides[1].to(hidden.dtype))
    return hidden


class LlamaMLP(nn.Module):
    """SwiGLU MLP; under tensor parallelism each rank keeps a (possibly uneven) slice of the
    intermediate columns and `down_proj` sums the ranks' partial outputs."""

    accepts_lora = True  # forward takes the step's LoRA adapters (see LlamaDecoderLayer)

    def __init__(self, config: Any, layer_idx: int = 0, *,
                 parallel: ParallelContext = SINGLE, hidden_act: str | None = None,
                 bias: bool | None = None) -> None:
        """`hidden_act` and `bias` replace the config's `hidden_act` and `mlp_bias` (families
        that name them otherwise: Gemma, InternLM 3)."""
        super().__init__()
        bias = bool(getattr(config, "mlp_bias", False)) if bias is None else bias
        size = config.intermediate_size
        # a quantized checkpoint's scale groups decide where the ranks' columns may start
        shard = scale_aligned_split(size, parallel, input_scale_group(config))
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=bias,
                                         shards=[shard, shard])
        self.down_proj = RowParallelLinear(size, config.hidden_size, bias=bias, ctx=parallel,
                                           in_shard=shard)
        self.act = get_gated_activation(hidden_act or getattr(config, "hidden_act", "silu"))

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None) -> torch.Tensor:
        return self.down_proj(self.act(self.gate_up_proj(x, lora)), lora)


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block; families swap in their own attention and MLP (MoE) modules."""

    def __init__(self, config: Any, attention: nn.Module, mlp: nn.Module) -> None:
        super().__init__()
        eps = getattr(config, "rms_norm_eps", 1e-6)
        self.input_layernorm = RMSNorm(config.hidden_size, eps)
        self.self_attn = attention
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps)
        self.mlp = mlp

    def forward(self, rope: Rope | None, hidden: torch.Tensor, residual: torch.Tensor | None,
                kv_cache: KVCache, meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        hidden, residual = input_norm(self.input_layernorm, hidden, residual)
        hidden = self.self_attn(rope, hidden, kv_cache, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return run_mlp(self.mlp, hidden, meta), residual


def input_norm(norm: RMSNorm, hidden: torch.Tensor, residual: torch.Tensor | None
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """A layer's first norm, fused with the previous layer's residual add; the first layer has
    no residual yet (its input is the residual)."""
    if residual is None:
        return norm(hidden), hidden
    return norm(hidden, residual)


def run_mlp(mlp: nn.Module, hidden: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
    """The MLP, with the step's LoRA adapters when it takes them."""
    if meta.lora is not None and getattr(mlp, "accepts_lora", False):
        return mlp(hidden, meta.lora)
    return mlp(hidden)


class LlamaModel(nn.Module):
    """Embedding, decoder layers, final norm. Under pipeline parallelism a stage builds only its
    own layers (the others are parameter-free `PipelineGap`s, so checkpoint names keep their
    layer numbers); the first stage embeds, the last one normalises and sends the final hidden
    states back to the first, which computes the logits."""

    def __init__(self, config: Any, make_layer: Callable[[Any, int], nn.Module],
                 use_rope: bool = True, parallel: ParallelContext = SINGLE) -> None:
        super().__init__()
        self.parallel = parallel
        self.hidden_size = config.hidden_size
        num_layers = config.num_hidden_layers
        if num_layers < 1:
            raise ValueError(f"num_hidden_layers must be at least 1, got {num_layers}")
        if parallel.pp_size > num_layers:
            raise ValueError(f"pipeline_parallel_size {parallel.pp_size} is more than the "
                             f"model's {num_layers} layers")
        self.first_layer, self.end_layer = parallel.layer_range(num_layers)
        self.embed_tokens = (VocabParallelEmbedding(config.vocab_size, config.hidden_size, parallel)
                             if parallel.is_first_stage else PipelineGap())
        self.layers = nn.ModuleList(
            make_layer(config, i) if self.first_layer <= i < self.end_layer else PipelineGap()
            for i in range(num_layers))
        self.norm = (RMSNorm(config.hidden_size, getattr(config, "rms_norm_eps", 1e-6))
                     if parallel.is_last_stage else PipelineGap())
        # One RoPE table for all layers; cos/sin are looked up once per step. ALiBi models
        # (use_rope False) position tokens inside attention instead.
        self.rotary_emb: RotaryEmbedding | None = None
        # A second table for the layers whose `local_rope` is True (Gemma 3's windowed layers
        # use another base); set by such families after construction.
        self.local_rotary_emb: RotaryEmbedding | None = None
        # Granite scales every input embedding (given ones too) by this; None: no scaling.
        self.embedding_multiplier: float | None = None
        if use_rope:
            theta, scaling = rope_settings(config)
            self.rotary_emb = build_rotary(head_dim_of(config), config.max_position_embeddings,
                                           theta, scaling)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, embedding_overrides: EmbeddingOverrides | None = None
                ) -> torch.Tensor:
        ctx = self.parallel
        local_layers = self.layers[self.first_layer:self.end_layer]
        if ctx.is_first_stage:
            hidden = embed_tokens(self.embed_tokens, input_ids, embedding_overrides)
            if self.embedding_multiplier is not None:
                hidden = hidden * self.embedding_multiplier
        else:
            dtype = next(p.dtype for name, p in local_layers[0].named_parameters()
                         if name.endswith("norm.weight"))  # the stream's, as layers norm it
            hidden = recv_hidden((input_ids.shape[0], self.hidden_size), dtype, input_ids.device,
                                 ctx.stage_rank(ctx.pp_rank - 1))
        rope = None if self.rotary_emb is None else self.rotary_emb.cos_sin(
            positions, hidden.dtype, meta.long_rope_rows)
        local_rope = (None if self.local_rotary_emb is None
                      else self.local_rotary_emb.cos_sin(positions, hidden.dtype))
        residual = None
        for layer, kv_cache in zip(local_layers, kv_caches):
            layer_rope = local_rope if local_rope is not None and layer.local_rope else rope
            hidden, residual = layer(layer_rope, hidden, residual, kv_cache, meta)
        if not ctx.is_last_stage:
            # hidden + residual is what the next layer's fused add-norm would see.
            send_hidden(hidden if residual is None else hidden + residual,
                        ctx.stage_rank(ctx.pp_rank + 1))
            if ctx.is_first_stage:
                return recv_hidden(hidden.shape, hidden.dtype, hidden.device,
                                   ctx.stage_rank(ctx.pp_size - 1))
            return hidden  # a middle stage's output is not used
        # (Layers that keep the stream whole, OLMo 2's, leave no residual.)
        hidden = self.norm(hidden) if residual is None else self.norm(hidden, residual)[0]
        if ctx.pp_size > 1:
            send_hidden(hidden, ctx.stage_rank(0))
        return hidden


class LlamaForCausalLM(LlamaWeightLoading, nn.Module):
    """Forward over a flattened batch of tokens; logits only for the rows asked for.

    Families that differ only in their attention or MLP override `make_attention` / `make_mlp`
    (or `make_layer` for a different block) and `fused_parts` / `skip_checkpoint_tensor`
    (checkpoint loading: `LlamaWeightLoading`, in models/llama_weights.py).
    """

    supports_parallel = True  # tensor and pipeline parallelism (see ksana_llm.distributed)
    # True for a sequence-classification model's decoder (models/sequence_classification.py):
    # its LM head only stands in, and gets no prepacked copy.
    lm_head_unused = False
    # Families whose RMSNorms multiply the weight in float32 before the cast back (OLMo 2,
    # GPT-OSS), not after it: in bfloat16 the two round differently.
    norm_weights_in_float32 = False

    def __init__(self, config: Any, parallel: ParallelContext | None = None) -> None:
        super().__init__()
        self.config = config
        self.parallel = parallel or SINGLE
        self.model = LlamaModel(config, self.make_layer, use_rope=self.uses_rope(config),
                                parallel=self.parallel)
        if self.norm_weights_in_float32:
            for module in self.model.modules():
                if isinstance(module, RMSNorm):
                    module.weight_in_float32 = True
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        # Logits are computed on the first pipeline stage, which also holds the embedding.
        if not self.tie_word_embeddings and self.parallel.is_first_stage:
            self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, self.parallel)
        self._lm_head_packed: torch.Tensor | None = None  # see prepare_for_inference
        self._lm_head_packed_min_rows = 1

    # ---- building blocks (overridden by families) ---------------------------------------------
    def uses_rope(self, config: Any) -> bool:
        """False for families that position tokens another way (ALiBi)."""
        return True

    def make_attention(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaAttention(config, layer_idx, parallel=self.parallel)

    def make_mlp(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaMLP(config, layer_idx, parallel=self.parallel)

    def make_layer(self, config: Any, layer_idx: int) -> nn.Module:
        return LlamaDecoderLayer(config, self.make_attention(config, layer_idx),
                                 self.make_mlp(config, layer_idx))

    # ---- facts the runner needs --------------------------------------------------------------
    @property
    def num_layers(self) -> int:
        """Decoder layers this rank runs (and keeps a KV cache for)."""
        return self.model.end_layer - self.model.first_layer

    @property
    def num_kv_heads(self) -> int:
        """KV heads this rank keeps."""
        total = getattr(self.config, "num_key_value_heads", None) or self.config.num_attention_heads
        return kv_head_shard(total, self.parallel)[1]

    @property
    def head_dim(self) -> int:
        return head_dim_of(self.config)

    @property
    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec(self.num_kv_heads, self.head_dim)

    @property
    def sliding_window(self) -> int | None:
        """None: transformers' Llama attends to the whole context, even when a config carries a
        `sliding_window` key. Families with a window override this."""
        return None

    @property
    def long_rope_switch(self) -> int | None:
        """LongRoPE: the length past which a sequence's KV takes the long factors (the scheduler
        recomputes a sequence that grows past it); None for other RoPE."""
        return getattr(self.model.rotary_emb, "switch_length", None)

    # ---- compute -------------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[KVCache],
                meta: AttentionMetadata, embedding_overrides: EmbeddingOverrides | None = None
                ) -> torch.Tensor:
        return self.model(input_ids, positions, kv_caches, meta, embedding_overrides)

    def _lm_head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tie_word_embeddings else self.lm_head.weight

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits of `hidden`'s rows; None on pipeline stages other than the first."""
        if not self.parallel.is_first_stage:
            return None
        packed = self._lm_head_packed
        if packed is not None and hidden.shape[0] >= self._lm_head_packed_min_rows:
            logits = packed_linear(hidden, packed, None)
        else:
            logits = nn.functional.linear(hidden, self._lm_head_weight())
        return tp_all_gather_rows(logits.float(), self.parallel, self.config.vocab_size)

    def prepare_for_inference(self) -> None:
        """Called once the weights are loaded. On CPU in float32, every projection and the LM
        head get oneDNN's prepacked copy of their weight (see `layers.linear.prepack_cpu_weight`:
        1.05-2x faster matmuls, the largest part of a CPU step) -- when a second copy of those
        weights fits in memory (`layers.linear.prepack_fits`). Decode batches of a row or two
        keep `F.linear` on CPUs where it was measured faster (`prepacked_wins_few_rows`)."""
        self._lm_head_packed = None
        self._lm_head_packed_min_rows = 1
        for module in self.modules():  # float32 copies of sink logits (GPT-OSS) up to date
            if isinstance(module, LlamaAttention):
                module.sinks_in_float32(refresh=True)
        packers = [m for m in self.modules() if hasattr(m, "prepack")]
        for module in packers:  # copies of weights a weight update has replaced since
            module.packed_weight = None
        weights = [m.weight for m in packers]
        # A classifier's LM head is a stand-in no request reads: no copy of it.
        pack_lm_head = self.parallel.is_first_stage and not self.lm_head_unused
        if pack_lm_head:
            weights.append(self._lm_head_weight())
        num_bytes = sum(w.numel() * w.element_size() for w in weights
                        if w.device.type == "cpu" and w.dtype == torch.float32)
        if num_bytes and not prepack_fits(num_bytes):
            return
        for module in packers:
            module.prepack()
        if pack_lm_head:
            self._lm_head_packed = prepack_cpu_weight(self._lm_head_weight())
        packed = [m for m in packers if m.packed_weight is not None]
        if packed and not prepacked_wins_few_rows():
            logger.info("F.linear multiplies up to %d rows faster than the prepacked weights "
                        "on this CPU: decode batches that small use it", FEW_ROWS)
            for module in packed:
                module.packed_min_rows = FEW_ROWS + 1
            self._lm_head_packed_min_rows = FEW_ROWS + 1


class MistralForCausalLM(LlamaForCausalLM):
    """Mistral: Llama's layout, with the config's `sliding_window` (null in v0.2 and later) on
    every layer, as transformers' Mistral applies it."""

    @property
    def sliding_window(self) -> int | None:
        return getattr(self.config, "sliding_window", None) or None
