"""HF `generate_batch` (transformers' continuous batching) as the GPU benchmark's peer: the
reference workload through its manager with per-request output lengths, stopped at a time cap
if not done (its tokens/s then measured over that window, and the JSON says so), and HF
`generate` at batch 1 on the model's device. Used by `bench_engine.py`. MLA models, which
transformers' continuous batching cannot run, get HF `generate` in static batches instead.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import asdict
from typing import Any

import torch

from benchmarks.hf_peers import hf_batch1, hf_generate_batch, pad_token_id
from benchmarks.offline_throughput import guarded
from benchmarks.workload import Workload


def cb_configs(model: Any, workload: Workload, page_size: int, max_batch_tokens: int
               ) -> tuple[Any, Any, Any]:
    """hf_peers.cb_configs for any transformers 5: the KV page size is the
    `ContinuousBatchingConfig` field `page_size` from 5.18 on, `block_size` before (the GPU
    image has 5.17)."""
    import dataclasses

    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False,
                           eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    blocks = sum(-(-(len(p) + n) // page_size) + 1
                 for p, n in zip(workload.prompts, workload.output_lens))
    names = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    page_field = "page_size" if "page_size" in names else "block_size"
    cb = ContinuousBatchingConfig(**{page_field: page_size}, num_blocks=blocks + 8,
                                  max_batch_tokens=max_batch_tokens, scheduler_type="fifo")
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.output_lens),
                          num_requests=len(workload.prompts))
    return gen, cb, hints


def in_flight_tokens(manager: Any, pending: set[str]) -> int | None:
    """Tokens generated so far by requests still running (transformers internals; None when
    this transformers keeps them elsewhere)."""
    try:
        states = manager.batch_processor.scheduler.active_requests
        return sum(len(states[r].generated_tokens) for r in pending if r in states)
    except Exception:  # noqa: BLE001 - best effort across transformers versions
        return None


def run_hf_capped(model: Any, workload: Workload, page_size: int, max_batch_tokens: int,
                  cap_s: float) -> dict[str, Any]:
    """hf_peers.py's continuous-batching session, stopped at `cap_s` if not done.
    HF's own warm-up (`warmup=True`: CUDA-graph capture at the largest sizes) runs before the
    clock starts, as our engine's start-up does."""
    gen, cb, hints = cb_configs(model, workload, page_size, max_batch_tokens)
    want = {f"bench-{i}": n for i, n in enumerate(workload.output_lens)}
    done: dict[str, int] = {}
    with model.continuous_batching_context_manager(generation_config=gen,
                                                   continuous_batching_config=cb,
                                                   workload_hints=hints, warmup=True,
                                                   block=True) as manager:
        start = time.perf_counter()
        for (rid, n), prompt in zip(want.items(), workload.prompts):
            manager.add_request(input_ids=prompt, request_id=rid, max_new_tokens=n,
                                eos_token_id=-1)
        deadline = start + cap_s
        while len(done) < len(want) and time.perf_counter() < deadline:
            result = manager.get_result(timeout=max(0.01, min(1.0, deadline - time.perf_counter())))
            if result is None:
                if not manager.is_running():
                    raise RuntimeError("the HF continuous-batching thread stopped")
                continue
            if result.request_id in want and result.is_finished():
                if result.error is not None:
                    raise RuntimeError(f"request {result.request_id} failed: {result.error}")
                done[result.request_id] = len(result.generated_tokens)
        wall = time.perf_counter() - start
        unfinished = set(want) - set(done)
        partial = in_flight_tokens(manager, unfinished)
        # Leaving the manager waits for every request it holds: cancel the rest first, or the
        # cap saves no time (an H200 run spent 164 s past a 60 s cap finishing them).
        for rid in unfinished:
            manager.cancel_request(rid)
        stopping = time.perf_counter()
    stop_s = time.perf_counter() - stopping
    complete = len(done) == len(want)
    counted = sum(done.values()) + (partial or 0)
    rate = counted / wall if wall > 0 else float("nan")
    wrong = [r for r, n in done.items() if n != want[r]]
    out = {"complete": complete, "wall_s": round(wall, 3), "requests_finished": len(done),
           "requests": len(want), "output_tokens_counted": counted,
           "output_tokens_per_s": round(rate, 1), "exact_lengths": not wrong,
           "in_flight_tokens_counted": partial is not None, "stop_s": round(stop_s, 2),
           "notes": f"manager add_request(max_new_tokens=per request), page_size={page_size}, "
                    f"max_batch_tokens={max_batch_tokens}"}
    if not complete:
        out["extrapolated"] = (
            f"stopped at the {cap_s:.0f} s cap with {len(done)}/{len(want)} requests finished; "
            "tokens/s is measured over that window (finished requests plus the tokens of "
            f"running ones{'' if partial is not None else ' (not readable: not counted)'}). "
            "An estimate of the full-run rate, not a bound: the window holds the prefill-heavy "
            "start and leaves out the low-concurrency tail. Projected full run: "
            f"{workload.output_tokens / rate:.0f} s" if rate > 0 else "no tokens by the cap")
    return out


class GenerateOnDevice:
    """The HF model, for hf_peers's HF generate helpers, which build their input
    tensors on the CPU: moves them to the model's device first."""

    def __init__(self, model: Any) -> None:
        self.model = model

    def generate(self, **kwargs: Any) -> Any:
        device = self.model.device
        return self.model.generate(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                                      for k, v in kwargs.items()})


def run_hf_static_capped(model: Any, workload: Workload, batch_size: int, pad_id: int,
                         cap_s: float) -> dict[str, Any]:
    """HF `generate` in static left-padded batches of `batch_size` (each run to its longest
    output), in workload order, stopped after the batch that passes `cap_s`: for models
    transformers' continuous batching cannot run (its paged cache has no MLA layout). Its
    tokens/s counts each finished request's own length over the batches run."""
    model = GenerateOnDevice(model)
    hf_generate_batch(model, [p[:8] for p in workload.prompts[:2]], 2, pad_id)  # warm-up
    useful = finished = 0
    start = time.perf_counter()
    for lo in range(0, len(workload.prompts), batch_size):
        lens = workload.output_lens[lo:lo + batch_size]
        hf_generate_batch(model, workload.prompts[lo:lo + batch_size], max(lens), pad_id)
        useful, finished = useful + sum(lens), finished + len(lens)
        if time.perf_counter() - start > cap_s:
            break
    wall = time.perf_counter() - start
    out = {"complete": finished == len(workload.prompts), "wall_s": round(wall, 3),
           "requests_finished": finished, "requests": len(workload.prompts),
           "output_tokens_counted": useful, "output_tokens_per_s": round(useful / wall, 1),
           "exact_lengths": True,
           "notes": f"HF generate, static batches of {batch_size} (continuous batching cannot "
                    "run this model)"}
    if not out["complete"]:
        out["extrapolated"] = (f"stopped after the batch that passed the {cap_s:.0f} s cap: "
                               f"{finished}/{len(workload.prompts)} requests")
    return out


def run_hf(hf_model: Any, workload: Workload, b1_prompt: list[int], args: argparse.Namespace,
           cap_s: float, errors: dict[str, str]) -> dict[str, Any]:
    pad_id = pad_token_id(hf_model, None)
    if getattr(hf_model.config, "kv_lora_rank", None):  # MLA: no paged cache in transformers
        out = {"throughput": guarded(
            "HF generate (static batches) workload", errors,
            lambda: run_hf_static_capped(hf_model, workload, args.hf_static_batch, pad_id,
                                         cap_s))}
    else:
        out = {"throughput": guarded(
            "HF generate_batch workload", errors,
            lambda: run_hf_capped(hf_model, workload, args.hf_page_size, args.max_step_tokens,
                                  cap_s))}
    b1 = guarded("HF generate batch-1", errors,
                 lambda: hf_batch1(GenerateOnDevice(hf_model), b1_prompt, args.b1_new_tokens,
                                   pad_id, 1))
    out["batch1"] = None if b1 is None else asdict(b1)
    return out
