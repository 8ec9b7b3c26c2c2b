"""Mixtral, Qwen2-MoE and Qwen3-MoE end to end against transformers (fp32): tiny random models
saved as safetensors and as pytorch_model.bin, in the per-expert layout of hub checkpoints,
loaded by our engine; logits at prefill (whole and chunked) and 16 decode steps, a prefix-cache
hit in a mixed batch, and 32 greedy tokens through the Engine (tests/family_harness.py). The
stacked expert layout transformers 5 keeps in memory loads to the same weights."""

from __future__ import annotations

import functools
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    MixtralConfig,
    MixtralForCausalLM,
    Qwen2MoeConfig,
    Qwen2MoeForCausalLM,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from ksana_llm.layers.moe import FusedExperts, SparseMoeBlock
from ksana_llm.models.llama import LlamaMLP
from tests.family_harness import (
    PagedDriver,
    Reference,
    check_family,
    check_prefill_and_decode,
    check_triton_backend,
    greedy_trace,
    hf_reference,
    load_ours,
)

VOCAB = 256
COMMON = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
          "num_key_value_heads": 2, "vocab_size": VOCAB, "max_position_embeddings": 512,
          "rms_norm_eps": 1e-5, "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
          "tie_word_embeddings": False}


def _mixtral() -> torch.nn.Module:
    return MixtralForCausalLM(MixtralConfig(**COMMON, intermediate_size=48, num_local_experts=8,
                                            num_experts_per_tok=2))


def _qwen2_moe() -> torch.nn.Module:
    # layer 1 is dense (mlp_only_layers); layer 0 has 6 experts, a gated shared expert, and
    # unnormalised top-2 weights; q/k/v carry biases
    return Qwen2MoeForCausalLM(Qwen2MoeConfig(
        **COMMON, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
        num_experts=6, num_experts_per_tok=2, norm_topk_prob=False, mlp_only_layers=[1],
        qkv_bias=True))


def _qwen3_moe() -> torch.nn.Module:
    # head_dim 32 != hidden / heads, q/k RMSNorm, renormalised top-2 of 8 experts
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=True))


FAMILIES: dict[str, Callable[[], torch.nn.Module]] = {
    "mixtral": _mixtral, "qwen2_moe": _qwen2_moe, "qwen3_moe": _qwen3_moe}


def _randomize(model: torch.nn.Module) -> None:
    """Default init (std 0.02) leaves experts too small to move the logits much, the router near
    uniform, and the attention biases dominating the tokens' hidden states (every token then
    picks the same experts); widen embeddings, router and experts so a routing or combine error
    shows, and give biases values."""
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0, 0.1)
            elif name.endswith("mlp.gate.weight"):
                param.normal_(0, 0.3)
            elif ".mlp." in name and not name.endswith("layernorm.weight"):
                param.normal_(0, 0.1)
            elif name.endswith("embed_tokens.weight"):  # token-specific hidden states
                param.normal_(0, 0.5)
            elif name.endswith("norm.weight"):
                param.uniform_(0.8, 1.2)


@dataclass
class Family:
    name: str
    hf: torch.nn.Module
    folders: dict[str, Path]
    reference: Reference


def _save_formats(hf: torch.nn.Module, root: Path) -> dict[str, Path]:
    """safetensors as transformers writes it (per-expert hub names), the same tensors as a lone
    pytorch_model.bin (transformers 5 writes no .bin itself), and the stacked layout
    transformers 5 holds in memory (its state_dict) as safetensors."""
    hf.save_pretrained(root / "safetensors")
    folders = {"safetensors": root / "safetensors"}
    for fmt in ("bin", "stacked"):
        folder = root / fmt
        shutil.copytree(folders["safetensors"], folder, ignore=shutil.ignore_patterns("*.safetensors"))
        folders[fmt] = folder
    state = load_file(folders["safetensors"] / "model.safetensors")
    torch.save(state, folders["bin"] / "pytorch_model.bin")
    save_file({k: v.contiguous() for k, v in hf.state_dict().items()},
              folders["stacked"] / "model.safetensors")
    return folders


def _memoized(reference: Reference) -> Reference:
    """Both formats replay the same traces; compute each reference forward once."""
    cached = functools.lru_cache(maxsize=None)(lambda ids: reference(list(ids)))
    return lambda ids: cached(tuple(ids))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory) -> Family:
    torch.manual_seed(0)
    hf = FAMILIES[request.param]().eval()
    # transformers' per-expert loop: on CPU its default grouped_mm path is ~10x slower, and
    # tests/test_moe.py compares our MoE block with both paths
    hf.set_experts_implementation("eager")
    _randomize(hf)
    folders = _save_formats(hf, tmp_path_factory.mktemp(request.param))
    return Family(request.param, hf, folders, _memoized(hf_reference(hf)))


def test_checkpoints_use_the_hub_per_expert_layout(family):
    """What we load first is what hub checkpoints hold: one tensor per expert, no stacked ones,
    and the .bin folder holds only the .bin."""
    names = list(load_file(family.folders["safetensors"] / "model.safetensors"))
    expert = "block_sparse_moe.experts.7.w3.weight" if family.name == "mixtral" \
        else "mlp.experts.5.up_proj.weight"
    assert any(name.endswith(expert) for name in names)
    assert not any(name.endswith(("gate_up_proj", "experts.down_proj")) for name in names)
    assert sorted(p.name for p in family.folders["bin"].glob("*.bin")) == ["pytorch_model.bin"]
    assert not list(family.folders["bin"].glob("*.safetensors"))
    stacked = list(load_file(family.folders["stacked"] / "model.safetensors"))
    assert any(name.endswith("mlp.experts.gate_up_proj") for name in stacked)


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_family_matches_transformers(family, fmt):
    ours = load_ours(family.folders[fmt])
    check_family(ours, family.folders[fmt], family.reference, vocab=VOCAB)


def test_triton_backend_matches_transformers(family):
    """The Triton path, attention kernels and the grouped expert matmuls (kernels/fused_moe.py,
    no host sync): transformers' logits over a chunked prefill and 16 decode steps, and its
    greedy tokens through the Engine (chunked prefill, prefix-cache hit)."""
    ours = load_ours(family.folders["safetensors"])
    check_triton_backend(ours, family.folders["safetensors"], family.reference, vocab=VOCAB)
    experts = [m for m in ours.modules() if isinstance(m, FusedExperts)]
    assert experts and not any(e.syncs_with_host(True) for e in experts)


def test_stacked_layout_loads_the_same_weights(family):
    per_expert = load_ours(family.folders["safetensors"]).state_dict()
    stacked = load_ours(family.folders["stacked"]).state_dict()
    assert per_expert.keys() == stacked.keys()
    for key in per_expert:
        assert torch.equal(per_expert[key], stacked[key]), key


def test_layers_are_built_as_the_config_says(family):
    ours = load_ours(family.folders["safetensors"])
    mlps = [layer.mlp for layer in ours.model.layers]
    if family.name == "qwen2_moe":
        assert isinstance(mlps[0], SparseMoeBlock) and isinstance(mlps[1], LlamaMLP)
        assert mlps[0].shared_expert is not None and mlps[0].shared_expert_gate is not None
    else:
        assert all(isinstance(mlp, SparseMoeBlock) for mlp in mlps)


def test_routing_is_not_degenerate(family):
    """The reference itself spreads tokens over the experts: most experts see tokens, and
    tokens differ in their choice (otherwise the parity checks would prove little)."""
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (1, 40))
    with torch.no_grad():
        out = family.hf(ids, output_router_logits=True)
    for logits in out.router_logits:
        chosen = logits.topk(2, dim=-1).indices
        used = chosen.unique().numel()
        assert used >= logits.shape[-1] - 1, f"only {used} experts used"
        assert len({tuple(sorted(row)) for row in chosen.tolist()}) >= 6


def test_bfloat16_tracks_float32(family):
    """Served in bf16 (experts, routers and all), logits stay near the fp32 reference."""
    ours = load_ours(family.folders["safetensors"], dtype="bfloat16")
    assert {p.dtype for p in ours.parameters()} == {torch.bfloat16}
    torch.manual_seed(3)
    prompt = torch.randint(3, VOCAB, (20,)).tolist()
    ids, ref = greedy_trace(family.reference, prompt, 4)
    driver = PagedDriver(ours, dtype=torch.bfloat16)
    seq = driver.new_seq(prompt)
    logits = driver.step([(seq, len(prompt))])
    torch.testing.assert_close(logits[0], ref[len(prompt) - 1], atol=0.02, rtol=0.02)
    for i in range(4):
        seq.output_token_ids.append(ids[len(prompt) + i])
        logits = driver.step([(seq, 1)])
        torch.testing.assert_close(logits[0], ref[len(prompt) + i], atol=0.02, rtol=0.02)


def test_qwen3_moe_window_applies_to_every_layer(tmp_path):
    """transformers' Qwen3-MoE windows every layer once `use_sliding_window` is on, whatever
    `max_window_layers` says; released configs set that to the layer count, which the dense
    Qwen rule reads as "no windowed layer". A 40-token prompt over a 16-token window."""
    torch.manual_seed(0)
    hf = Qwen3MoeForCausalLM(Qwen3MoeConfig(
        **COMMON, head_dim=32, intermediate_size=96, moe_intermediate_size=32, num_experts=8,
        num_experts_per_tok=2, use_sliding_window=True, sliding_window=16,
        max_window_layers=COMMON["num_hidden_layers"])).eval()
    hf.set_experts_implementation("eager")
    _randomize(hf)
    hf.save_pretrained(tmp_path)
    ours = load_ours(tmp_path)
    assert ours.sliding_window == 16
    check_prefill_and_decode(ours, hf_reference(hf), vocab=VOCAB, chunks=[16, 24])
