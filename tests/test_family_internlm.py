"""InternLM 2 / 2.5 (`InternLM2ForCausalLM`) and InternLM 3 (`InternLM3ForCausalLM`) end to end
(fp32).

Both ship remote modeling code, which we never run (transformers 5 reads InternLM 3's config,
and runs it as Llama). They are Llama's block under other names, so the reference is
transformers' Llama with random weights, written out as the InternLM checkpoint stores them:
for InternLM 2 the renamed tensors and the fused `wqkv` with its rows interleaved per KV head
([q of that head's query heads | k | v]), as InternLM 2's modeling code reads them. Configs
carry "dynamic" RoPE scaling, which changes nothing within the context. Checks: logits at
prefill (whole and chunked), at 16 decode steps and on a prefix-cache hit, and greedy tokens
through the Engine (tests/family_harness.py); tensor parallelism in
tests/test_tensor_parallel.py.
"""

from __future__ import annotations

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from ksana_llm.models.internlm import InternLM2ForCausalLM, InternLM3ForCausalLM
from tests.family_harness import (check_family, hf_reference, load_ours, spread_weights,
                                  write_checkpoint)

VOCAB = 256
SHAPE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=8,
             num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=256,
             rms_norm_eps=1e-5, rope_theta=50000.0, bos_token_id=1, eos_token_id=2,
             pad_token_id=0, tie_word_embeddings=False)


def fused_wqkv(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: int, head_dim: int
               ) -> torch.Tensor:
    """q/k/v rows (weights or biases) as InternLM 2's wqkv stores them."""
    rest = q.shape[1:]
    q = q.reshape(kv_heads, -1, head_dim, *rest)
    k = k.reshape(kv_heads, 1, head_dim, *rest)
    v = v.reshape(kv_heads, 1, head_dim, *rest)
    return torch.cat((q, k, v), dim=1).reshape(-1, *rest)


def internlm2_checkpoint(llama: torch.nn.Module, bias: bool) -> dict[str, torch.Tensor]:
    d = SHAPE["hidden_size"] // SHAPE["num_attention_heads"]
    state = {n: t.clone() for n, t in llama.state_dict().items()}
    out = {"model.tok_embeddings.weight": state.pop("model.embed_tokens.weight"),
           "model.norm.weight": state.pop("model.norm.weight"),
           "output.weight": state.pop("lm_head.weight")}
    for i in range(SHAPE["num_hidden_layers"]):
        ours, theirs = f"model.layers.{i}.", f"model.layers.{i}."
        for kind in ("weight", "bias") if bias else ("weight",):
            parts = [state.pop(f"{ours}self_attn.{p}_proj.{kind}") for p in "qkv"]
            out[f"{theirs}attention.wqkv.{kind}"] = fused_wqkv(
                *parts, SHAPE["num_key_value_heads"], d)
            out[f"{theirs}attention.wo.{kind}"] = state.pop(f"{ours}self_attn.o_proj.{kind}")
        for src, dst in (("mlp.gate_proj", "feed_forward.w1"), ("mlp.up_proj", "feed_forward.w3"),
                         ("mlp.down_proj", "feed_forward.w2"),
                         ("input_layernorm", "attention_norm"),
                         ("post_attention_layernorm", "ffn_norm")):
            out[f"{theirs}{dst}.weight"] = state.pop(f"{ours}{src}.weight")
    state.pop("model.rotary_emb.inv_freq", None)
    assert not state, f"unconverted: {sorted(state)}"
    return out


def internlm2_config(bias: bool) -> dict:
    return {**SHAPE, "architectures": ["InternLM2ForCausalLM"], "model_type": "internlm2",
            "bias": bias, "hidden_act": "silu", "rope_scaling": {"type": "dynamic", "factor": 2.0},
            "auto_map": {"AutoModelForCausalLM": "modeling_internlm2.InternLM2ForCausalLM"}}


@pytest.mark.parametrize("bias", [False, True])
def test_internlm2_matches_llama(tmp_path, bias):
    torch.manual_seed(0)
    llama = spread_weights(LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=bias)))
    folder = write_checkpoint(tmp_path, internlm2_config(bias), internlm2_checkpoint(llama, bias),
                              "safetensors")
    ours = load_ours(folder)
    assert isinstance(ours, InternLM2ForCausalLM)
    check_family(ours, folder, hf_reference(llama), vocab=VOCAB)


def test_internlm2_wqkv_of_the_wrong_size_names_it(tmp_path):
    torch.manual_seed(0)
    llama = spread_weights(LlamaForCausalLM(LlamaConfig(**SHAPE)))
    tensors = internlm2_checkpoint(llama, bias=False)
    name = "model.layers.1.attention.wqkv.weight"
    tensors[name] = tensors[name][:-8]
    folder = write_checkpoint(tmp_path, internlm2_config(False), tensors, "bin")
    with pytest.raises(ValueError, match=name.replace(".", r"\.")):
        load_ours(folder)


def test_internlm3_matches_its_llama_block(tmp_path):
    """The hub's config (`qkv_bias`, `bias`, "dynamic" `rope_scaling`, its own architecture
    name; transformers 5 reads it as InternLM3Config, which requires the two biases equal),
    Llama's tensor names: the biased Llama block."""
    torch.manual_seed(0)
    llama = spread_weights(LlamaForCausalLM(LlamaConfig(**SHAPE, head_dim=16,
                                                        attention_bias=True, mlp_bias=True)))
    tensors = {n: t.clone() for n, t in llama.state_dict().items() if "rotary_emb" not in n}
    config = {**SHAPE, "head_dim": 16, "architectures": ["InternLM3ForCausalLM"],
              "model_type": "internlm3", "qkv_bias": True, "bias": True, "hidden_act": "silu",
              "rope_scaling": {"rope_type": "dynamic", "factor": 6.0},
              "auto_map": {"AutoModelForCausalLM": "modeling_internlm3.InternLM3ForCausalLM"}}
    folder = write_checkpoint(tmp_path, config, tensors, "safetensors")
    ours = load_ours(folder)
    assert isinstance(ours, InternLM3ForCausalLM)
    check_family(ours, folder, hf_reference(llama), vocab=VOCAB)


def test_internlm2_tensor_parallel(tmp_path):
    """TP 2: each rank takes its heads of the q/k/v taken apart from wqkv (and their biases)."""
    from tests.parallel_models import check_engine

    torch.manual_seed(0)
    llama = spread_weights(LlamaForCausalLM(LlamaConfig(**SHAPE, attention_bias=True)))
    folder = write_checkpoint(tmp_path, internlm2_config(True),
                              internlm2_checkpoint(llama, True), "safetensors")
    check_engine(folder, llama, tp=2)


def test_internlm2_lora_adapter_on_its_own_module_names(tmp_path):
    """An adapter trained on InternLM 2 names its modules `attention.wqkv` (one A, one B over
    the fused rows, interleaved per KV head), `attention.wo`, `feed_forward.w2`. The reference
    is transformers' Llama with those deltas merged into its q/k/v, o and down weights."""
    import json

    from safetensors.torch import save_file

    import ksana_llm as kt
    from ksana_llm.api.model import Model
    from ksana_llm.generation_config import GenerationConfig
    from tests.family_harness import greedy_trace

    torch.manual_seed(0)
    llama = spread_weights(LlamaForCausalLM(LlamaConfig(**SHAPE)))
    base = write_checkpoint(tmp_path / "base", internlm2_config(False),
                            internlm2_checkpoint(llama, False), "safetensors")
    d, kv = SHAPE["hidden_size"] // SHAPE["num_attention_heads"], SHAPE["num_key_value_heads"]
    rank, alpha, hidden = 4, 8, SHAPE["hidden_size"]
    tensors = {}
    with torch.no_grad():
        for i in range(SHAPE["num_hidden_layers"]):
            attn, mlp = llama.model.layers[i].self_attn, llama.model.layers[i].mlp
            q, k, v = (torch.randn(p.weight.shape[0], rank) * 0.3
                       for p in (attn.q_proj, attn.k_proj, attn.v_proj))
            a_qkv, a_o, a_down = (torch.randn(rank, n) * 0.3
                                  for n in (hidden, hidden, SHAPE["intermediate_size"]))
            b_o, b_down = torch.randn(hidden, rank) * 0.3, torch.randn(hidden, rank) * 0.3
            prefix = f"base_model.model.model.layers.{i}."
            tensors[prefix + "attention.wqkv.lora_A.weight"] = a_qkv
            tensors[prefix + "attention.wqkv.lora_B.weight"] = fused_wqkv(q, k, v, kv, d)
            tensors[prefix + "attention.wo.lora_A.weight"] = a_o
            tensors[prefix + "attention.wo.lora_B.weight"] = b_o
            tensors[prefix + "feed_forward.w2.lora_A.weight"] = a_down
            tensors[prefix + "feed_forward.w2.lora_B.weight"] = b_down
            scale = alpha / rank
            for proj, b, a in ((attn.q_proj, q, a_qkv), (attn.k_proj, k, a_qkv),
                               (attn.v_proj, v, a_qkv), (attn.o_proj, b_o, a_o),
                               (mlp.down_proj, b_down, a_down)):
                proj.weight += scale * b @ a
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    save_file(tensors, adapter / "adapter_model.safetensors")
    (adapter / "adapter_config.json").write_text(json.dumps({
        "peft_type": "LORA", "r": rank, "lora_alpha": alpha,
        "target_modules": ["wqkv", "wo", "w2"], "base_model_name_or_path": str(base)}))
    prompt = list(range(3, 30))
    expected = greedy_trace(hf_reference(llama), prompt, 8)[0][len(prompt):]
    model = Model.from_pretrained(base, device="cpu", dtype="float32", progress=False)
    with kt.Engine(model, generation_config=GenerationConfig(max_new_tokens=8, ignore_eos=True),
                   lora_modules={"a": str(adapter)}) as engine:
        got = engine.generate_outputs([prompt], use_tqdm=False, lora="a")[0].token_ids
    assert got == expected
