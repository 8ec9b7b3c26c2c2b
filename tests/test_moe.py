"""The MoE layer (`ksana_llm/layers/moe.py`) against transformers' own MoE modules with the same
weights: Mixtral, Qwen2-MoE (shared expert + gate), Qwen3-MoE, DeepSeek-V3 (group-limited
sigmoid routing, score-correction bias, shared experts), including batches where some experts get
no tokens, and both checkpoint layouts (per-expert hub tensors, transformers-5 stacked tensors)."""

from __future__ import annotations

import pytest
import torch
from transformers import DeepseekV3Config, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3MoE,
    DeepseekV3TopkRouter,
)
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from ksana_llm.layers.moe_routers import GroupedTopKRouter, Routing, SoftmaxTopKRouter
from ksana_llm.layers.moe import (
    FusedExperts,
    GatedMLP,
    SparseMoeBlock,
)
from ksana_llm.models.llama import LlamaForCausalLM
from ksana_llm.models.weight_loading import load_checkpoint
from tests.deepseek_checkpoint import same_routing

H, I = 32, 16
ATOL = 1e-5


def _randomize(module: torch.nn.Module, seed: int) -> None:
    """Random weights (transformers leaves expert tensors uninitialised); a wide router so the
    softmax is far from uniform and routing differs token to token."""
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in module.named_parameters():
            std = 1.0 if name == "gate.weight" else 0.2
            param.normal_(0, std)
        for name, buf in module.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.normal_(0, 0.3)


def _per_expert(state: dict[str, torch.Tensor], names: tuple[str, str, str]
                ) -> dict[str, torch.Tensor]:
    """transformers-5 stacked expert tensors split into the per-expert tensors of hub checkpoints
    (`names` = the gate, up and down names: w1/w3/w2 or gate_proj/up_proj/down_proj)."""
    out = {}
    for key, value in state.items():
        if key == "experts.gate_up_proj":
            gate, up = value.chunk(2, dim=1)
            for e in range(value.shape[0]):
                out[f"experts.{e}.{names[0]}.weight"] = gate[e].clone()
                out[f"experts.{e}.{names[1]}.weight"] = up[e].clone()
        elif key == "experts.down_proj":
            for e in range(value.shape[0]):
                out[f"experts.{e}.{names[2]}.weight"] = value[e].clone()
        else:
            out[key] = value
    return out


def _load(ours: torch.nn.Module, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    with torch.no_grad():
        load_checkpoint(ours, state.items(), LlamaForCausalLM.fused_parts)
    return ours.eval()


def _softmax_block(config, *, renormalize: bool, num_experts: int, intermediate: int,
                   weights_in_input_dtype: bool = False, shared: int = 0) -> SparseMoeBlock:
    router = SoftmaxTopKRouter(H, num_experts, config.num_experts_per_tok, renormalize=renormalize,
                               weights_in_input_dtype=weights_in_input_dtype)
    experts = FusedExperts(num_experts, H, intermediate, config.hidden_act)
    if not shared:
        return SparseMoeBlock(router, experts)
    return SparseMoeBlock(router, experts, GatedMLP(H, shared, config.hidden_act),
                          torch.nn.Linear(H, 1, bias=False))


def _compare(hf: torch.nn.Module, ours: torch.nn.Module, num_tokens: int, seed: int = 0) -> None:
    torch.manual_seed(seed)
    x = torch.randn(1, num_tokens, H)
    with torch.no_grad():
        expected = hf(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
        actual = ours(x[0])
    torch.testing.assert_close(actual, expected[0], atol=ATOL, rtol=1e-5)


# token counts: one decode token, a few (most experts idle), a prefill chunk
TOKEN_COUNTS = [1, 3, 37]
# transformers' expert paths: the per-expert loop, and the sorted grouped matmul (its default in
# full models), which sums the top-k contributions differently
IMPLS = pytest.mark.parametrize("impl", ["eager", "grouped_mm"])


def _with_impl(config, impl: str):
    config._experts_implementation = impl
    return config


@pytest.mark.parametrize(("act", "layout"), [("silu", "per_expert"), ("gelu", "stacked")])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@IMPLS
def test_mixtral_block_matches_transformers(act, layout, num_tokens, impl):
    config = _with_impl(MixtralConfig(hidden_size=H, intermediate_size=I, num_local_experts=8,
                                      num_experts_per_tok=2, hidden_act=act), impl)
    hf = MixtralSparseMoeBlock(config).eval()
    _randomize(hf, seed=num_tokens)
    state = dict(hf.state_dict())
    if layout == "per_expert":
        state = _per_expert(state, ("w1", "w3", "w2"))
    ours = _load(_softmax_block(config, renormalize=True, num_experts=8, intermediate=I), state)
    _compare(hf, ours, num_tokens)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@IMPLS
def test_qwen2_moe_block_with_gated_shared_expert_matches_transformers(norm_topk_prob, num_tokens,
                                                                       impl):
    config = _with_impl(Qwen2MoeConfig(
        hidden_size=H, moe_intermediate_size=I, shared_expert_intermediate_size=24, num_experts=6,
        num_experts_per_tok=2, norm_topk_prob=norm_topk_prob), impl)
    hf = Qwen2MoeSparseMoeBlock(config).eval()
    _randomize(hf, seed=10 + num_tokens)
    state = _per_expert(dict(hf.state_dict()), ("gate_proj", "up_proj", "down_proj"))
    assert "shared_expert.gate_proj.weight" in state and "shared_expert_gate.weight" in state
    ours = _load(_softmax_block(config, renormalize=norm_topk_prob, num_experts=6, intermediate=I,
                                weights_in_input_dtype=True, shared=24), state)
    _compare(hf, ours, num_tokens)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@IMPLS
def test_qwen3_moe_block_matches_transformers(num_tokens, impl):
    config = _with_impl(Qwen3MoeConfig(hidden_size=H, moe_intermediate_size=I, num_experts=8,
                                       num_experts_per_tok=3, norm_topk_prob=True), impl)
    hf = Qwen3MoeSparseMoeBlock(config).eval()
    _randomize(hf, seed=20 + num_tokens)
    state = _per_expert(dict(hf.state_dict()), ("gate_proj", "up_proj", "down_proj"))
    ours = _load(_softmax_block(config, renormalize=True, num_experts=8, intermediate=I,
                                weights_in_input_dtype=True), state)
    _compare(hf, ours, num_tokens)


def _deepseek_config(**overrides) -> DeepseekV3Config:
    values = {"hidden_size": H, "intermediate_size": 48, "moe_intermediate_size": I,
              "n_routed_experts": 16, "num_experts_per_tok": 4, "n_group": 4, "topk_group": 2,
              "n_shared_experts": 2, "norm_topk_prob": True, "routed_scaling_factor": 2.5}
    return DeepseekV3Config(**{**values, **overrides})


def _grouped_router(config: DeepseekV3Config) -> GroupedTopKRouter:
    return GroupedTopKRouter(H, config.n_routed_experts, config.num_experts_per_tok,
                             n_group=config.n_group, topk_group=config.topk_group,
                             renormalize=config.norm_topk_prob,
                             routed_scaling_factor=config.routed_scaling_factor)


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_deepseek_v3_grouped_router_matches_transformers(norm_topk_prob):
    config = _deepseek_config(norm_topk_prob=norm_topk_prob)
    hf = DeepseekV3TopkRouter(config)
    torch.manual_seed(5)
    with torch.no_grad():
        hf.weight.normal_(0, 1.0)
        hf.e_score_correction_bias.normal_(0, 0.3)
    ours = _grouped_router(config)
    with torch.no_grad():
        ours.weight.copy_(hf.weight)
        ours.e_score_correction_bias.copy_(hf.e_score_correction_bias)
    x = torch.randn(64, H)
    experts, weights, hf_weights = same_routing(hf, ours, x)
    torch.testing.assert_close(weights, hf_weights)
    # the group limit is real: every token's experts lie in at most topk_group groups, and
    # plain top-k over all biased scores would have chosen differently for some tokens
    groups = experts // (config.n_routed_experts // config.n_group)
    assert all(len(set(row)) <= config.topk_group for row in groups.tolist())
    biased = torch.sigmoid(x @ ours.weight.t()) + ours.e_score_correction_bias
    unlimited = biased.topk(config.num_experts_per_tok, dim=-1).indices.sort(dim=-1).values
    assert not torch.equal(unlimited, experts)
    # the correction bias steers selection only: weights are the unbiased sigmoid scores
    scores = torch.sigmoid(x @ ours.weight.t()).gather(1, experts)
    if norm_topk_prob:
        scores = scores / scores.sum(-1, keepdim=True)
    torch.testing.assert_close(weights, scores * 2.5)


@pytest.mark.parametrize("num_tokens", TOKEN_COUNTS)
@IMPLS
def test_deepseek_v3_moe_block_matches_transformers(num_tokens, impl):
    config = _with_impl(_deepseek_config(), impl)
    hf = DeepseekV3MoE(config).eval()
    _randomize(hf, seed=30 + num_tokens)
    state = _per_expert(dict(hf.state_dict()), ("gate_proj", "up_proj", "down_proj"))
    assert "gate.e_score_correction_bias" in state and "shared_experts.gate_proj.weight" in state
    shared = GatedMLP(H, config.moe_intermediate_size * config.n_shared_experts, config.hidden_act)
    ours = SparseMoeBlock(_grouped_router(config), FusedExperts(16, H, I, config.hidden_act),
                          shared, shared_expert_name="shared_experts")
    _compare(hf, _load(ours, state), num_tokens)


def test_grouped_router_stays_float32_when_the_model_is_cast():
    router = _grouped_router(_deepseek_config())
    with torch.device("meta"):
        meta_router = _grouped_router(_deepseek_config())
    for module in (router.to(torch.bfloat16), meta_router.to(torch.bfloat16).to_empty(device="cpu")):
        assert module.weight.dtype == torch.float32
        assert module.e_score_correction_bias.dtype == torch.float32
    x = torch.randn(5, H, dtype=torch.bfloat16)
    torch.nn.init.normal_(router.weight)
    assert router(x).weights.dtype == torch.float32


def test_fused_experts_match_a_per_token_loop_when_most_experts_are_idle():
    """Ragged routing by hand: expert 5 takes most tokens, experts 1, 2, 4, 6 none at all."""
    torch.manual_seed(7)
    experts = FusedExperts(8, H, I, "silu")
    with torch.no_grad():
        experts.w13.normal_(0, 0.2)
        experts.w2.normal_(0, 0.2)
    x = torch.randn(9, H)
    chosen = torch.tensor([[5, 0], [5, 3], [0, 5], [5, 7], [3, 5], [5, 0], [7, 5], [5, 3], [0, 7]])
    weights = torch.rand(9, 2)
    out = experts(x, Routing(weights, chosen))
    expected = torch.zeros_like(x)
    for t in range(9):
        for k in range(2):
            e = int(chosen[t, k])
            gate, up = (experts.w13[e] @ x[t]).chunk(2)
            expected[t] += weights[t, k] * (experts.w2[e] @ (torch.nn.functional.silu(gate) * up))
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert torch.bincount(chosen.reshape(-1), minlength=8).eq(0).sum() == 4


def test_softmax_router_renormalises_only_when_asked():
    torch.manual_seed(8)
    x = torch.randn(6, H)
    plain = SoftmaxTopKRouter(H, 8, 2, renormalize=False)
    torch.nn.init.normal_(plain.weight)
    renorm = SoftmaxTopKRouter(H, 8, 2, renormalize=True)
    renorm.weight.data.copy_(plain.weight)
    a, b = plain(x), renorm(x)
    assert torch.equal(a.experts, b.experts)
    probs = torch.softmax(x @ plain.weight.t(), dim=-1)
    torch.testing.assert_close(a.weights, probs.gather(1, a.experts))
    torch.testing.assert_close(b.weights.sum(-1), torch.ones(6))


def test_expert_loading_rejects_bad_tensors_and_reports_missing_experts():
    block = SparseMoeBlock(SoftmaxTopKRouter(H, 4, 2, renormalize=True), FusedExperts(4, H, I))
    with pytest.raises(ValueError, match="shape"):
        block.experts.load_checkpoint_tensor("1.w1.weight", torch.zeros(I + 1, H))
    with pytest.raises(ValueError, match="only 4 experts"):
        block.experts.load_checkpoint_tensor("4.w2.weight", torch.zeros(H, I))
    with pytest.raises(ValueError, match="unexpected expert tensor"):
        block.experts.load_checkpoint_tensor("1.w4.weight", torch.zeros(I, H))
    state = {"gate.weight": torch.zeros(4, H)}
    for e in range(4):
        for name, shape in (("w1", (I, H)), ("w3", (I, H)), ("w2", (H, I))):
            if (e, name) != (2, "w3"):  # expert 2's up projection is missing
                state[f"experts.{e}.{name}.weight"] = torch.zeros(shape)
    with pytest.raises(ValueError, match=r"missing 1 tensors.*experts\.2\.up"):
        load_checkpoint(block, state.items(), LlamaForCausalLM.fused_parts)


def test_invalid_router_settings_name_the_field():
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        SoftmaxTopKRouter(H, 4, 5, renormalize=True)
    with pytest.raises(ValueError, match="n_group"):
        GroupedTopKRouter(H, 16, 4, n_group=3, topk_group=1, renormalize=True)
    with pytest.raises(ValueError, match="topk_group"):
        GroupedTopKRouter(H, 16, 4, n_group=4, topk_group=5, renormalize=True)
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        GroupedTopKRouter(H, 16, 9, n_group=4, topk_group=2, renormalize=True)
