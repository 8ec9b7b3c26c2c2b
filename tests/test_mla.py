"""Multi-head latent attention (DeepSeek-V3) against transformers' `DeepseekV3Attention`.

Same weights, same hidden states and positions: our layer runs through the paged cache as the
runner lays batches out (chunked prefill with a cached prefix, several sequences decoding
together at different lengths beside a prefill), with the prefill in the absorbed and in the
expanded form; transformers runs each whole sequence at once. Variants cover a low-rank and a
full-rank query, plain and interleaved RoPE, and YaRN scaling (which changes the RoPE table, its
magnitude and the softmax scale).
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from transformers import DeepseekV3Config
from transformers.cache_utils import DynamicCache
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3Attention,
    DeepseekV3RotaryEmbedding,
)

from ksana_llm.layers.attention import KVCacheSpec
from ksana_llm.layers.mla import MLADims, MultiLatentAttention
from ksana_llm.layers.rotary import RotaryEmbedding, rope_settings
from ksana_llm.layers.rotary_yarn import ScaledRotaryEmbedding, build_rotary
from ksana_llm.models.weight_loading import load_checkpoint
from ksana_llm.runner.model_runner import ModelRunner, SeqSlice

HIDDEN = 64
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
        "original_max_position_embeddings": 16, "mscale": 0.9, "mscale_all_dim": 1.3,
        "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    "low-rank-q": {"q_lora_rank": 48, "rope_interleave": True},
    "full-rank-q": {"q_lora_rank": None, "rope_interleave": False, "attention_bias": True},
    "yarn": {"q_lora_rank": 48, "rope_interleave": True, "rope_parameters": YARN},
}


def _config(**overrides) -> DeepseekV3Config:
    config = DeepseekV3Config(**{
        "hidden_size": HIDDEN, "num_attention_heads": 4, "num_key_value_heads": 4,
        "kv_lora_rank": 32, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "max_position_embeddings": 64, "num_hidden_layers": 1, "vocab_size": 256, **overrides})
    config._attn_implementation = "eager"
    return config


def _pair(config: DeepseekV3Config) -> tuple[DeepseekV3Attention, MultiLatentAttention]:
    """transformers' attention with visible random weights, and ours loaded from its tensors."""
    torch.manual_seed(0)
    hf = DeepseekV3Attention(config, layer_idx=0).eval()
    with torch.no_grad():
        for name, param in hf.named_parameters():
            if name.endswith("layernorm.weight"):
                param.uniform_(0.5, 1.5)
            elif name.endswith("bias"):
                param.normal_(0, 0.1)
            else:
                param.normal_(0, 1.5 / math.sqrt(param.shape[-1]))  # peaked attention
    holder = nn.Module()
    holder.attn = MultiLatentAttention(config)
    load_checkpoint(holder, ((f"attn.{k}", v) for k, v in hf.state_dict().items()),
                    holder.attn.dims.fused_parts)
    return hf, holder.attn


def _hf_outputs(hf: DeepseekV3Attention, config: DeepseekV3Config, x: torch.Tensor,
                cache: DynamicCache | None = None) -> torch.Tensor:
    """transformers over one whole sequence x [L, hidden] (causal): [L, hidden]."""
    n = x.shape[0]
    positions = torch.arange(n)[None]
    cos_sin = DeepseekV3RotaryEmbedding(config)(x[None], positions)
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    with torch.no_grad():
        return hf(x[None], cos_sin, mask, cache=cache)[0][0]


class _LatentCache(nn.Module):
    """What ModelRunner needs to lay out one MLA layer's cache and batches."""

    num_layers = 1
    sliding_window = None
    attention_backends = ("torch",)

    def __init__(self, spec: KVCacheSpec) -> None:
        super().__init__()
        self.kv_cache_spec = spec


class _PagedRun:
    """Drives our layer with the runner's own batch layout. Every sequence's hidden states are
    rows of one table and its token ids are those row numbers, so each output row is put back
    where its input came from."""

    def __init__(self, attn: MultiLatentAttention, config: DeepseekV3Config, table: torch.Tensor,
                 block_size: int = 4, num_blocks: int = 64) -> None:
        self.attn, self.table, self.block_size = attn, table, block_size
        self.runner = ModelRunner(_LatentCache(attn.dims.cache_spec()), device=torch.device("cpu"),
                                  dtype=torch.float32, num_blocks=num_blocks, block_size=block_size,
                                  attention_backend="torch")
        theta, scaling = rope_settings(config)
        self.rotary = build_rotary(config.qk_rope_head_dim, config.max_position_embeddings, theta,
                                   scaling)
        self.out = torch.full_like(table, float("nan"))
        self.next_block = 0

    def new_seq(self, first_row: int) -> dict:
        return {"first": first_row, "done": 0, "blocks": []}

    def step(self, work: list[tuple[dict, int]]) -> None:
        slices = []
        for seq, n in work:
            while len(seq["blocks"]) * self.block_size < seq["done"] + n:
                seq["blocks"].append(self.next_block)
                self.next_block += 1
            rows = list(range(seq["first"] + seq["done"], seq["first"] + seq["done"] + n))
            slices.append(SeqSlice(rows, seq["done"], list(seq["blocks"]), True))
            seq["done"] += n
        ids, positions, meta, _, _ = self.runner.build(slices)
        with torch.no_grad():
            out = self.attn(self.rotary.cos_sin(positions, torch.float32), self.table[ids],
                            self.runner.kv_caches[0], meta)
        self.out[ids] = out


@pytest.mark.parametrize("prefill_form", ["absorbed", "expanded"])
@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_mla_matches_transformers_through_the_paged_cache(variant, prefill_form):
    config = _config(**VARIANTS[variant])
    hf, ours = _pair(config)
    ours.expand_min_tokens = math.inf if prefill_form == "absorbed" else 0
    lengths = {"a": 29, "b": 33, "c": 17}  # positions up to 32: past YaRN's original 16
    starts = dict(zip(lengths, [0, 29, 62]))
    torch.manual_seed(1)
    table = torch.randn(sum(lengths.values()), HIDDEN)
    run = _PagedRun(ours, config, table)
    a, b, c = (run.new_seq(starts[name]) for name in lengths)
    run.step([(a, 7)])                      # a: first chunk
    run.step([(a, 13), (b, 24)])            # a: chunk over a cached prefix, beside b's prefill
    for _ in range(3):                      # a and b decode together (padded to b's length)
        run.step([(a, 1), (b, 1)])
    run.step([(a, 1), (b, 1), (c, 12)])     # decodes beside a fresh prefill
    run.step([(b, 1), (c, 1)])
    run.step([(b, 1), (c, 1), (a, 2)])      # a two-token chunk (absorbed prefill path)
    run.step([(a, 3), (b, 3), (c, 3)])      # equal chunks over cached prefixes: one batched call
    for name, seq in zip(lengths, (a, b, c)):
        start, done = starts[name], seq["done"]
        expected = _hf_outputs(hf, config, table[start:start + done])
        torch.testing.assert_close(run.out[start:start + done], expected, atol=1e-5, rtol=1e-4,
                                   msg=lambda m, name=name: f"sequence {name}: {m}")


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_cache_holds_the_compressed_latent(variant):
    """One row per token: [kv_a_layernorm(c_kv) | roped k_pe], exactly what transformers keeps
    in its cache for this layer; no V cache at all."""
    config = _config(**VARIANTS[variant])
    hf, ours = _pair(config)
    dims = ours.dims
    assert dims.cache_spec() == KVCacheSpec(1, 32 + 8, v_head_dim=0)
    assert dims.cache_spec().bytes_per_token(torch.float32) == (32 + 8) * 4
    torch.manual_seed(2)
    table = torch.randn(10, HIDDEN)
    run = _PagedRun(ours, config, table)
    seq = run.new_seq(0)
    run.step([(seq, 10)])
    hf_cache = DynamicCache(config=config)
    _hf_outputs(hf, config, table, hf_cache)
    expected = torch.cat((hf_cache.layers[0].keys[0, 0], hf_cache.layers[0].values[0, 0]), dim=-1)
    k_cache, v_cache = run.runner.kv_caches[0]
    assert v_cache.shape[-1] == 0
    slots = torch.tensor([seq["blocks"][p // 4] * 4 + p % 4 for p in range(10)])
    torch.testing.assert_close(k_cache.view(-1, dims.latent_dim)[slots], expected,
                               atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_rope_table_and_softmax_scale_match_transformers(variant):
    config = _config(**VARIANTS[variant])
    hf, ours = _pair(config)
    theta, scaling = rope_settings(config)
    rotary = build_rotary(config.qk_rope_head_dim, config.max_position_embeddings, theta, scaling)
    positions = torch.arange(64)
    hf_cos, hf_sin = DeepseekV3RotaryEmbedding(config)(torch.zeros(1), positions[None])
    cos, sin = rotary.cos_sin(positions, torch.float32)
    half = config.qk_rope_head_dim // 2
    torch.testing.assert_close(cos[:, 0], hf_cos[0, :, :half], atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(sin[:, 0], hf_sin[0, :, :half], atol=1e-6, rtol=1e-6)
    assert ours.scale == pytest.approx(hf.scaling, rel=1e-12)
    if variant == "yarn":  # the scaling really is in play
        assert isinstance(rotary, ScaledRotaryEmbedding) and rotary.attention_factor != 1.0
        assert ours.scale != pytest.approx(config.qk_head_dim ** -0.5)
    else:
        assert type(rotary) is RotaryEmbedding


def test_expanded_form_is_chosen_for_long_chunks_only():
    """The prefill form follows the cost model: DeepSeek-V3's shapes switch at ~170 rows."""
    v3 = MLADims(128, 1536, 512, 128, 64, 128)
    assert 150 < v3.expand_min_tokens() < 200
    assert MLADims(4, None, 8, 16, 8, 16).expand_min_tokens() == math.inf  # never cheaper


def test_bad_dims_name_the_field():
    good = {"num_attention_heads": 4, "q_lora_rank": None, "kv_lora_rank": 32,
            "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16}
    assert MLADims.from_config(SimpleNamespace(**good)).latent_dim == 40
    with pytest.raises(ValueError, match="qk_rope_head_dim"):
        MLADims.from_config(SimpleNamespace(**{**good, "qk_rope_head_dim": 7}))
    with pytest.raises(ValueError, match="kv_lora_rank"):
        MLADims.from_config(SimpleNamespace(**{**good, "kv_lora_rank": 0}))
