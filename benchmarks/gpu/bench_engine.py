"""The reference workload on the GPU: our Engine against HF `generate_batch`, one run per model.

    python -m benchmarks.gpu.bench_engine --models qwen3-0.6b --out DIR   # one model
    python -m benchmarks.gpu.bench_engine --smoke --out DIR               # tiny shapes on CPU

Models (benchmarks/gpu/engine_models.py): random-init Hugging Face models with the real shapes
of Qwen3-0.6B and Llama-3-8B (DESIGN.md §6), and 12 of Qwen3-30B-A3B's layers (MoE), built on
the device in bf16, saved as safetensors into a temp folder (in /dev/shm when it has room) and
loaded by `Model.from_pretrained` like any checkpoint. No tokenizer: prompts are token ids.

Workload (DESIGN.md §6, nano-vllm's): 256 requests, input and output lengths uniform in
[100, 1024], seed 0, random token ids, EOS ignored (every request produces exactly its length);
the workload code is `benchmarks/workload.py`'s, shared with the CPU benchmark. Output
tokens/s = all output tokens / wall time from submitting the first request to the last result.

Per model, in one process:
1. ksana_llm with CUDA graphs on: start-up (KV profile, graph capture), a warm-up, the workload,
   batch-1 decode (ms per output token after the first, median of repeats).
2. ksana_llm with CUDA graphs off on the same weights: batch-1 decode, and the workload too
   for Qwen3-0.6B (the model with a throughput target).
3. HF `generate_batch` (transformers' continuous batching, its default attention and graphs) on
   the same weights and requests, per-request output lengths through the manager as in
   offline_throughput.py, same token budget per step. It stops at `--hf-time-cap` seconds (per
   model by default) if not done: its tokens/s is then measured over that window (finished
   requests plus tokens of requests still running) -- an estimate of the full-run rate, not a
   bound, and the JSON says so ("complete": false, "extrapolated"). HF generate batch-1 decode
   is timed too.

Engine settings: 8192 tokens and 256 sequences per step, max_model_len 2048, recompute on
preemption (no pinned host swap pool), KV cache from the engine's own sizing.

Each model writes `engine_<model>.json` into --out; a summary table is printed last. A failing
step is recorded in the JSON ("errors") and the others still run; the exit status is non-zero
when ours failed or produced a wrong number of tokens.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shutil
import sys
import time
from dataclasses import asdict
from pathlib import Path
from types import MappingProxyType
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file as well as with -m
    sys.path.insert(0, str(REPO))

import ksana_llm as kt  # noqa: E402
from ksana_llm.config import KV_CACHE_DTYPES, WEIGHT_QUANTIZATIONS  # noqa: E402
from benchmarks.gc_pauses import GcPauses  # noqa: E402
from benchmarks.gpu.engine_models import (SPECS, ModelSpec, build_checkpoint,  # noqa: E402
                                          hf_config, model_shape, temp_root)
from benchmarks.gpu.int4_checkpoint import rewrite_as_w4a16  # noqa: E402
from benchmarks.gpu.engine_report import check_targets, summary  # noqa: E402
from benchmarks.gpu.hf_peer import run_hf  # noqa: E402
from benchmarks.offline_throughput import guarded, ours_batch1, run_ours  # noqa: E402
from benchmarks.workload import (ThroughputResult, Workload, allowed_token_ids,  # noqa: E402
                                 batch1_prompt, build_workload)

# An engine switch on the command line: auto = the engine's default for the device.
SWITCH = MappingProxyType({"auto": None, "on": True, "off": False})

# ---- helpers --------------------------------------------------------------------------------------
def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()


def runner_of(engine: kt.Engine) -> Any:
    """The engine's (rank-0) model runner, for its CUDA-graph status and block count."""
    runner = getattr(getattr(engine, "_core", None), "runner", None)
    return getattr(runner, "local", runner)


def engine_facts(engine: kt.Engine, startup_s: float) -> dict[str, Any]:
    runner = runner_of(engine)
    graphs = getattr(runner, "decode_graphs", None)
    core = getattr(engine, "_core", None)
    return {"startup_s": round(startup_s, 2),
            "status": getattr(runner, "cuda_graph_status", "unknown (runner has no status)"),
            "graph_steps": None if graphs is None else graphs.steps_run,
            "capture_s": None if graphs is None else round(graphs.capture_seconds, 2),
            "kv_blocks": getattr(getattr(core, "block_manager", None), "num_blocks", None),
            "overlap_outputs": getattr(core, "overlap_outputs", None),
            "async_scheduling": getattr(core, "async_scheduling", None),
            "steps_ahead": getattr(core, "num_steps_ahead", None),
            "max_model_len": getattr(engine, "max_model_len", None)}


def throughput_json(result: ThroughputResult | None, workload: Workload) -> dict[str, Any] | None:
    if result is None:
        return None
    return {"wall_s": round(result.wall_s, 3), "output_tokens": result.useful_tokens,
            "output_tokens_per_s": round(result.tokens_per_s, 1),
            "exact_lengths": result.exact_lengths,
            "requests": len(workload.prompts), "notes": result.notes}


def warm_up(engine: kt.Engine, workload: Workload) -> None:
    """A few requests of assorted lengths so kernel variants compile outside the timed run."""
    prompts = [p[:n] for p, n in zip(workload.prompts[:16], (16, 40, 100, 300) * 4)]
    configs = [kt.GenerationConfig(max_new_tokens=n, ignore_eos=True)
               for n in (4, 9, 17, 33) * 4][:len(prompts)]
    engine.generate_outputs(prompts, configs, use_tqdm=False)


# ---- ours -----------------------------------------------------------------------------------------
def engine_kwargs(args: argparse.Namespace, graphs: bool) -> dict[str, Any]:
    kwargs = dict(max_batch_size=args.max_step_tokens, max_num_seqs=args.max_num_seqs,
                  max_model_len=args.max_model_len, enable_cuda_graphs=graphs,
                  # Recompute on preemption: no host swap pool (it would pin as much host
                  # memory as the device cache holds).
                  preempt_mode=1,
                  overlap_output_processing=SWITCH[args.overlap],
                  async_scheduling=SWITCH[args.async_scheduling],
                  kv_cache_dtype=args.kv_cache_dtype)
    if args.kv_ratio is not None:
        kwargs["block_device_memory_ratio"] = args.kv_ratio
    if args.num_device_blocks is not None:
        kwargs["num_device_blocks"] = args.num_device_blocks
    if args.lora_modules:
        kwargs.update(lora_modules=args.lora_modules, max_lora_rank=args.lora_rank)
    return kwargs


# The projections a LoRA run's random adapters target: every one our engine adapts.
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def write_lora_adapters(hf_model: Any, root: Path, count: int, rank: int) -> dict[str, str]:
    """`count` random adapters of `hf_model` (rank `rank`, every projection), written in PEFT's
    format under root/lora; name -> folder."""
    from ksana_llm.loader.lora import save_lora_adapter

    folders = {}
    for i in range(count):
        generator = torch.Generator().manual_seed(100 + i)
        modules = {}
        for name, module in hf_model.named_modules():
            if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in LORA_TARGETS:
                modules[name] = (
                    torch.randn(rank, module.in_features, generator=generator) * 0.02,
                    torch.randn(module.out_features, rank, generator=generator) * 0.02)
        folders[f"adapter{i}"] = str(root / "lora" / f"adapter{i}")
        save_lora_adapter(folders[f"adapter{i}"], modules, lora_alpha=2 * rank)
    return folders


def workload_loras(args: argparse.Namespace, workload: Workload) -> list[str | None] | None:
    """Request i's adapter (round robin over the adapters), or None without a LoRA run."""
    names = sorted(args.lora_modules or {})
    return [names[i % len(names)] for i in range(len(workload.prompts))] if names else None


def run_ours_engine(model: kt.Model, workload: Workload, args: argparse.Namespace, *,
                    graphs: bool, throughput: bool, b1_prompt: list[int],
                    errors: dict[str, str]) -> dict[str, Any]:
    label = "graphs on" if graphs else "graphs off"
    start = time.perf_counter()
    engine = guarded(f"ksana_llm start ({label})", errors,
                     lambda: kt.Engine(model, **engine_kwargs(args, graphs)))
    if engine is None:
        return {}
    out: dict[str, Any] = {}
    try:
        out["facts"] = engine_facts(engine, time.perf_counter() - start)
        print(f"[bench] CUDA graphs: {out['facts']['status']}; KV blocks "
              f"{out['facts']['kv_blocks']}", flush=True)
        guarded(f"ksana_llm warm-up ({label})", errors, lambda: warm_up(engine, workload))
        if throughput:
            with GcPauses() as pauses:
                out["throughput"] = guarded(f"ksana_llm workload ({label})", errors,
                                            lambda: run_ours(engine, workload,
                                                             workload_loras(args, workload)))
            out["gc"] = pauses.summary()
            print(f"[bench] garbage collector in the workload ({label}): {pauses.describe()}",
                  flush=True)
        b1 = guarded(f"ksana_llm batch-1 ({label})", errors,
                     lambda: ours_batch1(engine, b1_prompt, args.b1_new_tokens, args.b1_repeats,
                                         lora=min(args.lora_modules) if args.lora_modules
                                         else None))
        out["batch1"] = None if b1 is None else asdict(b1)
        out["facts"] = {**engine_facts(engine, out["facts"]["startup_s"])}
    finally:
        engine.shutdown()
        engine = None  # noqa: F841 - drop the last reference before freeing device memory
        free_memory(model.device)
    return out


# ---- one model ------------------------------------------------------------------------------------
def bench_model(spec: ModelSpec, args: argparse.Namespace, device: torch.device,
                dtype: torch.dtype) -> dict[str, Any]:
    errors: dict[str, str] = {}
    timings: dict[str, float] = {}
    config = hf_config(spec, args.smoke)
    num_experts = getattr(config, "num_experts", None) or getattr(config, "n_routed_experts", 0)
    experts_per_layer = num_experts * 3 * config.hidden_size \
        * getattr(config, "moe_intermediate_size", 0)
    params_bytes = 2 * (config.vocab_size * config.hidden_size * 2 + config.num_hidden_layers
                        * (12 * config.hidden_size ** 2 + experts_per_layer))
    root = temp_root(params_bytes)
    report: dict[str, Any] = {"model": spec.name, "kv_cache_dtype": args.kv_cache_dtype,
                              # ours with FP8 projection weights; HF generate_batch in bf16
                              "quantization": "int4 checkpoint (W4A16, groups of 128)"
                              if args.int4_weights else args.quantization,
                              # ours with random adapters, round robin over the requests; HF
                              # generate_batch runs the base model
                              "lora": {"adapters": args.lora_adapters, "rank": args.lora_rank}
                              if args.lora_adapters else None,
                              "shape": model_shape(spec, args.smoke),
                              "device": torch.cuda.get_device_name(device)
                              if device.type == "cuda" else "cpu",
                              "dtype": str(dtype).removeprefix("torch."), "smoke": args.smoke,
                              # decode attention's settings from the environment, if any
                              # (`tuned_settings`: the tuning sweep's fastest)
                              "decode_env": {k: v for k, v in os.environ.items()
                                             if k.startswith("KSANA_DECODE_")},
                              "tag": args.tag}
    try:
        t0 = time.perf_counter()
        hf_model, folder = build_checkpoint(spec, device, dtype, args.smoke, root)
        if args.int4_weights:  # ours reads 4-bit weights (W4A16); HF keeps the 16-bit model
            rewrite_as_w4a16(folder, 32 if args.smoke else 128, str(device))
        args.lora_modules = write_lora_adapters(hf_model, root, args.lora_adapters,
                                                args.lora_rank) if args.lora_adapters else {}
        timings["build_and_save_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        model = kt.Model.from_pretrained(folder, device=str(device),
                                         dtype=str(dtype).removeprefix("torch."), progress=False,
                                         quantization=args.quantization)
        timings["load_ours_s"] = time.perf_counter() - t0
        allowed = allowed_token_ids(None, config.vocab_size)
        workload = build_workload(args.num_requests, args.min_len, args.max_len, args.seed, allowed)
        b1_prompt = batch1_prompt(args.b1_prompt_len, args.seed, allowed)
        report["workload"] = workload.summary()
        report["engine_config"] = {k: v for k, v in engine_kwargs(args, True).items()
                                   if k not in ("enable_cuda_graphs", "lora_modules")}

        t0 = time.perf_counter()
        on = run_ours_engine(model, workload, args, graphs=True, throughput=True,
                             b1_prompt=b1_prompt, errors=errors)
        timings["ours_graphs_on_s"] = time.perf_counter() - t0
        off: dict[str, Any] = {}
        hf: dict[str, Any] = {"throughput": None}
        if not args.ours_only:  # (--ours-only: a variant of ours, the peers measured before)
            t0 = time.perf_counter()
            off = run_ours_engine(model, workload, args, graphs=False,
                                  throughput=spec.off_throughput or args.smoke,
                                  b1_prompt=b1_prompt, errors=errors)
            timings["ours_graphs_off_s"] = time.perf_counter() - t0
        del model
        free_memory(device)

        if not args.ours_only:
            t0 = time.perf_counter()
            cap = args.hf_time_cap if args.hf_time_cap is not None else spec.hf_time_cap_s
            hf = run_hf(hf_model, workload, b1_prompt, args, cap, errors)
            timings["hf_s"] = time.perf_counter() - t0
        del hf_model
        free_memory(device)
    finally:
        shutil.rmtree(root, ignore_errors=True)

    ours_tp = throughput_json(on.get("throughput"), workload)
    hf_tp = hf["throughput"]
    report["cuda_graphs"] = {"on": on.get("facts"), "off": off.get("facts")}
    # The collector's passes during our timed runs (a full one stalls the step loop).
    report["gc_during_workload"] = {"on": on.get("gc"), "off": off.get("gc")}
    report["throughput"] = {"ksana_llm": ours_tp,
                            "ksana_llm_graphs_off": throughput_json(off.get("throughput"), workload),
                            "hf_generate_batch": hf_tp}
    ratio = None
    if ours_tp and hf_tp and hf_tp["output_tokens_per_s"] > 0:
        ratio = round(ours_tp["output_tokens_per_s"] / hf_tp["output_tokens_per_s"], 2)
    report["ratio_vs_hf_generate_batch"] = ratio
    report["batch1"] = {"prompt_len": args.b1_prompt_len, "new_tokens": args.b1_new_tokens,
                        "graphs_on": on.get("batch1"), "graphs_off": off.get("batch1"),
                        "hf_generate": hf.get("batch1")}
    report["targets"] = check_targets(spec, report) if not args.smoke else {
        "note": "smoke run on CPU: targets apply to the H200 run only"}
    report["timings_s"] = {k: round(v, 1) for k, v in timings.items()}
    report["errors"] = errors
    return report


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="qwen3-0.6b,llama-3-8b",
                   help=f"comma-separated, from {', '.join(SPECS)}")
    p.add_argument("--out", type=Path,
                   default=Path(os.environ.get("OUT") or REPO / "benchmarks/gpu/results"))
    p.add_argument("--summarize", type=Path, default=None, metavar="DIR",
                   help="only print the summary table of the engine_*.json files in DIR")
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes on CPU, a few short requests: checks the script end to end")
    p.add_argument("--num-requests", type=int, default=256)
    p.add_argument("--kv-cache-dtype", default="auto", choices=KV_CACHE_DTYPES,
                   help="our engine's KV cache storage (HF keeps its own dtype)")
    p.add_argument("--quantization", default=None, choices=WEIGHT_QUANTIZATIONS,
                   help="our engine's weights: fp8 = the projections as FP8 (per-row scales)")
    p.add_argument("--int4-weights", action="store_true",
                   help="our engine reads the checkpoint rewritten as llm-compressor W4A16 "
                        "(symmetric int4, groups of 128; held packed, the Triton W4A16 matmul)")
    p.add_argument("--min-len", type=int, default=100)
    p.add_argument("--max-len", type=int, default=1024)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-step-tokens", type=int, default=8192,
                   help="our token budget per step, and HF's max_batch_tokens")
    p.add_argument("--max-num-seqs", type=int, default=256)
    p.add_argument("--max-model-len", type=int, default=2048)
    p.add_argument("--kv-ratio", type=float, default=None,
                   help="block_device_memory_ratio (default: the engine's)")
    p.add_argument("--num-device-blocks", type=int, default=None,
                   help="explicit KV block count (default: profiled from free memory)")
    p.add_argument("--overlap", choices=tuple(SWITCH), default="auto",
                   help="overlap output processing with the next step (auto: on for CUDA)")
    p.add_argument("--async-scheduling", choices=tuple(SWITCH), default="auto",
                   help="plan and launch each step before the previous one's tokens are read "
                        "back (auto: on for CUDA)")
    p.add_argument("--hf-time-cap", type=float, default=None,
                   help="seconds before HF generate_batch is stopped (default: per model)")
    p.add_argument("--hf-page-size", type=int, default=256)
    p.add_argument("--hf-static-batch", type=int, default=64,
                   help="HF generate's batch size where continuous batching cannot run the "
                        "model (MLA)")
    p.add_argument("--lora-adapters", type=int, default=0,
                   help="serve the workload through this many random LoRA adapters (round robin; "
                        "batch-1 on the first); HF runs the base model")
    p.add_argument("--lora-rank", type=int, default=16)
    p.add_argument("--b1-prompt-len", type=int, default=128)
    p.add_argument("--b1-new-tokens", type=int, default=128)
    p.add_argument("--b1-repeats", type=int, default=2)
    p.add_argument("--ours-only", action="store_true",
                   help="only our engine with CUDA graphs (throughput and batch-1): for "
                        "comparing a variant of ours, e.g. other decode settings")
    p.add_argument("--tag", default="",
                   help="a name for this variant: in the summary and the JSON file's name")
    args = p.parse_args(argv)
    args.lora_modules = {}  # name -> folder, written per model by bench_model
    if args.smoke:
        args.num_requests, args.min_len, args.max_len = 6, 8, 24
        args.max_step_tokens, args.max_num_seqs, args.max_model_len = 64, 8, 128
        args.b1_prompt_len, args.b1_new_tokens, args.b1_repeats = 8, 6, 1
        args.hf_page_size, args.num_device_blocks = 16, 256
    unknown = [m for m in args.models.split(",") if m not in SPECS]
    if unknown:
        p.error(f"unknown model(s) {unknown}; choose from {', '.join(SPECS)}")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.summarize is not None:
        reports = [json.loads(p.read_text()) for p in sorted(args.summarize.glob("engine_*.json"))]
        print(summary(reports) if reports else f"no engine_*.json in {args.summarize}")
        return 0
    if args.smoke:
        device, dtype = torch.device("cpu"), torch.float32
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke for a CPU check of the script)")
        device, dtype = torch.device("cuda"), torch.bfloat16
    reports = []
    ok = True
    for name in args.models.split(","):
        start = time.perf_counter()
        report = bench_model(SPECS[name], args, device, dtype)
        report["total_s"] = round(time.perf_counter() - start, 1)
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "" if args.kv_cache_dtype == "auto" else f"-kv-{args.kv_cache_dtype}"
        suffix += f"-lora{args.lora_adapters}" if args.lora_adapters else ""
        suffix += f"-w{args.quantization}" if args.quantization else ""
        suffix += "-wint4" if args.int4_weights else ""
        suffix += f"-{args.tag}" if args.tag else ""
        path = args.out / f"engine_{name}{suffix}.json"
        path.write_text(json.dumps(report, indent=2) + "\n")
        print(f"wrote {path} ({report['total_s']} s)", flush=True)
        ours = report["throughput"]["ksana_llm"]
        ok &= bool(ours and ours["exact_lengths"])
        reports.append(report)
    print(summary(reports))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
