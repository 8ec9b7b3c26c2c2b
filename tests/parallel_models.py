"""The tiny models the parallel tests run, each saved with weights that make a wrong split show,
and the check every parallel layout must pass: greedy tokens, given embeddings and logits equal to
transformers' on the same weights (tests/test_tensor_parallel.py; the quantized-checkpoint, LoRA
and family tests reuse the models)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (Cohere2Config, Cohere2ForCausalLM, CohereConfig, CohereForCausalLM,
                          DeepseekV2Config, DeepseekV2ForCausalLM, DeepseekV3Config,
                          DeepseekV3ForCausalLM, Gemma2Config, Gemma2ForCausalLM, Glm4Config,
                          GptOssConfig, GptOssForCausalLM,
                          Glm4ForCausalLM, GraniteConfig, GraniteForCausalLM,
                          Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig,
                          LlamaForCausalLM, MixtralConfig, MixtralForCausalLM, Olmo2Config,
                          Olmo2ForCausalLM, Olmo3Config, Olmo3ForCausalLM, Phi3Config,
                          Phi3ForCausalLM, Qwen2Config, Qwen2ForCausalLM, Starcoder2Config,
                          Starcoder2ForCausalLM)

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import greedy_trace, hf_reference

SMALL = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5,
             bos_token_id=1, eos_token_id=2, tie_word_embeddings=False)

MODELS = {
    # 4 heads / 2 KV heads: one KV head per rank at TP 2.
    "llama": lambda: LlamaForCausalLM(LlamaConfig(**SMALL)),
    # 6 heads / 3 KV heads at TP 3; MLP width 128 and vocab 256 split unevenly (43/43/42, 86/85/85).
    "llama-tp3": lambda: LlamaForCausalLM(LlamaConfig(**{**SMALL, "hidden_size": 96,
                                                          "num_attention_heads": 6,
                                                          "num_key_value_heads": 3,
                                                          "num_hidden_layers": 3})),
    # One KV head for two ranks: replicated; tied embeddings (vocab-parallel on both ends).
    "llama-mqa-tied": lambda: LlamaForCausalLM(LlamaConfig(**{**SMALL, "num_key_value_heads": 1,
                                                               "tie_word_embeddings": True})),
    "qwen2": lambda: Qwen2ForCausalLM(Qwen2Config(**SMALL)),
    "mixtral": lambda: MixtralForCausalLM(MixtralConfig(**SMALL, num_local_experts=4,
                                                        num_experts_per_tok=2)),
    # MLA with a low-rank query (4 heads: 2 per rank), a dense first layer, then MoE layers with
    # group-limited routing over 8 experts and a shared expert; 3 layers for PP's 2 + 1.
    "deepseek": lambda: DeepseekV3ForCausalLM(DeepseekV3Config(**{
        **SMALL, "intermediate_size": 96, "moe_intermediate_size": 32, "num_hidden_layers": 3,
        "first_k_dense_replace": 1, "num_key_value_heads": 4, "n_routed_experts": 8,
        "n_group": 2, "topk_group": 1, "num_experts_per_tok": 2, "n_shared_experts": 1,
        "routed_scaling_factor": 2.5, "norm_topk_prob": True, "kv_lora_rank": 32,
        "q_lora_rank": 48, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16, "v_head_dim": 16,
        "rope_interleave": True})),
    # DeepSeek-V2-Lite's shape: a full-rank q_proj split by heads; softmax routing limited to
    # the best 2 of 4 expert groups (V2's group_limited_greedy), 3 experts per token.
    "deepseek-v2": lambda: DeepseekV2ForCausalLM(DeepseekV2Config(**{
        **SMALL, "intermediate_size": 96, "moe_intermediate_size": 32,
        "first_k_dense_replace": 1, "num_key_value_heads": 4, "n_routed_experts": 8,
        "n_group": 4, "topk_group": 2, "num_experts_per_tok": 3, "n_shared_experts": 2,
        "topk_method": "group_limited_greedy", "routed_scaling_factor": 2.0,
        "kv_lora_rank": 32, "q_lora_rank": None, "qk_rope_head_dim": 8, "qk_nope_head_dim": 16,
        "v_head_dim": 16})),
    # Gemma 3: a windowed layer then a full one (the 30-token prompt outruns the 8-token
    # window), the scaled embedding split by vocabulary, q/k norms per head on each rank.
    "gemma3": lambda: Gemma3ForCausalLM(Gemma3TextConfig(**{
        **SMALL, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "layer_types": ["sliding_attention", "full_attention"]})),
    # Gemma 2: the same layout without q/k norms, attention logits capped on each rank's heads.
    # Phi-3: the checkpoint's fused qkv_proj / gate_up_proj split into each rank's heads and
    # columns.
    "phi3": lambda: Phi3ForCausalLM(Phi3Config(**SMALL, pad_token_id=0)),
    # Phi-3.5's LongRoPE over Phi-4-mini's partial rotary, an original context of 20: the
    # 30-token prompt is long from its first chunk (rows marked on every rank), the others grow
    # past it while decoding and are recomputed.
    "phi3-longrope": lambda: Phi3ForCausalLM(Phi3Config(
        **SMALL, pad_token_id=0, original_max_position_embeddings=20, partial_rotary_factor=0.75,
        rope_scaling={"type": "longrope", "short_factor": [1.0 + 0.1 * i for i in range(6)],
                      "long_factor": [3.0 + 2.0 * i for i in range(6)]})),
    # GLM-4-0414: q/k rotary rows reordered per head before each rank takes its heads; biases.
    "glm4": lambda: Glm4ForCausalLM(Glm4Config(**SMALL, head_dim=16, pad_token_id=0)),
    # Granite: the embedding scaled on every rank after the vocabulary-parallel gather, the
    # residual branches and logits scaled.
    "granite": lambda: GraniteForCausalLM(GraniteConfig(
        **SMALL, embedding_multiplier=12.0, attention_multiplier=0.0625, residual_multiplier=0.22,
        logits_scaling=8.0)),
    # OLMo 2: q/k norms over all heads, each rank's sum of squares all-reduced (at TP 4 the 2
    # KV heads are replicated: each counted twice, and divided back).
    "olmo2": lambda: Olmo2ForCausalLM(Olmo2Config(**SMALL, pad_token_id=0)),
    # OLMo 3: a windowed layer and a full one with their own RoPE bases, no residual between
    # layers (the stream a stage sends is whole).
    "olmo3": lambda: Olmo3ForCausalLM(Olmo3Config(
        **SMALL, pad_token_id=0, sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                         "full_attention": {"rope_type": "default", "rope_theta": 500000.0}})),
    # Command R+: q/k rows reordered to halves per head, then each rank's heads taken with
    # their own per-head q/k LayerNorm weights; attention and MLP side by side on one norm.
    "command-r-plus": lambda: CohereForCausalLM(CohereConfig(**{
        **SMALL, "pad_token_id": 0, "use_qk_norm": True, "logit_scale": 0.25,
        "tie_word_embeddings": True})),
    # Command R7B: a windowed rotating layer, a full NoPE one; a stage sends a whole stream.
    "command-r7b": lambda: Cohere2ForCausalLM(Cohere2Config(**{
        **SMALL, "pad_token_id": 0, "sliding_window": 8, "logit_scale": 0.25,
        "layer_types": ["sliding_attention", "full_attention"], "tie_word_embeddings": True})),
    # StarCoder 2: the plain MLP's c_fc split by columns, c_proj by rows (its bias once);
    # LayerNorms with biases; a 12-token window outrun by the 30-token prompt.
    "starcoder2": lambda: Starcoder2ForCausalLM(Starcoder2Config(**{
        **SMALL, "pad_token_id": 0, "sliding_window": 12})),
    # GPT-OSS: each rank its heads' sink logits, its slice of every expert (gate and up rows
    # de-interleaved first; the down bias added once), the router's bias whole; a windowed
    # layer and a full one.
    "gpt-oss": lambda: GptOssForCausalLM(GptOssConfig(**{
        **SMALL, "head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2,
        "sliding_window": 8, "swiglu_limit": 1.0, "pad_token_id": 0,
        "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "rope_theta": 150000.0,
                            "original_max_position_embeddings": 64, "truncate": False}})),
    "gemma2": lambda: Gemma2ForCausalLM(Gemma2Config(**{
        **SMALL, "head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16,
        "attn_logit_softcapping": 0.5, "layer_types": ["sliding_attention", "full_attention"]})),
}


def build(name: str, folder: Path) -> torch.nn.Module:
    torch.manual_seed(0)
    model = MODELS[name]().eval()
    with torch.no_grad():
        for pname, param in model.named_parameters():
            if pname.endswith("bias"):
                param.normal_(0, 0.1)  # a bias a rank dropped or doubled must show
            elif pname.endswith("norm.weight") and "gemma" in name:
                param.normal_(0, 0.3)  # Gemma's norm offsets (0 would hide a lost +1)
            elif pname.endswith("norm.weight") and ("olmo" in name or "command" in name
                                                    or "starcoder" in name):
                param.normal_(1, 0.5)  # q/k norm weights: a rank's slice taken wrong must show
            elif pname.endswith("sinks"):
                param.normal_(0, 1.5)  # GPT-OSS: a rank's heads given another's sinks must show
            elif ("gate" in pname or "router" in pname) and param.dim() == 2 \
                    and param.shape[0] <= 8:
                param.normal_(0, 0.5)  # routers: spread tokens over the experts
            elif "experts" in pname:
                param.normal_(0, 0.1)  # experts big enough for a wrong split to show
        for bname, buffer in model.named_buffers():
            if bname.endswith("e_score_correction_bias"):
                buffer.normal_(0, 0.3)  # DeepSeek's selection bias
    model.save_pretrained(folder)
    return model


def prompts(n: int = 3) -> list[list[int]]:
    torch.manual_seed(1)
    return [torch.randint(3, 256, (length,)).tolist() for length in (9, 30, 17)[:n]]


def check_engine(folder: Path, hf: torch.nn.Module, *, tp: int = 1, pp: int = 1,
                 max_new_tokens: int = 12) -> None:
    reference = hf_reference(hf)
    batch = prompts()
    expected = [greedy_trace(reference, p, max_new_tokens)[0][len(p):] for p in batch]
    model = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=tp, pipeline_parallel_size=pp)
    assert model.module.num_layers < hf.config.num_hidden_layers or pp == 1
    config = GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    # The first prompt once more, as its embeddings (vLLM's prompt_embeds): they must reach
    # every rank and stage.
    with torch.no_grad():
        embeds = hf.get_input_embeddings()(torch.tensor(batch[0]))
    with kt.Engine(model, generation_config=config, block_token_num=4, num_device_blocks=96,
                   split_fuse_token_num=16) as engine:
        outputs = engine.generate_outputs(batch + [{"prompt_embeds": embeds}])
        logits = engine.forward(batch[1], [{"target_name": "logits"}]).targets[0].tensor
    assert [o.token_ids for o in outputs] == expected + expected[:1]
    torch.testing.assert_close(logits, reference(batch[1]), atol=2e-4, rtol=1e-4)
    # Shut down, rank 0's own KV cache is freed too (the workers' go with their processes).
    rank0 = engine._core.runner.local
    assert sum(t.untyped_storage().nbytes() for pair in rank0.kv_caches for t in pair) == 0
