"""Tensor and pipeline parallelism on CPU with gloo: real worker processes, real process groups.

Each parallel engine must give the same greedy tokens as transformers (= TP 1) and logits within
fp32 tolerance, on tiny Llama (even and uneven splits, KV heads replicated), Qwen2, Mixtral
(MoE), DeepSeek-V3 (MLA heads split, latents replicated; routed and shared experts split),
DeepSeek-V2-Lite's shape (a full-rank MLA query split by heads, softmax group-limited routing),
Gemma 2 / 3 (windowed and full layers, a scaled embedding; Gemma 2's capped logits), Phi-3
(fused checkpoint projections split by rank), GLM-4-0414 (partial interleaved RoPE) and Granite
(scaled embeddings, residual branches and logits), with TP 2 and 3, PP 2 and TP 2 x PP 2; and
each rank must hold only its shard. The models are in tests/parallel_models.py, failures in
tests/test_parallel_failures.py, the split arithmetic in tests/test_parallel_splits.py.
"""


from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from tests.parallel_models import build, check_engine

pytestmark = pytest.mark.timeout(300)


@pytest.mark.parametrize("name, tp", [("llama", 2), ("llama-tp3", 3), ("llama-mqa-tied", 2),
                                      ("qwen2", 2), ("mixtral", 2), ("deepseek", 2),
                                      ("deepseek-v2", 2), ("gemma3", 2), ("gemma2", 2),
                                      ("phi3", 2), ("phi3-longrope", 2), ("glm4", 2),
                                      ("olmo2", 2), ("olmo2", 4), ("command-r-plus", 2),
                                      ("starcoder2", 2), ("gpt-oss", 2),
                                      ("granite", 2)])
def test_tensor_parallel_matches_transformers(tmp_path, name, tp):
    hf = build(name, tmp_path)
    check_engine(tmp_path, hf, tp=tp)


@pytest.mark.parametrize("name", ["llama-tp3", "qwen2", "mixtral", "deepseek", "deepseek-v2",
                                  "gemma3", "olmo3", "command-r7b", "gpt-oss"])
def test_pipeline_parallel_matches_transformers(tmp_path, name):
    hf = build(name, tmp_path)  # llama-tp3: 3 layers over 2 stages, 2 + 1
    check_engine(tmp_path, hf, pp=2)


@pytest.mark.parametrize("name", ["qwen2", "deepseek"])
def test_tensor_and_pipeline_parallel_together_match_transformers(tmp_path, name):
    hf = build(name, tmp_path)  # 4 ranks: 2 stages, each split over 2 ranks
    check_engine(tmp_path, hf, tp=2, pp=2)


def test_each_rank_holds_only_its_shard(tmp_path):
    build("llama-tp3", tmp_path)
    full = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)
    sharded = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                    tensor_parallel_size=3)
    try:
        attn = sharded.module.model.layers[0].self_attn
        assert (attn.num_heads, attn.num_kv_heads) == (2, 1)
        assert sharded.module.model.layers[0].mlp.down_proj.weight.shape == (96, 43)
        assert sharded.module.model.embed_tokens.weight.shape == (86, 96)
        count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
        assert count(sharded.module) < 0.45 * count(full.module)
        # Rank 0's query rows are the first two heads of the full projection.
        torch.testing.assert_close(attn.qkv_proj.weight[:32],
                                   full.module.model.layers[0].self_attn.qkv_proj.weight[:32])
    finally:
        # A setting refused before the ranks are told anything leaves them free for the next.
        with pytest.raises(ValueError, match="async_scheduling"):
            kt.Engine(sharded, num_device_blocks=8, async_scheduling=True)
        kt.Engine(sharded, num_device_blocks=8).shutdown()
    # Its worker ranks stopped with that engine: another one is refused, not left to hang.
    with pytest.raises(ValueError, match="load the model again"):
        kt.Engine(sharded, num_device_blocks=8)


def test_deepseek_ranks_split_mla_heads_and_experts(tmp_path):
    build("deepseek", tmp_path)
    # MLA has no KV heads to split: a num_key_value_heads that TP 2 could not split is no error.
    config_path = tmp_path / "config.json"
    text = config_path.read_text()
    assert '"num_key_value_heads": 4' in text
    config_path.write_text(text.replace('"num_key_value_heads": 4', '"num_key_value_heads": 3'))
    sharded = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                    tensor_parallel_size=2)
    try:
        layers = sharded.module.model.layers
        attn = layers[0].self_attn
        assert attn.dims.num_heads == 2
        assert attn.q_b_proj.weight.shape == (2 * 24, 48)  # 2 heads x (16 nope + 8 rope)
        assert attn.kv_b_proj.weight.shape == (2 * 32, 32)  # 2 heads x (16 + 16), from r = 32
        assert attn.o_proj.weight.shape == (64, 2 * 16)
        assert attn.qkv_a_proj.weight.shape == (48 + 32 + 8, 64)  # replicated down-projections
        assert layers[0].mlp.down_proj.weight.shape == (64, 48)  # dense layer: 96 / 2
        experts = layers[1].mlp.experts
        assert experts.w13.shape == (8, 2 * 16, 64) and experts.w2.shape == (8, 64, 16)
        assert layers[1].mlp.shared_experts.down_proj.weight.shape == (64, 16)
    finally:
        kt.Engine(sharded, num_device_blocks=8).shutdown()

