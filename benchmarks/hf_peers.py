"""The Hugging Face peers of the offline benchmarks, on the workload of `benchmarks.workload`:
static-batch `generate`, transformers' continuous batching (`generate_batch`'s manager, one
request per `add_request` so each keeps its own output length) and batch-1 decode latency
(see `benchmarks/offline_throughput.py` for how each is measured)."""

from __future__ import annotations

import math
import statistics
import time
from pathlib import Path
from typing import Any

import torch

from benchmarks.workload import LatencyResult, ThroughputResult, Workload


# ---- Hugging Face: shared -------------------------------------------------------------------------
def load_hf_model(path: Path, dtype: str) -> Any:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=getattr(torch, dtype),
                                                 attn_implementation="sdpa")
    return model.eval()


def pad_token_id(model: Any, tokenizer: Any) -> int:
    for candidate in (getattr(tokenizer, "pad_token_id", None), model.generation_config.pad_token_id,
                      getattr(tokenizer, "eos_token_id", None), model.config.eos_token_id):
        if isinstance(candidate, list):
            candidate = candidate[0] if candidate else None
        if isinstance(candidate, int):
            return candidate
    return 0


# ---- Hugging Face generate (static batches) -------------------------------------------------------
def left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for row, p in enumerate(prompts):
        ids[row, width - len(p):] = torch.tensor(p, dtype=torch.long)
        mask[row, width - len(p):] = 1
    return ids, mask


def hf_generate_batch(model: Any, prompts: list[list[int]], new_tokens: int, pad_id: int,
                      streamer: Any = None) -> torch.Tensor:
    """Greedy generate that always runs exactly `new_tokens` steps; returns the new tokens."""
    ids, mask = left_pad(prompts, pad_id)
    with torch.inference_mode():
        out = model.generate(input_ids=ids, attention_mask=mask, max_new_tokens=new_tokens,
                             min_new_tokens=new_tokens, do_sample=False, pad_token_id=pad_id,
                             streamer=streamer)
    return out[:, ids.shape[1]:]


def run_hf_generate(model: Any, workload: Workload, batch_size: int, pad_id: int) -> ThroughputResult:
    """Static left-padded batches, each run to the longest output in the batch."""
    hf_generate_batch(model, [p[:8] for p in workload.prompts[:2]], 2, pad_id)  # warm-up
    useful = raw = 0
    exact = True
    token_ids: list[list[int]] = []
    start = time.perf_counter()
    for lo in range(0, len(workload.prompts), batch_size):
        prompts = workload.prompts[lo:lo + batch_size]
        lens = workload.output_lens[lo:lo + batch_size]
        new = hf_generate_batch(model, prompts, max(lens), pad_id)
        raw += new.numel()
        exact &= new.shape[1] == max(lens)
        useful += sum(min(n, new.shape[1]) for n in lens)
        token_ids.extend(new[row, :n].tolist() for row, n in enumerate(lens))
    wall = time.perf_counter() - start
    return ThroughputResult(f"HF generate (static, bs={batch_size})", wall, useful, raw, exact,
                            f"raw generated tokens incl. padding rows: {raw}", token_ids)


class _TokenTimer:
    """A generate streamer that stamps each generated token (the first `put` is the prompt)."""

    def __init__(self) -> None:
        self.stamps: list[float] = []
        self._seen_prompt = False

    def put(self, value: torch.Tensor) -> None:
        if not self._seen_prompt:
            self._seen_prompt = True
            return
        self.stamps.append(time.perf_counter())

    def end(self) -> None:
        pass


def hf_batch1(model: Any, prompt: list[int], new_tokens: int, pad_id: int,
              repeats: int) -> LatencyResult:
    hf_generate_batch(model, [prompt[:8]], 2, pad_id)  # warm-up
    per_token, ttfts = [], []
    for _ in range(repeats):
        timer = _TokenTimer()
        start = time.perf_counter()
        new = hf_generate_batch(model, [prompt], new_tokens, pad_id, streamer=timer)
        if new.shape[1] != new_tokens or len(timer.stamps) != new_tokens:
            raise RuntimeError(f"HF batch-1 produced {new.shape[1]} tokens (wanted {new_tokens})")
        per_token.append((timer.stamps[-1] - timer.stamps[0]) / (new_tokens - 1) * 1e3)
        ttfts.append((timer.stamps[0] - start) * 1e3)
    return LatencyResult("HF generate", statistics.median(per_token), statistics.median(ttfts),
                         per_token)


# ---- Hugging Face continuous batching -------------------------------------------------------------
def cb_configs(model: Any, workload: Workload, page_size: int, max_batch_tokens: int) -> tuple[Any, Any, Any]:
    """(GenerationConfig, ContinuousBatchingConfig, WorkloadHints) sized for this workload."""
    from transformers import GenerationConfig
    from transformers.generation import ContinuousBatchingConfig
    from transformers.generation.continuous_batching.utils import WorkloadHints

    gen = GenerationConfig(max_new_tokens=max(workload.output_lens), do_sample=False,
                           eos_token_id=-1, pad_token_id=model.generation_config.pad_token_id)
    blocks = sum(math.ceil((len(p) + n) / page_size) + 1
                 for p, n in zip(workload.prompts, workload.output_lens))
    cb = ContinuousBatchingConfig(page_size=page_size, num_blocks=blocks + 8,
                                  max_batch_tokens=max_batch_tokens, scheduler_type="fifo")
    hints = WorkloadHints(max_prompt_length=max(len(p) for p in workload.prompts),
                          max_generated_length=max(workload.output_lens),
                          num_requests=len(workload.prompts))
    return gen, cb, hints


def cb_session(model: Any, configs: tuple[Any, Any, Any], requests: list[tuple[list[int], int]],
               timeout_s: float) -> tuple[float, list[list[int]]]:
    """One manager session: (wall seconds from first add_request to last result, tokens per request)."""
    gen, cb, hints = configs
    # warmup=True builds the batch processor (and its KV cache) before we start the clock;
    # on CPU it runs no forward pass (there are no CUDA graphs to capture).
    with model.continuous_batching_context_manager(generation_config=gen, continuous_batching_config=cb,
                                                   workload_hints=hints, warmup=True,
                                                   block=True) as manager:
        start = time.perf_counter()
        ids = [manager.add_request(input_ids=p, request_id=f"bench-{i}", max_new_tokens=n,
                                   eos_token_id=-1) for i, (p, n) in enumerate(requests)]
        tokens = collect_cb_results(manager, set(ids), start + timeout_s)
        wall = time.perf_counter() - start
    return wall, [tokens[i] for i in ids]


def collect_cb_results(manager: Any, pending: set[str], deadline: float) -> dict[str, list[int]]:
    done: dict[str, list[int]] = {}
    while pending:
        if time.perf_counter() > deadline:
            raise TimeoutError(f"HF continuous batching: {len(pending)} requests unfinished at the timeout")
        result = manager.get_result(timeout=1.0)
        if result is None:
            if not manager.is_running():
                raise RuntimeError("the HF continuous-batching thread stopped "
                                   f"with {len(pending)} requests unfinished")
            continue
        if result.request_id in pending and result.is_finished():
            if result.error is not None:
                raise RuntimeError(f"request {result.request_id} failed: {result.error}")
            done[result.request_id] = list(result.generated_tokens)
            pending.discard(result.request_id)
    return done


def run_hf_continuous(model: Any, workload: Workload, page_size: int, max_batch_tokens: int,
                      timeout_s: float) -> ThroughputResult:
    warm = Workload([p[:8] for p in workload.prompts[:2]], [4, 4])
    cb_session(model, cb_configs(model, warm, page_size, max_batch_tokens),
               list(zip(warm.prompts, warm.output_lens)), timeout_s)
    configs = cb_configs(model, workload, page_size, max_batch_tokens)
    wall, tokens = cb_session(model, configs, list(zip(workload.prompts, workload.output_lens)),
                              timeout_s)
    got = [len(t) for t in tokens]
    bad = [(i, g, w) for i, (g, w) in enumerate(zip(got, workload.output_lens)) if g != w]
    notes = (f"manager add_request(max_new_tokens=per request), sdpa, page_size={page_size}, "
             f"max_batch_tokens={max_batch_tokens}")
    if bad:
        notes += f"; length mismatches (idx, got, want): {bad[:5]}"
    return ThroughputResult("HF generate_batch (continuous)", wall,
                            sum(min(g, w) for g, w in zip(got, workload.output_lens)), sum(got),
                            not bad, notes, tokens)
