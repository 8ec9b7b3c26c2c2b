"""DeepSeek-V3 / R1 end to end against transformers (fp32).

A tiny random `DeepseekV3ForCausalLM` (MLA with a low-rank query and interleaved YaRN RoPE, one
dense layer then two MoE layers with group-limited routing and a shared expert) saved as
safetensors (as transformers writes it: per-expert hub names) and as pytorch_model.bin, loaded by
our engine: logits at prefill (whole and chunked) and at 16 decode steps, a prefix-cache hit in a
mixed batch, and 32 greedy tokens through the Engine (tests/family_harness.py).

Multi-token prediction: hub checkpoints add `model.layers.{num_hidden_layers}.*`; a checkpoint
with those tensors loads them into `mtp` (checked value by value through the layer's forward
against transformers' `MtpLayer`); one without them loads with `mtp = None`.
"""

from __future__ import annotations

import functools
import json
import shutil
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3ForCausalLM
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3RotaryEmbedding

from ksana_llm.layers.attention import KVCacheSpec
from ksana_llm.layers.mla import MultiLatentAttention
from ksana_llm.layers.moe import FusedExperts, SparseMoeBlock
from ksana_llm.layers.moe_routers import GroupedTopKRouter
from ksana_llm.models.deepseek_v3 import DeepseekV3MtpLayer
from ksana_llm.models.llama import LlamaMLP
from ksana_llm.runner.model_runner import ModelRunner, SeqSlice
from tests.deepseek_checkpoint import (
    NUM_LAYERS,
    VOCAB,
    deepseek_config,
    hf_mtp_layer,
    mtp_checkpoint_tensors,
    randomize,
)
from tests.family_harness import (Reference, check_family, check_triton_backend, hf_reference,
                                  load_ours, write_bin_twin)



def _memoized(reference: Reference) -> Reference:
    """Both formats replay the same traces; compute each reference forward once."""
    cached = functools.lru_cache(maxsize=None)(lambda ids: reference(list(ids)))
    return lambda ids: cached(tuple(ids))


@dataclass
class Family:
    hf: DeepseekV3ForCausalLM
    folders: dict[str, Path]
    reference: Reference


@pytest.fixture(scope="module")
def family(tmp_path_factory) -> Family:
    torch.manual_seed(0)
    # num_nextn_predict_layers: 1, as by default
    hf = DeepseekV3ForCausalLM(deepseek_config()).eval()
    randomize(hf)
    root = tmp_path_factory.mktemp("deepseek_v3")
    hf.save_pretrained(root / "safetensors")
    folders = {"safetensors": root / "safetensors"}
    folders["bin"] = write_bin_twin(folders["safetensors"], root / "bin")
    return Family(hf, folders, _memoized(hf_reference(hf)))


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_family_matches_transformers(family, fmt):
    ours = load_ours(family.folders[fmt])
    check_family(ours, family.folders[fmt], family.reference, vocab=VOCAB)


def test_triton_backend_matches_transformers(family):
    """MLA on the Triton attention kernels (the latent as the one KV "head", values a view of
    it; decode heads in blocks) with grouped MoE experts: transformers' logits over a chunked
    prefill and decode, and its greedy tokens through the Engine."""
    ours = load_ours(family.folders["safetensors"])
    check_triton_backend(ours, family.folders["safetensors"], family.reference, vocab=VOCAB)
    experts = [m for m in ours.modules() if isinstance(m, FusedExperts)]
    assert experts and not any(e.syncs_with_host(True) for e in experts)


def test_checkpoint_and_model_layout(family):
    """Hub layout on disk (per-expert tensors, no MTP tensors from transformers), and our model
    built as the config says: MLA everywhere with a one-latent cache, layer 0 dense, the rest MoE
    with group-limited routing and a shared expert."""
    names = list(load_file(family.folders["safetensors"] / "model.safetensors"))
    assert "model.layers.2.mlp.experts.7.up_proj.weight" in names
    assert not any(name.startswith(f"model.layers.{NUM_LAYERS}.") for name in names)
    assert sorted(p.name for p in family.folders["bin"].iterdir() if p.suffix in (".bin", ".safetensors")) \
        == ["pytorch_model.bin"]
    ours = load_ours(family.folders["safetensors"])
    assert ours.kv_cache_spec == KVCacheSpec(1, 32 + 8, v_head_dim=0)
    assert all(isinstance(layer.self_attn, MultiLatentAttention) for layer in ours.model.layers)
    mlps = [layer.mlp for layer in ours.model.layers]
    assert isinstance(mlps[0], LlamaMLP)
    for mlp in mlps[1:]:
        assert isinstance(mlp, SparseMoeBlock) and isinstance(mlp.gate, GroupedTopKRouter)
        assert mlp.shared_experts is not None
    # the selection bias landed (it only steers routing, so a dropped one could hide)
    torch.testing.assert_close(mlps[1].gate.e_score_correction_bias,
                               family.hf.model.layers[1].mlp.gate.e_score_correction_bias)
    assert ours.mtp is None  # config says 1 MTP layer; transformers saved none


def test_routing_is_not_degenerate(family):
    """In the reference itself, tokens spread over most experts and both groups, and the
    selection bias changes some tokens' choice: the parity checks exercise real routing."""
    torch.manual_seed(4)
    ids = torch.randint(3, VOCAB, (1, 40))
    with torch.no_grad():
        out = family.hf(ids, output_router_logits=True)
    for layer, logits in zip(family.hf.model.layers[1:], out.router_logits):
        gate = layer.mlp.gate
        scores = logits.sigmoid()
        biased = scores + gate.e_score_correction_bias
        groups = biased.view(-1, 2, 4).topk(2, dim=-1).values.sum(-1).argmax(-1)
        assert set(groups.tolist()) == {0, 1}, "group-limited routing always picks one group"
        eligible = biased.view(-1, 2, 4).clone()
        eligible[torch.arange(len(groups)), 1 - groups] = float("-inf")
        picked = eligible.view(-1, 8).topk(2, dim=-1).indices
        assert picked.unique().numel() >= 6
        unbiased = scores.view(-1, 2, 4).masked_fill(eligible == float("-inf"), float("-inf"))
        assert (unbiased.view(-1, 8).topk(2, dim=-1).indices.sort().values
                != picked.sort().values).any(), "e_score_correction_bias never changes a choice"


# ---- multi-token prediction ------------------------------------------------------------------

def _folder_with(family: Family, root: Path, extra: dict[str, torch.Tensor],
                 drop: tuple[str, ...] = (), **config_changes) -> Path:
    folder = root
    shutil.copytree(family.folders["safetensors"], folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.update(extra)
    save_file({k: v for k, v in tensors.items() if not (drop and k.endswith(drop))},
              folder / "model.safetensors")
    if config_changes:
        config = json.loads((folder / "config.json").read_text())
        config.update(config_changes)
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_mtp_weights_load_and_match_transformers_mtp_layer(family, tmp_path):
    config = family.hf.config
    hf_layer = hf_mtp_layer(config)
    embed, head = torch.randn(VOCAB, 64), torch.randn(VOCAB, 64) * 0.1
    extra = mtp_checkpoint_tensors(hf_layer, embed, head)
    ours = load_ours(_folder_with(family, tmp_path / "mtp", extra))
    assert ours.mtp is not None and len(ours.mtp.layers) == 1
    mtp = ours.mtp.layers[0]
    assert isinstance(mtp, DeepseekV3MtpLayer) and isinstance(mtp.mlp, SparseMoeBlock)
    assert torch.equal(mtp.embed_tokens.weight, embed)
    assert torch.equal(mtp.shared_head.head.weight, head)
    assert torch.equal(mtp.eh_proj.weight, hf_layer.eh_proj.weight)
    assert torch.equal(mtp.mlp.experts.w2, hf_layer.mtp_block.mlp.experts.down_proj)
    # the main model is untouched by the extra layer
    torch.testing.assert_close(ours.model.layers[2].mlp.experts.w13,
                               family.hf.model.layers[2].mlp.experts.gate_up_proj)

    # Every other tensor, through the layer's forward: 12 tokens, the previous depth's hidden
    # states given, through the paged cache.
    torch.manual_seed(6)
    n = 12
    ids, previous = torch.randint(3, VOCAB, (n,)), torch.randn(n, 64)
    runner = ModelRunner(ours, device=torch.device("cpu"), dtype=torch.float32, num_blocks=8,
                         block_size=4, attention_backend="torch")
    _, positions, meta, _, _ = runner.build([SeqSlice(ids.tolist(), 0, [0, 1, 2], True)])
    cache = (torch.zeros(8, 4, 1, 40), torch.zeros(8, 4, 1, 0))
    with torch.no_grad():
        rope = ours.model.rotary_emb.cos_sin(positions, torch.float32)
        hidden = mtp(rope, ids, previous, cache, meta)
        logits = mtp.shared_head.head(hidden)
        cos_sin = DeepseekV3RotaryEmbedding(config)(previous[None], positions[None])
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        expected = hf_layer(torch.nn.functional.embedding(ids, embed)[None], previous[None],
                            position_embeddings=cos_sin, attention_mask=mask,
                            position_ids=positions[None], cache=None)[0]
    torch.testing.assert_close(hidden, expected, atol=1e-5, rtol=1e-4)
    torch.testing.assert_close(logits, expected @ head.T, atol=1e-5, rtol=1e-4)


def test_partial_mtp_weights_fail_loudly(family, tmp_path):
    extra = mtp_checkpoint_tensors(hf_mtp_layer(family.hf.config), torch.randn(VOCAB, 64),
                                    torch.randn(VOCAB, 64))
    folder = _folder_with(family, tmp_path / "partial", extra, drop=("eh_proj.weight",))
    with pytest.raises(ValueError, match=r"missing .*mtp\.layers\.0\.eh_proj\.weight"):
        load_ours(folder)


def test_no_mtp_layers_configured(family, tmp_path):
    """num_nextn_predict_layers 0: a checkpoint without MTP tensors loads with no mtp module;
    one that has them does not silently drop a layer."""
    folder = _folder_with(family, tmp_path / "none", {}, num_nextn_predict_layers=0)
    ours = load_ours(folder)
    assert ours.mtp is None and not any(n.startswith("mtp.") for n, _ in ours.named_parameters())
    extra = mtp_checkpoint_tensors(hf_mtp_layer(family.hf.config), torch.randn(VOCAB, 64),
                                    torch.randn(VOCAB, 64))
    folder = _folder_with(family, tmp_path / "unexpected", extra, num_nextn_predict_layers=0)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        load_ours(folder)


def test_unsupported_routing_names_the_field():
    from ksana_llm.models.deepseek_v3 import DeepseekV3ForCausalLM as Ours

    config = deepseek_config()
    config.topk_method = "group_limited_greedy"  # DeepSeek-V2's routing
    with pytest.raises(ValueError, match="topk_method"):
        Ours(config)
