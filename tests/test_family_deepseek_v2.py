"""DeepSeek-V2 family (V2 / V2.5 / Coder-V2 and V2-Lite) end to end against transformers (fp32).

Two tiny random `DeepseekV2ForCausalLM`s saved by transformers (per-expert hub names):
- "v2": a low-rank query (`q_lora_rank`), `group_limited_greedy` routing (8 experts in 4 groups,
  the best 2 groups eligible, 3 experts per token) with `routed_scaling_factor` 16, as V2 and
  V2.5 route;
- "lite": a full-rank `q_proj` (`q_lora_rank` null), plain `greedy` routing, YaRN with V2-Lite's
  mscale 0.707.
Both: logits at prefill (whole and chunked), at 16 decode steps and on a prefix-cache hit, and
greedy tokens through the Engine (tests/family_harness.py); "lite" also on the Triton kernels.
The router is checked on its own against transformers' `DeepseekV2TopkRouter`, and the group
limit and the interleaved RoPE are shown to matter (the parity checks fail without them).
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from transformers import DeepseekV2Config, DeepseekV2ForCausalLM
from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter

from ksana_llm.layers.mla import MultiLatentAttention
from ksana_llm.layers.moe import SparseMoeBlock
from ksana_llm.layers.moe_routers import GroupLimitedSoftmaxRouter
from ksana_llm.models.deepseek_v2 import DeepseekV2ForCausalLM as OurDeepseekV2
from ksana_llm.models.llama import LlamaMLP
from tests.deepseek_checkpoint import randomize, same_routing
from tests.family_harness import (check_family, check_other_format, check_prefill_and_decode,
                                  check_triton_backend, hf_reference, load_ours, memoized,
                                  write_bin_twin)

VOCAB = 256
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
        "original_max_position_embeddings": 32, "beta_fast": 32, "beta_slow": 1}
VARIANTS = {
    "v2": {"q_lora_rank": 48, "topk_method": "group_limited_greedy", "n_group": 4,
           "topk_group": 2, "routed_scaling_factor": 16.0,
           "rope_parameters": {**YARN, "mscale": 1.0, "mscale_all_dim": 1.0}},
    "lite": {"q_lora_rank": None, "topk_method": "greedy", "n_group": 1, "topk_group": 1,
             "routed_scaling_factor": 1.0,
             "rope_parameters": {**YARN, "mscale": 0.707, "mscale_all_dim": 0.707}},
}


def v2_config(variant: str, **overrides) -> DeepseekV2Config:
    return DeepseekV2Config(**{
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": 3, "first_k_dense_replace": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "num_experts_per_tok": 3,
        "n_shared_experts": 2, "norm_topk_prob": False, "kv_lora_rank": 32,
        "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "bos_token_id": 0,
        "eos_token_id": 1, "tie_word_embeddings": False, **VARIANTS[variant], **overrides})


@dataclasses.dataclass
class Saved:
    hf: DeepseekV2ForCausalLM
    folder: Path


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> dict[str, Saved]:
    out = {}
    for variant in VARIANTS:
        torch.manual_seed(0)
        hf = DeepseekV2ForCausalLM(v2_config(variant)).eval()
        randomize(hf)
        folder = tmp_path_factory.mktemp(f"deepseek_v2_{variant}")
        hf.save_pretrained(folder)
        out[variant] = Saved(hf, folder)
    return out


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_family_matches_transformers(saved, variant):
    model = saved[variant]
    check_family(load_ours(model.folder), model.folder, hf_reference(model.hf), vocab=VOCAB)


def test_triton_backend_matches_transformers(saved):
    model = saved["lite"]
    check_triton_backend(load_ours(model.folder), model.folder, hf_reference(model.hf),
                         vocab=VOCAB)


def test_checkpoint_and_model_layout(saved):
    """Hub names on disk (per-expert tensors, a router without a selection bias); our model:
    MLA everywhere (a full-rank q_proj for Lite), layer 0 dense, then MoE layers routed by
    softmax with the config's group limit, the router in float32 in a bf16 model, no MTP."""
    names = list(load_file(saved["v2"].folder / "model.safetensors"))
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in names
    assert "model.layers.1.mlp.gate.weight" in names
    assert not any("e_score_correction_bias" in name for name in names)
    for variant, has_q_lora in (("v2", True), ("lite", False)):
        ours = load_ours(saved[variant].folder, dtype="bfloat16")
        assert isinstance(ours, OurDeepseekV2) and ours.mtp is None
        attn = ours.model.layers[0].self_attn
        assert isinstance(attn, MultiLatentAttention) and attn.interleaved_rope
        assert hasattr(attn, "q_b_proj") == has_q_lora and hasattr(attn, "q_proj") != has_q_lora
        assert isinstance(ours.model.layers[0].mlp, LlamaMLP)
        for layer in ours.model.layers[1:]:
            assert isinstance(layer.mlp, SparseMoeBlock)
            gate = layer.mlp.gate
            assert isinstance(gate, GroupLimitedSoftmaxRouter)
            assert gate.group_limited == (variant == "v2")
            assert gate.weight.dtype == torch.float32
            assert layer.mlp.shared_experts is not None
        assert ours.model.layers[1].mlp.experts.w13.dtype == torch.bfloat16


def test_hub_config_json_loads(saved, tmp_path):
    """The config.json DeepSeek published for V2-Lite (written for its remote code: `auto_map`,
    `rope_scaling` with "type", `rope_theta` beside it, `scoring_func`, `moe_layer_freq`,
    `seq_aux`, no derived `head_dim`) reads as the same model."""
    model = saved["lite"]
    folder = shutil.copytree(model.folder, tmp_path / "hub")
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    for derived in ("head_dim", "qk_head_dim", "dtype", "output_router_logits", "mlp_bias"):
        config.pop(derived, None)
    config.update({
        "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV2Config",
                     "AutoModelForCausalLM": "modeling_deepseek.DeepseekV2ForCausalLM"},
        "aux_loss_alpha": 0.001, "moe_layer_freq": 1, "scoring_func": "softmax", "seq_aux": True,
        "torch_dtype": "bfloat16", "transformers_version": "4.33.1",
        "rope_theta": rope["rope_theta"],
        "rope_scaling": {"type": "yarn", **{k: v for k, v in rope.items()
                                            if k not in ("rope_type", "rope_theta")}}})
    (folder / "config.json").write_text(json.dumps(config))
    ours = load_ours(folder)
    assert isinstance(ours, OurDeepseekV2)
    check_prefill_and_decode(ours, hf_reference(model.hf), vocab=VOCAB, chunks=[40])


@pytest.mark.parametrize("mutation", ["no group limit", "rope in halves"])
def test_parity_checks_see_routing_and_rope(saved, mutation):
    """What the parity checks above rest on: with either V2-specific part undone, our logits
    leave transformers' (so the "v2" variant's routing and RoPE are really exercised)."""
    model = saved["v2"]
    ours = load_ours(model.folder)
    for layer in ours.model.layers:
        if mutation == "no group limit" and isinstance(layer.mlp, SparseMoeBlock):
            layer.mlp.gate.group_limited = False
        if mutation == "rope in halves":
            layer.self_attn.interleaved_rope = False
    with pytest.raises(AssertionError, match="not close"):
        check_prefill_and_decode(ours, memoized(hf_reference(model.hf)), vocab=VOCAB,
                                 chunks=[40])


def _routers(method: str, **overrides) -> tuple[DeepseekV2TopkRouter, GroupLimitedSoftmaxRouter]:
    config = v2_config("v2", topk_method=method, n_routed_experts=16, num_experts_per_tok=4,
                       n_group=4, topk_group=2, routed_scaling_factor=2.5, **overrides)
    hf = DeepseekV2TopkRouter(config)
    torch.manual_seed(5)
    with torch.no_grad():
        hf.weight.normal_(0, 1.0)
    ours = OurDeepseekV2(config).model.layers[1].mlp.gate
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
    return hf, ours


@pytest.mark.parametrize("method", ["greedy", "group_limited_greedy"])
def test_router_matches_transformers(method):
    hf, ours = _routers(method)
    x = torch.randn(64, 64)
    experts, weights, hf_weights = same_routing(hf, ours, x)
    torch.testing.assert_close(weights, hf_weights)
    probs = torch.softmax(x @ ours.weight.t(), dim=-1)
    torch.testing.assert_close(weights, probs.gather(1, experts) * 2.5)
    unlimited = probs.topk(4, dim=-1).indices.sort(dim=-1).values
    groups = experts // 4
    if method == "group_limited_greedy":
        assert all(len(set(row)) <= 2 for row in groups.tolist())
        assert not torch.equal(unlimited, experts), "the group limit never changed a choice"
    else:
        assert torch.equal(unlimited, experts)
        assert any(len(set(row)) > 2 for row in groups.tolist())


def test_router_renormalises_when_the_config_asks():
    """norm_topk_prob: vLLM renormalises the chosen probabilities before the scaling factor;
    transformers' port ignores the flag, so the reference here is the unnormalised
    transformers router's output, divided by its own row sums."""
    hf, ours = _routers("group_limited_greedy", norm_topk_prob=True)
    _, weights, hf_weights = same_routing(hf, ours, torch.randn(32, 64))
    torch.testing.assert_close(weights, hf_weights / hf_weights.sum(-1, keepdim=True) * 2.5)


@pytest.mark.parametrize("field, value", [("topk_method", "noaux_tc"),
                                          ("scoring_func", "sigmoid"), ("moe_layer_freq", 2)])
def test_unsupported_settings_name_the_field(field, value):
    config = v2_config("lite")
    setattr(config, field, value)
    with pytest.raises(ValueError, match=field):
        OurDeepseekV2(config)


def test_pytorch_bin_loads_the_same(saved, tmp_path):
    model = saved["v2"]
    check_other_format(load_ours(model.folder), write_bin_twin(model.folder, tmp_path / "bin"),
                       memoized(hf_reference(model.hf)), vocab=VOCAB)
