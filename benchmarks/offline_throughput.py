"""Offline throughput: ksana_llm against Hugging Face transformers, same weights, one run.

Workload
    `--num-requests` prompts (default 64). Each prompt length and each output length is drawn
    independently and uniformly from [--min-len, --max-len] (default [32, 256]) by a NumPy
    generator seeded with `--seed`. Prompt tokens are random ids drawn uniformly from the model's
    vocabulary with every special / added-special token removed (so no BOS/EOS/chat markers leak
    in). Random ids give the same compute as real text for a dense model and keep the run fully
    reproducible without a data set. EOS is ignored everywhere: every request must produce
    exactly its own output length.

Systems (all in float32 by default, on the weights `kt.Engine` loaded: `engine.model.path`)
    ksana_llm          `Engine.generate_outputs` with every request submitted at once (token
                       budget per step = the engine's `max_batch_size`, default 2048), after a
                       warm-up of two tiny requests.
    HF generate        `model.generate` on left-padded static batches of `--hf-batch-size`
                       prompts (default: all of them). Each batch runs for the longest output
                       of the batch (`max_new_tokens = min_new_tokens = max(out_len)`), greedy.
                       Only the *useful* tokens (each request's own output length) count for
                       tokens/s -- what a user of static batching actually gets; the raw
                       generated count (padding rows included) is printed too.
    HF generate_batch  transformers' continuous batching. `model.generate_batch` takes one
                       GenerationConfig (one `max_new_tokens` for all requests), so this script
                       drives the same machinery one level down -- the manager from
                       `model.continuous_batching_context_manager(...)` -- and calls
                       `manager.add_request(input_ids, max_new_tokens=out_len, eos_token_id=-1)`
                       per request, which supports per-request lengths exactly. Attention is
                       "sdpa" (the CPU-capable CB path: one packed varlen batch with a
                       block-diagonal mask; flash attention and CUDA graphs are GPU-only). The
                       KV cache is sized from the workload (`num_blocks`) and the step token
                       budget matches ksana_llm's (`max_batch_tokens`). Manager construction
                       (cache allocation) and shutdown are excluded from the wall time, as the
                       engine's own construction is.

Batch-1 decode latency
    One prompt of `--b1-prompt-len` tokens (64), `--b1-new-tokens` (128) new tokens, EOS ignored,
    median of `--b1-repeats` runs. Time per output token excludes the first token (prefill):
    ksana_llm: `(metrics.latency - metrics.ttft) / (n - 1)`; HF generate: a streamer stamps
    every generated token, `(t_last - t_first) / (n - 1)`.

Output
    A markdown table of tokens/s with the ratio ours / peer, and a batch-1 table of ms/token
    with the ratio peer / ours (both > 1 means ksana_llm is faster). "same tokens as ours" counts
    the requests whose greedy output equals ksana_llm's token for token (a sanity check that the
    systems compute the same thing; float rounding at near-ties can flip a few). `--json-out PATH`
    also writes every number as JSON. A failing peer prints its error and the run goes on; the
    exit status is non-zero only if ksana_llm itself failed or produced a wrong length.

Run
    python benchmarks/offline_throughput.py --quick        # smoke run: 8 requests, lengths [16, 64]
    python benchmarks/offline_throughput.py                # the default workload (minutes on 2 cores)
    python benchmarks/offline_throughput.py --peers generate --threads 2 --json-out /tmp/r.json

Timings on a shared CPU are noisy: compare runs made on an otherwise idle machine.
"""

from __future__ import annotations

import argparse
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch

import ksana_llm as kt

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.hf_peers import (hf_batch1, load_hf_model, pad_token_id,  # noqa: E402
                                 run_hf_continuous, run_hf_generate)
from benchmarks.workload import (LatencyResult, ThroughputResult, Workload,  # noqa: E402
                                 allowed_token_ids, batch1_prompt, build_workload)

PEER_CHOICES = ("all", "generate", "generate_batch", "none")


# ---- ksana_llm ------------------------------------------------------------------------------------
def make_engine(args: argparse.Namespace) -> kt.Engine:
    extra = {name: getattr(args, name) for name in ("max_batch_size", "max_num_seqs")
             if getattr(args, name) is not None}
    return kt.Engine(model=args.model, dtype=args.dtype, **extra)


def ours_configs(output_lens: list[int]) -> list[kt.GenerationConfig]:
    return [kt.GenerationConfig(max_new_tokens=n, ignore_eos=True) for n in output_lens]


def run_ours(engine: kt.Engine, workload: Workload,
             loras: list[str | None] | None = None) -> ThroughputResult:
    """All requests at once through the engine, after a tiny warm-up; `loras`: request i's
    LoRA adapter (None: the base model for all)."""
    warm = [p[:8] for p in workload.prompts[:2]]
    engine.generate_outputs(warm, ours_configs([4] * len(warm)), use_tqdm=False,
                            lora=loras[0] if loras else None)
    configs = ours_configs(workload.output_lens)
    start = time.perf_counter()
    outputs = engine.generate_outputs(workload.prompts, configs, use_tqdm=False, lora=loras)
    wall = time.perf_counter() - start
    got = [len(o.token_ids) for o in outputs]
    bad = [(i, g, want) for i, (g, want) in enumerate(zip(got, workload.output_lens)) if g != want]
    notes = "" if not bad else f"length mismatches (idx, got, want): {bad[:5]}"
    return ThroughputResult("ksana_llm", wall, sum(min(g, w) for g, w in zip(got, workload.output_lens)),
                            sum(got), not bad, notes, [list(o.token_ids) for o in outputs])


def ours_batch1(engine: kt.Engine, prompt: list[int], new_tokens: int,
                repeats: int, lora: str | None = None) -> LatencyResult:
    config = kt.GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True)
    engine.generate_outputs([prompt[:8]], [kt.GenerationConfig(max_new_tokens=4, ignore_eos=True)],
                            use_tqdm=False, lora=lora)
    per_token, ttfts = [], []
    for _ in range(repeats):
        out = engine.generate_outputs([prompt], [config], use_tqdm=False, lora=lora)[0]
        n, m = len(out.token_ids), out.metrics
        if n != new_tokens or m.ttft is None or m.latency is None:
            raise RuntimeError(f"batch-1 run produced {n} tokens (wanted {new_tokens})")
        per_token.append((m.latency - m.ttft) / (n - 1) * 1e3)
        ttfts.append(m.ttft * 1e3)
    return LatencyResult("ksana_llm", statistics.median(per_token), statistics.median(ttfts),
                         per_token)


# ---- reporting ------------------------------------------------------------------------------------
def compare_tokens(results: list[ThroughputResult]) -> None:
    """Set `same_as_ours` on every peer: how many requests produced exactly ksana_llm's tokens.

    All systems decode greedily on the same weights, so this is a correctness sanity check of the
    comparison; a few differences are expected from float rounding at near-ties (padding and
    batch shape change the summation order), many would mean the systems compute different things.
    """
    ours = next((r for r in results if r.name == "ksana_llm"), None)
    if ours is None or not ours.token_ids:
        return
    for r in results:
        if r is not ours and r.token_ids and len(r.token_ids) == len(ours.token_ids):
            r.same_as_ours = sum(a == b for a, b in zip(r.token_ids, ours.token_ids))


def guarded(name: str, errors: dict[str, str], fn: Callable[[], Any]) -> Any:
    """Run one benchmark step; on failure print and record the error (shortened: a CUDA error
    can be pages long) and return None. Also the GPU benchmark's (`gpu/bench_engine.py`)."""
    print(f"[bench] running {name} ...", flush=True)
    start = time.perf_counter()
    try:
        result = fn()
    except Exception as exc:  # noqa: BLE001 - one failing peer must not stop the others
        traceback.print_exc()
        errors[name] = f"{type(exc).__name__}: {exc}"[:2000]
        print(f"[bench] {name} FAILED: {errors[name][:300]}", flush=True)
        return None
    print(f"[bench] {name} done in {time.perf_counter() - start:.1f}s", flush=True)
    return result


def throughput_table(results: list[ThroughputResult], workload: Workload) -> str:
    ours = next((r for r in results if r.name == "ksana_llm"), None)
    lines = [f"Offline throughput: {len(workload.prompts)} requests, {workload.input_tokens} prompt "
             f"tokens, {workload.output_tokens} output tokens (EOS ignored)", "",
             "| system | wall (s) | useful output tokens | raw generated tokens | tokens/s "
             "| ours / peer | exact lengths | same tokens as ours |",
             "|---|---:|---:|---:|---:|---:|:---:|---:|"]
    for r in results:
        ratio = (ours.tokens_per_s / r.tokens_per_s) if ours and r.tokens_per_s > 0 else float("nan")
        same = "-" if r.same_as_ours is None else f"{r.same_as_ours}/{len(r.token_ids)}"
        lines.append(f"| {r.name} | {r.wall_s:.2f} | {r.useful_tokens} | {r.raw_tokens} "
                     f"| {r.tokens_per_s:.1f} | {ratio:.2f}x | {'yes' if r.exact_lengths else 'NO'} "
                     f"| {same} |")
    return "\n".join(lines)


def latency_table(results: list[LatencyResult], prompt_len: int, new_tokens: int) -> str:
    ours = next((r for r in results if r.name == "ksana_llm"), None)
    lines = [f"Batch-1 decode: {prompt_len}-token prompt, {new_tokens} new tokens "
             "(first token excluded; median)", "",
             "| system | TTFT (ms) | decode ms / token | tokens/s | peer / ours |",
             "|---|---:|---:|---:|---:|"]
    for r in results:
        ratio = r.ms_per_token / ours.ms_per_token if ours else float("nan")
        lines.append(f"| {r.name} | {r.ttft_ms:.1f} | {r.ms_per_token:.2f} "
                     f"| {1e3 / r.ms_per_token:.1f} | {ratio:.2f}x |")
    return "\n".join(lines)


def environment() -> dict[str, Any]:
    import transformers

    return {"python": platform.python_version(), "torch": torch.__version__,
            "transformers": transformers.__version__, "torch_threads": torch.get_num_threads(),
            "machine": platform.machine(), "platform": platform.platform()}


# ---- main -----------------------------------------------------------------------------------------
def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--min-len", type=int, default=32, help="min prompt and output length")
    p.add_argument("--max-len", type=int, default=256, help="max prompt and output length")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default=None, help="HF folder or .gguf; default: the engine's default model")
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--peers", default="all", choices=PEER_CHOICES)
    p.add_argument("--json-out", type=Path, default=None)
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (default: torch's)")
    p.add_argument("--quick", action="store_true",
                   help="smoke run: 8 requests, lengths [16, 64], 32 batch-1 tokens, 1 repeat")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="static batch size for HF generate (default: all requests in one batch)")
    p.add_argument("--hf-cb-page-size", type=int, default=32, help="HF continuous batching page size")
    p.add_argument("--hf-cb-timeout", type=float, default=3600.0, help="seconds before giving up on HF CB")
    p.add_argument("--max-batch-size", type=int, default=None,
                   help="ksana_llm token budget per step (also HF CB max_batch_tokens)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="ksana_llm sequences per step")
    p.add_argument("--b1-prompt-len", type=int, default=64)
    p.add_argument("--b1-new-tokens", type=int, default=128)
    p.add_argument("--b1-repeats", type=int, default=3)
    p.add_argument("--skip-batch1", action="store_true", help="skip the batch-1 latency section")
    args = p.parse_args(argv)
    if args.quick:
        args.num_requests, args.min_len, args.max_len = 8, 16, 64
        args.b1_new_tokens, args.b1_repeats = 32, 1
    if not 1 <= args.min_len <= args.max_len:
        p.error("need 1 <= --min-len <= --max-len")
    if args.num_requests < 2 or args.b1_new_tokens < 2:
        p.error("need --num-requests >= 2 and --b1-new-tokens >= 2")
    return args


def wants(args: argparse.Namespace, peer: str) -> bool:
    return args.peers in ("all", peer)


def run_engine_part(args: argparse.Namespace, errors: dict[str, str]) -> dict[str, Any]:
    """Build the workload and measure ksana_llm; the engine is shut down before the peers run."""
    engine = make_engine(args)
    try:
        allowed = allowed_token_ids(engine.tokenizer, engine.model.vocab_size)
        workload = build_workload(args.num_requests, args.min_len, args.max_len, args.seed, allowed)
        b1_prompt = batch1_prompt(args.b1_prompt_len, args.seed, allowed)
        part = {"path": Path(engine.model.path), "tokenizer": engine.tokenizer, "workload": workload,
                "b1_prompt": b1_prompt, "max_step_tokens": engine.config.max_step_tokens}
        part["ours"] = guarded("ksana_llm throughput", errors, lambda: run_ours(engine, workload))
        part["ours_b1"] = None if args.skip_batch1 else guarded(
            "ksana_llm batch-1", errors,
            lambda: ours_batch1(engine, b1_prompt, args.b1_new_tokens, args.b1_repeats))
        return part
    finally:
        engine.shutdown()
        gc.collect()


def run_peers(args: argparse.Namespace, part: dict[str, Any], errors: dict[str, str]) -> dict[str, Any]:
    peers: dict[str, Any] = {}
    if args.peers == "none":
        return peers
    model = guarded("HF model load", errors, lambda: load_hf_model(part["path"], args.dtype))
    if model is None:
        return peers
    workload: Workload = part["workload"]
    pad_id = pad_token_id(model, part["tokenizer"])
    if wants(args, "generate"):
        bs = args.hf_batch_size or len(workload.prompts)
        peers["generate"] = guarded("HF generate throughput", errors,
                                    lambda: run_hf_generate(model, workload, bs, pad_id))
        if not args.skip_batch1:
            peers["generate_b1"] = guarded(
                "HF generate batch-1", errors,
                lambda: hf_batch1(model, part["b1_prompt"], args.b1_new_tokens, pad_id, args.b1_repeats))
    if wants(args, "generate_batch"):
        peers["generate_batch"] = guarded(
            "HF generate_batch throughput", errors,
            lambda: run_hf_continuous(model, workload, args.hf_cb_page_size,
                                      args.max_batch_size or part["max_step_tokens"], args.hf_cb_timeout))
    return peers


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    errors: dict[str, str] = {}
    part = run_engine_part(args, errors)
    peers = run_peers(args, part, errors)
    workload: Workload = part["workload"]

    throughput = [r for r in (part["ours"], peers.get("generate"), peers.get("generate_batch")) if r]
    latency = [r for r in (part["ours_b1"], peers.get("generate_b1")) if r]
    compare_tokens(throughput)
    print()
    print(throughput_table(throughput, workload))
    if latency:
        print()
        print(latency_table(latency, args.b1_prompt_len, args.b1_new_tokens))
    for r in throughput:
        if r.notes:
            print(f"- {r.name}: {r.notes}")
    for name, err in errors.items():
        print(f"- FAILED {name}: {err}")

    if args.json_out is not None:
        report = {"args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
                  "model_path": str(part["path"]), "workload": workload.summary(),
                  "environment": environment(),
                  "throughput": [r.to_json() for r in throughput],
                  "batch1": [asdict(r) for r in latency], "errors": errors}
        args.json_out.parent.mkdir(parents=True, exist_ok=True)
        args.json_out.write_text(json.dumps(report, indent=2))
        print(f"\nwrote {args.json_out}")
    ok = part["ours"] is not None and part["ours"].exact_lengths
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
