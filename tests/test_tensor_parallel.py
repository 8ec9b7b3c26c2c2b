"""Tensor and pipeline parallelism on CPU with gloo: real worker processes, real process groups.

Each parallel engine must give the same greedy tokens as transformers (= TP 1) and logits within
fp32 tolerance, on tiny Llama (even and uneven splits, KV heads replicated), Qwen2, Mixtral
(MoE), DeepSeek-V3 (MLA heads split, latents replicated; routed and shared experts split),
DeepSeek-V2-Lite's shape (a full-rank MLA query split by heads, softmax group-limited routing),
Gemma 2 / 3 (windowed and full layers, a scaled embedding; Gemma 2's capped logits), Phi-3
(fused checkpoint projections split by rank), GLM-4-0414 (partial interleaved RoPE) and Granite
(scaled embeddings, residual branches and logits), with TP 2 and 3, PP 2 and TP 2 x PP 2; and a dead worker must fail the engine fast and clearly.
"""

from __future__ import annotations

import multiprocessing
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
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
from ksana_llm.distributed.launch import await_started
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import greedy_trace, hf_reference

pytestmark = pytest.mark.timeout(300)

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


def test_invalid_parallel_sizes_are_clear_errors(tmp_path):
    build("llama", tmp_path)  # 4 heads
    with pytest.raises(ValueError, match="tensor_parallel_size 3 must divide"):
        Model.from_pretrained(tmp_path, device="cpu", progress=False, tensor_parallel_size=3)
    with pytest.raises(ValueError, match="tensor_parallel_size"):
        Model.from_pretrained(tmp_path, device="cpu", progress=False, tensor_parallel_size=0)
    with pytest.raises(ValueError, match="pipeline_parallel_size 3 is more than"):
        Model.from_pretrained(tmp_path, device="cpu", progress=False, pipeline_parallel_size=3)


def test_a_dead_worker_fails_the_engine_fast(tmp_path):
    build("llama-tp3", tmp_path)
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                  tensor_parallel_size=3)
    engine = kt.Engine(model, generation_config=GenerationConfig(max_new_tokens=4),
                       num_device_blocks=32)
    try:
        assert len(engine.generate_outputs([[5, 6, 7]])[0].token_ids) == 4
        os.kill(model.workers[0].pid, signal.SIGKILL)
        deadline = time.monotonic() + 20
        while engine.is_running and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not engine.is_running
        start = time.monotonic()
        with pytest.raises(Exception, match="worker"):
            engine.generate_outputs([[5, 6, 7]])
        assert time.monotonic() - start < 10
        # The rank that lives on waits in a collective that never completes: shutting down
        # stops it at once (it used to be given 30 s to leave, each such rank in turn).
        start = time.monotonic()
        engine.shutdown()
        assert time.monotonic() - start < 15
        assert not any(worker.is_alive() for worker in model.workers)
    finally:
        engine.shutdown()


def test_an_engine_refused_after_loading_leaves_no_worker_behind(tmp_path):
    """Settings refused once the ranks are up (async scheduling, an adapter folder that is not
    one): the ValueError, no worker process left, and the next parallel engine in this process
    starts (the process group was left too)."""
    hf = build("llama", tmp_path)
    settings = {"device": "cpu", "dtype": "float32", "tensor_parallel_size": 2,
                "num_device_blocks": 32}
    for refused, message in [({"async_scheduling": True}, "async_scheduling needs a single-rank"),
                             ({"lora_modules": {"a": str(tmp_path / "none")}, "max_loras": 1},
                              "LoRA adapter .* is not a folder")]:
        with pytest.raises(ValueError, match=message):
            kt.Engine(str(tmp_path), **settings, **refused)
        assert not [p for p in multiprocessing.active_children()
                    if p.name.startswith("ksana-llm-rank")]
    expected = greedy_trace(hf_reference(hf), [5, 6, 7], 4)[0][3:]
    with kt.Engine(str(tmp_path), **settings) as engine:
        assert engine.generate_outputs([[5, 6, 7]], GenerationConfig(
            max_new_tokens=4, ignore_eos=True), use_tqdm=False)[0].token_ids == expected


STDIN_SCRIPT = """
import sys
import ksana_llm as kt
engine = kt.Engine(sys.argv[1], device="cpu", dtype="float32", tensor_parallel_size=2,
                   num_device_blocks=32)
print(engine.generate_outputs([[5, 6, 7]], kt.GenerationConfig(max_new_tokens=6,
                                                                ignore_eos=True))[0].token_ids)
engine.shutdown()
"""


def test_a_parallel_engine_from_a_script_read_on_stdin(tmp_path):
    """`python - < script`: spawn would make every worker re-run a main script named "<stdin>",
    so they all died and rank 0 waited out the 300 s rendezvous."""
    hf = build("llama", tmp_path)
    expected = greedy_trace(hf_reference(hf), [5, 6, 7], 6)[0][3:]
    done = subprocess.run([sys.executable, "-", str(tmp_path)], input=STDIN_SCRIPT, text=True,
                          capture_output=True, timeout=240, cwd=tmp_path)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().splitlines()[-1] == str(expected)


def test_a_worker_that_dies_before_starting_fails_the_launch_at_once():
    context = multiprocessing.get_context("spawn")
    started = context.Queue()
    dying = context.Process(target=sys.exit, args=(3,), daemon=True)
    dying.start()
    begin = time.monotonic()
    with pytest.raises(RuntimeError, match="worker rank 5 exited with code 3 before it started"):
        await_started({5: dying}, started, timeout_s=120)
    assert time.monotonic() - begin < 30


@pytest.mark.parametrize("tp, pp, multi_node, expected", [
    (1, 2, False, [0, 1]),  # one node, two stages: a GPU each (not both on GPU 0)
    (2, 2, False, [0, 1, 2, 3]),
    (2, 2, True, [0, 1, 0, 1]),  # a node per stage: each numbers its own GPUs from 0
    (4, 1, False, [0, 1, 2, 3])])
def test_each_rank_takes_a_gpu_of_its_own(tp, pp, multi_node, expected):
    """Which GPU of its machine each rank binds (a CUDA-only path, so its arithmetic is
    checked here: two pipeline stages on one node used to share GPU 0, which NCCL refuses)."""
    from ksana_llm.distributed.runtime import LaunchSpec, node_local_rank

    spec = LaunchSpec("m", "bfloat16", "cuda", tp_size=tp, pp_size=pp)
    assert [node_local_rank(r, spec, multi_node=multi_node) for r in range(tp * pp)] == expected


def test_balanced_splits_in_whole_units():
    """Items split as evenly as whole units allow, the first parts one unit larger; every item
    in exactly one part, in order. A total that is no whole number of units is refused."""
    from ksana_llm.distributed.context import balanced_split

    for total, parts, unit in ((10, 3, 1), (2880, 4, 32), (2880, 8, 32), (96, 2, 32), (64, 4, 32)):
        splits = [balanced_split(total, parts, index, unit) for index in range(parts)]
        assert [start for start, _ in splits] == [sum(s for _, s in splits[:i])
                                                  for i in range(parts)]
        assert sum(size for _, size in splits) == total
        sizes = [size // unit for _, size in splits]
        assert all(size % unit == 0 for _, size in splits)
        assert sizes == sorted(sizes, reverse=True) and max(sizes) - min(sizes) <= 1
    assert [balanced_split(2880, 4, i, 32) for i in range(4)] == \
        [(0, 736), (736, 736), (1472, 704), (2176, 704)]
    with pytest.raises(ValueError, match="units of 32"):
        balanced_split(100, 2, 0, 32)


def test_quantized_columns_split_evenly_unless_the_kernels_lose_their_groups():
    """Row-parallel input columns of a quantized checkpoint: the even split while every rank's
    slice starts where groups of 32 (or the whole scale block, when smaller) still fit;
    otherwise whole scale blocks, where every rank gets one."""
    from ksana_llm.distributed.context import ParallelContext
    from ksana_llm.layers.parallel import scale_aligned_split

    def splits(total: int, ranks: int, group: int) -> list[tuple[int, int]]:
        return [scale_aligned_split(total, ParallelContext(tp_size=ranks, tp_rank=rank), group)
                for rank in range(ranks)]

    # gpt-oss's experts (blocks of 32): 720 / 360 each would leave groups of 16 / 8
    assert [size for _, size in splits(2880, 4, 32)] == [736, 736, 704, 704]
    assert [size for _, size in splits(2880, 8, 32)] == [384, 384] + [352] * 6
    assert splits(2880, 2, 32) == [(0, 1440), (1440, 1440)]
    # 128-column blocks whose even splits start at multiples of 64: even, regrouped to 64
    for total, ranks in ((768, 4), (1536, 8), (29568, 2), (18432, 32)):
        assert {size for _, size in splits(total, ranks, 128)} == {total // ranks}
    assert splits(48, 2, 16) == [(0, 32), (32, 16)]  # 24 would leave groups of 8
    assert splits(40, 2, 16) == [(0, 20), (20, 20)]  # no whole number of blocks: even
    assert splits(64, 4, 32) == [(0, 16), (16, 16), (32, 16), (48, 16)]  # fewer blocks than ranks
    assert splits(96, 2, 1) == [(0, 48), (48, 48)]  # not quantized in groups
