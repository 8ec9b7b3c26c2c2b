"""FP8 KV cache: what `kv_cache_dtype` buys (room, throughput under a memory budget) and costs
(accuracy), against the model's own dtype and against transformers, in one run.

Capacity and throughput
    Every engine gets the same KV memory budget (`--kv-cache-mib`), so an FP8 cache holds more
    tokens (4x an fp32 cache, 2x a 16-bit one). The workload is `--num-requests` requests, all
    submitted at once, each with a prompt of random ids of a length drawn from
    [--min-len, --max-len] and `--output-len` new tokens, EOS ignored. Reported: KV tokens the
    budget holds, wall time, output tokens/s and its ratio to the model-dtype cache, and the
    preemptions the engine needed (a cache too small for the batch swaps sequences out).

Accuracy
    Perplexity of a fixed English text (the `/forward` path: one prefill, every position's
    log-prob) for each cache, and transformers' on the same weights as the peer; plus how many
    of the throughput run's output tokens equal the model-dtype cache's (greedy).

Run
    python benchmarks/kv_cache_dtype.py                      # CPU, fp32, SmolLM2-135M-Instruct
    python benchmarks/kv_cache_dtype.py --device cuda --dtype bfloat16 --kv-cache-mib 64 \
        --num-requests 256 --model /models/Qwen3-0.6B
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import ksana_llm as kt

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file, or with -m
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.accuracy import (TEXT, device_sync, perplexity_hf,  # noqa: E402
                                 perplexity_ours, random_prompts)
from ksana_llm.kernels.kv_quant import cache_dtype_for
from ksana_llm.runner.model_runner import kv_bytes_per_block

CACHE_DTYPES = ("auto", "fp8_e5m2", "fp8_e4m3")

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--kv-cache-mib", type=float, default=24.0,
                   help="KV memory every engine gets (default 24 MiB: ~530 fp32 SmolLM2 tokens)")
    p.add_argument("--num-requests", type=int, default=32)
    p.add_argument("--min-len", type=int, default=64)
    p.add_argument("--max-len", type=int, default=192)
    p.add_argument("--output-len", type=int, default=64)
    p.add_argument("--block-token-num", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json-out", default=None)
    args = p.parse_args()

    model = kt.Model.from_pretrained(args.model, device=args.device, dtype=args.dtype,
                                     progress=False)
    prompts = random_prompts(model.tokenizer, model.vocab_size, args.num_requests, args.min_len,
                             args.max_len, args.seed)
    text_ids = model.tokenizer.encode(TEXT)
    config = kt.GenerationConfig(max_new_tokens=args.output_len, ignore_eos=True, temperature=0)
    budget = int(args.kv_cache_mib * 2**20)
    results: dict[str, dict] = {}
    baseline_tokens: list[list[int]] | None = None
    for name in CACHE_DTYPES:
        per_block = kv_bytes_per_block(model.module, args.block_token_num,
                                       cache_dtype_for(name, model.dtype))
        blocks = budget // per_block
        with kt.Engine(model, kv_cache_dtype=name, num_device_blocks=blocks,
                       block_token_num=args.block_token_num, generation_config=config) as engine:
            engine.generate_outputs([prompts[0][:8]], use_tqdm=False)  # warm-up
            before = engine.stats().num_preemptions
            device_sync(model.device)
            start = time.perf_counter()
            outputs = engine.generate_outputs(prompts, use_tqdm=False)
            device_sync(model.device)
            wall = time.perf_counter() - start
            preemptions = engine.stats().num_preemptions - before
            perplexity = perplexity_ours(engine, text_ids)
        tokens = [o.token_ids for o in outputs]
        if baseline_tokens is None:
            baseline_tokens = tokens
        same = sum(a == b for out, ref in zip(tokens, baseline_tokens) for a, b in zip(out, ref))
        results[name] = {
            "kv_tokens": blocks * args.block_token_num, "kv_blocks": blocks,
            "wall_s": wall, "output_tok_s": sum(map(len, tokens)) / wall,
            "preemptions": preemptions, "perplexity": perplexity,
            "tokens_equal_auto": same / sum(map(len, baseline_tokens)),
        }
    hf_perplexity = perplexity_hf(model, text_ids)

    base = results["auto"]
    print(f"\nKV budget {args.kv_cache_mib:g} MiB, {args.num_requests} requests, prompts "
          f"[{args.min_len}, {args.max_len}], {args.output_len} output tokens, "
          f"{model.path.name} {args.dtype} on {args.device}\n")
    print("| kv_cache_dtype | KV tokens | wall s | output tok/s | vs auto | preemptions | "
          "perplexity | tokens = auto's |")
    print("|---|---|---|---|---|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['kv_tokens']:,} | {r['wall_s']:.1f} | {r['output_tok_s']:.1f} | "
              f"{r['output_tok_s'] / base['output_tok_s']:.2f}x | {r['preemptions']} | "
              f"{r['perplexity']:.3f} | {100 * r['tokens_equal_auto']:.0f}% |")
    print(f"| transformers (peer) | - | - | - | - | - | {hf_perplexity:.3f} | - |")
    if args.json_out:
        with open(args.json_out, "w", encoding="utf-8") as f:
            json.dump({"args": vars(args), "results": results, "hf_perplexity": hf_perplexity},
                      f, indent=2)


if __name__ == "__main__":
    main()
