"""Baichuan 1 / 2 (remote code, no transformers class) vs a reference on the same weights (fp32),
through the paged KV cache, chunked prefill, a prefix-cache hit and the real Engine
(tests/family_harness.py).

Checkpoints are written in Baichuan's own tensor names (`self_attn.W_pack` = fused q/k/v) and
config keys, as safetensors and as pytorch_model.bin, and load through the shipped
`baichuan_weight_map.json`. References:
- 7B (RoPE): transformers' LlamaForCausalLM with the same weights (W_pack split into q/k/v);
- 13B (ALiBi): an explicit torch forward, `baichuan_reference`, whose attention is
  tests/test_alibi.py's reference (checked there against SDPA with an explicit bias) and whose
  every other part is checked here against transformers' Llama with RoPE in its place;
- Baichuan2: the same, with the LM-head rows divided by their norms (`NormHead`).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from ksana_llm.models.baichuan import BaichuanForCausalLM, _baichuan_view, alibi_slopes
from tests.family_harness import (check_family, check_other_format, write_checkpoint,
                                  hf_reference, load_ours)
from tests.test_alibi import alibi_attention_reference

VOCAB, HIDDEN, HEADS, LAYERS, EPS = 256, 64, 4, 2, 1e-6

# name -> (architectures, position embedding, normalized LM head)
VARIANTS = {
    "baichuan-7b": ("BaiChuanForCausalLM", "rope", False),
    "baichuan2-7b": ("BaichuanForCausalLM", "rope", True),
    "baichuan-13b": ("BaichuanForCausalLM", "alibi", False),
    "baichuan2-13b": ("BaichuanForCausalLM", "alibi", True),
}


def llama_twin(seed: int = 0) -> LlamaForCausalLM:
    """transformers' Llama shaped like a tiny Baichuan: no GQA, no biases, untied head. Its
    random weights are the checkpoint's; with RoPE it is also the 7B reference."""
    torch.manual_seed(seed)
    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=LAYERS,
                         num_attention_heads=HEADS, num_key_value_heads=HEADS, vocab_size=VOCAB,
                         max_position_embeddings=512, rms_norm_eps=EPS, tie_word_embeddings=False,
                         bos_token_id=1, eos_token_id=2)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # norm weights off 1, so a skipped norm would show
        for name, param in model.named_parameters():
            if "norm" in name:
                param.normal_(1, 0.1)
    return model


def baichuan_tensors(llama: LlamaForCausalLM, *, rotary_buffers: bool) -> dict[str, torch.Tensor]:
    """The Llama's weights under Baichuan's names: q/k/v stacked into W_pack."""
    sd = llama.state_dict()
    out = {}
    for name, tensor in sd.items():
        if ".self_attn.k_proj." in name or ".self_attn.v_proj." in name:
            continue
        if ".self_attn.q_proj." in name:
            prefix = name.split(".self_attn.")[0]
            out[f"{prefix}.self_attn.W_pack.weight"] = torch.cat(
                [sd[f"{prefix}.self_attn.{p}_proj.weight"] for p in "qkv"])
            if rotary_buffers:  # Baichuan-7B's .bin files carry the RoPE table's frequencies
                out[f"{prefix}.self_attn.rotary_emb.inv_freq"] = torch.rand(HIDDEN // HEADS // 2)
            continue
        out[name] = tensor
    return {name: t.clone().contiguous() for name, t in out.items()}


def baichuan_config(architecture: str, position: str, normalized: bool) -> dict:
    """config.json as Baichuan's remote code writes it, plus our two explicit keys (the real
    checkpoints leave both to be inferred from hidden_size and vocab_size)."""
    config = {"architectures": [architecture], "model_type": "baichuan",
              "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                           "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
              "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "hidden_act": "silu",
              "hidden_size": HIDDEN, "initializer_range": 0.02, "intermediate_size": 128,
              "num_attention_heads": HEADS, "num_hidden_layers": LAYERS, "rms_norm_eps": EPS,
              "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
              "vocab_size": VOCAB, "position_embedding": position,
              "normalize_lm_head": normalized}
    if position == "rope":
        config["max_position_embeddings"] = 512
    else:
        config["model_max_length"] = 512  # the 13B configs name their context this way
    return config


def _rms_norm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + EPS))


def _rope(x: torch.Tensor, theta: float = 10000.0) -> torch.Tensor:
    """Rotate-half RoPE at positions 0..L-1; x: [L, H, D]."""
    length, _, dim = x.shape
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2).float() / dim)
    angles = torch.outer(torch.arange(length).float(), inv_freq).repeat(1, 2)[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * angles.cos() + torch.cat([-x2, x1], dim=-1) * angles.sin()


def baichuan_reference(tensors: dict[str, torch.Tensor], position: str, normalized: bool):
    """Baichuan's forward written out from its checkpoint tensors: ids -> logits [L, vocab]."""
    head_dim = HIDDEN // HEADS
    slopes = alibi_slopes(HEADS) if position == "alibi" else torch.zeros(HEADS)
    lm_head = tensors["lm_head.weight"]
    if normalized:
        lm_head = F.normalize(lm_head, dim=-1)

    def logits(ids: list[int]) -> torch.Tensor:
        h = tensors["model.embed_tokens.weight"][torch.tensor(ids)]
        length = h.shape[0]
        for i in range(LAYERS):
            p = f"model.layers.{i}."
            x = _rms_norm(h, tensors[p + "input_layernorm.weight"])
            q, k, v = (x @ tensors[p + "self_attn.W_pack.weight"].T).view(
                length, 3, HEADS, head_dim).unbind(1)
            if position == "rope":
                q, k = _rope(q), _rope(k)
            a = alibi_attention_reference(q, k, v, slopes, head_dim ** -0.5)
            h = h + a.reshape(length, -1) @ tensors[p + "self_attn.o_proj.weight"].T
            x = _rms_norm(h, tensors[p + "post_attention_layernorm.weight"])
            gated = F.silu(x @ tensors[p + "mlp.gate_proj.weight"].T) * (x @ tensors[p + "mlp.up_proj.weight"].T)
            h = h + gated @ tensors[p + "mlp.down_proj.weight"].T
        return _rms_norm(h, tensors["model.norm.weight"]) @ lm_head.T
    return logits


def normalized_head_llama(llama: LlamaForCausalLM) -> LlamaForCausalLM:
    """Baichuan2-7B's reference: the Llama with NormHead's row-normalized LM head."""
    with torch.no_grad():
        llama.lm_head.weight.copy_(F.normalize(llama.lm_head.weight, dim=-1))
    return llama


@pytest.fixture(scope="module")
def twin():
    return llama_twin()


def test_explicit_reference_matches_transformers_with_rope(twin):
    """The explicit forward (ALiBi's reference) is right in everything but positions: with RoPE
    in place of ALiBi it equals transformers' Llama; with ALiBi it differs."""
    tensors = baichuan_tensors(twin, rotary_buffers=False)
    torch.manual_seed(5)
    ids = torch.randint(3, VOCAB, (40,)).tolist()
    expected = hf_reference(twin)(ids)
    torch.testing.assert_close(baichuan_reference(tensors, "rope", False)(ids), expected,
                               atol=1e-4, rtol=1e-4)
    assert not torch.allclose(baichuan_reference(tensors, "alibi", False)(ids), expected, atol=1e-2)


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_baichuan_matches_reference(variant, tmp_path):
    architecture, position, normalized = VARIANTS[variant]
    llama = llama_twin(seed=sorted(VARIANTS).index(variant))
    tensors = baichuan_tensors(llama, rotary_buffers=variant == "baichuan-7b")
    if position == "rope":
        reference = hf_reference(normalized_head_llama(llama) if normalized else llama)
    else:
        reference = baichuan_reference(tensors, position, normalized)
    config = baichuan_config(architecture, position, normalized)
    folder = write_checkpoint(tmp_path / "safetensors", config, tensors, "safetensors")
    ours = load_ours(folder)
    assert isinstance(ours, BaichuanForCausalLM)
    assert (ours.model.rotary_emb is None) == (position == "alibi")
    assert ours.max_context == 512
    check_family(ours, folder, reference, vocab=VOCAB)
    check_other_format(ours, write_checkpoint(tmp_path / "bin", config, tensors, "bin"), reference,
                       vocab=VOCAB)


@pytest.mark.parametrize("hidden,vocab,position,normalized", [
    (4096, 64000, "rope", False),    # Baichuan-7B
    (5120, 64000, "alibi", False),   # Baichuan-13B
    (4096, 125696, "rope", True),    # Baichuan2-7B
    (5120, 125696, "alibi", True),   # Baichuan2-13B
])
def test_released_configs_infer_positions_and_head(hidden, vocab, position, normalized):
    """Without our explicit keys (as released), hidden size picks RoPE or ALiBi and Baichuan2's
    vocabulary turns on the normalized head — vLLM's rules."""
    config = SimpleNamespace(hidden_size=hidden, vocab_size=vocab, num_attention_heads=40,
                             num_hidden_layers=40, intermediate_size=13696)
    view = _baichuan_view(config)
    assert (view.position_embedding, view.normalize_lm_head) == (position, normalized)


@pytest.mark.parametrize("key,value", [("position_embedding", "learned"),
                                       ("normalize_lm_head", "yes")])
def test_bad_explicit_keys_are_refused(key, value):
    config = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB, num_attention_heads=HEADS,
                             num_hidden_layers=LAYERS, intermediate_size=128, **{key: value})
    with pytest.raises(ValueError, match=key):
        BaichuanForCausalLM(config)


def test_quantized_configs_keep_their_scale_groups():
    """Baichuan and Qwen v1 read their remote-code configs through views of Llama's keys; a
    GPTQ checkpoint's quantization_config passes through, so the MLP's tensor-parallel split
    follows its groups (`loader.quantized.input_scale_group`)."""
    from ksana_llm.loader.quantized import input_scale_group
    from ksana_llm.models.qwen import _qwen_v1_view

    gptq = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}
    baichuan = SimpleNamespace(hidden_size=HIDDEN, vocab_size=VOCAB, num_attention_heads=HEADS,
                               num_hidden_layers=LAYERS, intermediate_size=128,
                               quantization_config=gptq)
    qwen = SimpleNamespace(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                           num_hidden_layers=LAYERS, intermediate_size=256,
                           quantization_config=gptq)
    assert input_scale_group(_baichuan_view(baichuan)) == 128
    assert input_scale_group(_qwen_v1_view(qwen)) == 128
    del baichuan.quantization_config
    assert input_scale_group(_baichuan_view(baichuan)) == 1
    # a group size written as a string, as some configs have it
    assert input_scale_group(SimpleNamespace(quantization_config={**gptq, "group_size": "64"})) \
        == 64
