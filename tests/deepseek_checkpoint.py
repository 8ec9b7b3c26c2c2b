"""A tiny random DeepSeek-V3 (transformers' classes) and its MTP layer as hub checkpoints store
it: shared by the DeepSeek family tests and the speculative decoding tests and benchmark; and
the comparison of a router of ours with transformers' (DeepSeek V2 and V3)."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config
from transformers.modeling_layers import MtpLayer
from transformers.models.deepseek_v3.modeling_deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3RMSNorm,
    DeepseekV3RotaryEmbedding,
)

VOCAB = 256
NUM_LAYERS = 3


def deepseek_config(**overrides) -> DeepseekV3Config:
    return DeepseekV3Config(**{
        "hidden_size": 64, "intermediate_size": 96, "moe_intermediate_size": 32,
        "num_hidden_layers": NUM_LAYERS, "first_k_dense_replace": 1, "num_attention_heads": 4,
        "num_key_value_heads": 4, "n_routed_experts": 8, "n_group": 2, "topk_group": 1,
        "num_experts_per_tok": 2, "n_shared_experts": 1, "routed_scaling_factor": 2.5,
        "norm_topk_prob": True, "kv_lora_rank": 32, "q_lora_rank": 48, "qk_rope_head_dim": 8,
        "qk_nope_head_dim": 16, "v_head_dim": 16, "vocab_size": VOCAB,
        "max_position_embeddings": 256, "rope_interleave": True,
        # DeepSeek-V3's own YaRN settings, with the original length short enough that the test
        # prompts run past it.
        "rope_parameters": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                            "original_max_position_embeddings": 32, "mscale": 1.0,
                            "mscale_all_dim": 1.0, "beta_fast": 32, "beta_slow": 1},
        "rms_norm_eps": 1e-6, "bos_token_id": 0, "eos_token_id": 1, "tie_word_embeddings": False,
        **overrides})


def same_routing(hf_router: torch.nn.Module, router: torch.nn.Module, x: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Both routers on `x`, which must pick the same experts for every token (both pick with
    sorted=False: compared per token after sorting by expert id). Returns (experts, our
    weights, transformers' weights), each row ordered by expert id."""
    with torch.no_grad():
        _, hf_weights, hf_experts = hf_router(x)
        routing = router(x)
    hf_experts, hf_order = hf_experts.sort(dim=-1)
    experts, order = routing.experts.sort(dim=-1)
    assert torch.equal(experts, hf_experts)
    return experts, routing.weights.gather(1, order), hf_weights.gather(1, hf_order)


def randomize(model: torch.nn.Module, seed: int = 0) -> None:
    """Default init (std 0.02) leaves experts too small to matter and the router near uniform;
    widen both, give the selection bias visible values, and move norms off 1."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.3)
            elif name.endswith("mlp.gate.weight"):
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.5)
            elif ".mlp." in name or "eh_proj" in name:
                tensor.copy_(torch.randn(tensor.shape, generator=gen) * 0.1)
            elif name.endswith("norm.weight"):
                tensor.copy_(torch.rand(tensor.shape, generator=gen) * 0.4 + 0.8)


def hf_mtp_layer(config: DeepseekV3Config) -> MtpLayer:
    """transformers' MTP depth (always MoE), random and widened like the main model."""
    torch.manual_seed(5)
    layer = MtpLayer(config.get_mtp_config(), DeepseekV3DecoderLayer, DeepseekV3RMSNorm, 0).eval()
    randomize(layer, seed=5)
    return layer


def mtp_checkpoint_tensors(layer: MtpLayer, embed: torch.Tensor, head: torch.Tensor,
                           num_layers: int = NUM_LAYERS) -> dict[str, torch.Tensor]:
    """The layer as hub checkpoints store it: `model.layers.{N}.*`, experts one by one,
    `post_norm` as `shared_head.norm`, plus the depth's own embedding and head."""
    prefix = f"model.layers.{num_layers}."
    tensors = {prefix + "embed_tokens.weight": embed, prefix + "shared_head.head.weight": head}
    for name, tensor in [*layer.state_dict().items()]:
        name = name.removeprefix("mtp_block.").replace("post_norm.", "shared_head.norm.")
        if name.endswith("experts.gate_up_proj"):
            gate, up = tensor.chunk(2, dim=1)
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{name[:-len('gate_up_proj')]}{e}.gate_proj.weight"] = gate[e]
                tensors[f"{prefix}{name[:-len('gate_up_proj')]}{e}.up_proj.weight"] = up[e]
        elif name.endswith("experts.down_proj"):
            for e in range(tensor.shape[0]):
                tensors[f"{prefix}{name[:-len('down_proj')]}{e}.down_proj.weight"] = tensor[e]
        else:
            tensors[prefix + name] = tensor
    return {k: v.contiguous().clone() for k, v in tensors.items()}


# ---- drafting with the MTP layer, as transformers computes it ----------------------------------

def _mtp_rows(hf: torch.nn.Module, layer: MtpLayer, embed: torch.Tensor, previous: torch.Tensor,
              next_ids: list[int]) -> torch.Tensor:
    """The MTP layer's hidden states (after its final norm) for rows 0..n-1: row p reads
    `previous[p]` and the MTP embedding `embed` of `next_ids[p]`, attending causally (no
    cache)."""
    n = len(next_ids)
    positions = torch.arange(n)[None]
    embeds = torch.nn.functional.embedding(torch.tensor(next_ids), embed)[None]
    mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
    cos_sin = DeepseekV3RotaryEmbedding(hf.config)(previous[None], positions)
    return layer(embeds, previous[None], position_embeddings=cos_sin, attention_mask=mask,
                 position_ids=positions, cache=None)[0]


def hf_drafts(hf: torch.nn.Module, layer: MtpLayer, embed: torch.Tensor, head: torch.Tensor,
              ids: list[int], num_drafts: int) -> list[int]:
    """The drafts after `ids`: the MTP layer over rows 0..n-2 (main model hidden state at p, token
    p + 1), its last row's argmax, then each further draft one row on, reading the previous
    row's MTP hidden state and draft (one MTP layer reused, as the engine chains it)."""
    with torch.no_grad():
        hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
        previous, next_ids = hidden[:len(ids) - 1], list(ids[1:])
        drafts = []
        for _ in range(num_drafts):
            rows = _mtp_rows(hf, layer, embed, previous, next_ids)
            drafts.append(int((rows[-1] @ head.T).argmax()))
            previous = torch.cat((previous, rows[-1:]))
            next_ids.append(drafts[-1])
    return drafts


def fit_draft_head(hf: torch.nn.Module, layer: MtpLayer, embed: torch.Tensor,
                   sequences: list[list[int]], steps: int = 300) -> torch.Tensor:
    """A head for the (random) MTP layer fitted to predict token p + 2 of `sequences` (the main
    model's own greedy continuations): a stand-in for trained MTP weights, so drafts are
    accepted often enough to exercise (and measure) acceptance. Returns [vocab, hidden]."""
    features, targets = [], []
    with torch.no_grad():
        for ids in sequences:
            hidden = hf(torch.tensor([ids]), output_hidden_states=True).hidden_states[-1][0]
            features.append(_mtp_rows(hf, layer, embed, hidden[:len(ids) - 1], ids[1:])[:-1])
            targets.append(torch.tensor(ids[2:]))
    x, y = torch.cat(features), torch.cat(targets)
    head = torch.zeros(hf.config.vocab_size, x.shape[1], requires_grad=True)
    optimizer = torch.optim.Adam([head], lr=0.05)
    for _ in range(steps):
        optimizer.zero_grad()
        torch.nn.functional.cross_entropy(x @ head.T, y).backward()
        optimizer.step()
    return head.detach().clone()


def greedy_continuations(hf: torch.nn.Module, prompts: list[list[int]], num_tokens: int
                         ) -> list[list[int]]:
    """transformers' greedy `generate`, EOS ignored: the new tokens of each prompt."""
    out = []
    device = next(hf.parameters()).device
    for prompt in prompts:
        ids = hf.generate(torch.tensor([prompt], device=device), max_new_tokens=num_tokens,
                          do_sample=False,
                          min_new_tokens=num_tokens, eos_token_id=None)
        out.append(ids[0, len(prompt):].tolist())
    return out


def mtp_embedding(hf: torch.nn.Module, seed: int = 7) -> torch.Tensor:
    """The MTP depth's own embedding: the main model's, perturbed (hub checkpoints store a copy;
    a different one shows which of the two the drafts read)."""
    noise = torch.randn(hf.model.embed_tokens.weight.shape,
                        generator=torch.Generator().manual_seed(seed))
    return hf.model.embed_tokens.weight.detach() + noise * hf.config.initializer_range


def save_with_mtp(hf: torch.nn.Module, layer: MtpLayer, embed: torch.Tensor, head: torch.Tensor,
                  folder: Path) -> Path:
    """`hf` saved by transformers, plus the MTP layer as `model.layers.{N}.*` with `embed` and
    `head` as the depth's own embedding and head."""
    hf.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    tensors.update(mtp_checkpoint_tensors(layer, embed, head, hf.config.num_hidden_layers))
    save_file(tensors, folder / "model.safetensors")
    return folder
