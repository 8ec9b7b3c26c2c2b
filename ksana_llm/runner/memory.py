"""How many KV blocks fit: from an explicit count, or a share of free device memory / RAM.

On CUDA the count comes from a profiling step (`plan_device_blocks`): before the cache exists, the
largest step the scheduler can build (`max_step_tokens` tokens, `max_num_seqs` sampled rows) runs
once through a runner with a tiny cache, and its peak memory is what the weights, the CUDA context
and the activations need. What remains of `block_device_memory_ratio` of the device, less
`reserved_device_memory_ratio` of it, holds KV blocks.
"""

from __future__ import annotations

import gc
import logging
import os
from dataclasses import dataclass

import torch
from torch import nn

from ksana_llm.generation_config import MAX_LOGPROBS, GenerationConfig
from ksana_llm.kernels.kv_quant import cache_dtype_for
from ksana_llm.layers.linear import available_memory_bytes
from ksana_llm.runner.model_runner import (ModelRunner, SeqSlice, StepInput, kv_bytes_per_block,
                                           resolve_attention_backend)
from ksana_llm.runner.captured_rows import logit_rows_per_chunk
from ksana_llm.runner.sampler import Sampler, SamplingRow
from ksana_llm.runner.slices import PromptLogprobTargets

logger = logging.getLogger("ksana_llm.runner")

# Share of the device that weights + activations + KV blocks may use when no ratio is given.
DEFAULT_DEVICE_RATIO = 0.9


def available_host_bytes() -> int:
    """Host memory that can be used without swapping: MemAvailable, or the free pages where there
    is no /proc/meminfo."""
    available = available_memory_bytes()
    if available is not None:
        return available
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_block_count(device: torch.device, num_blocks: int, bytes_per_block: int,
                      setting: str | None = None) -> None:
    """An explicit block count must fit in what `device` has free: ValueError saying what it
    needs and what there is (an impossible count would otherwise fail deep in the allocator,
    or take the whole machine's memory first). `setting`: what set the count ("name=value";
    default num_device_blocks)."""
    need = num_blocks * bytes_per_block
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else available_host_bytes()
    if need > free:
        setting = setting or f"num_device_blocks={num_blocks}"
        name = setting.split("=", 1)[0]
        raise ValueError(f"{setting} needs {need / 2**30:.1f} GiB of KV cache "
                         f"on {device}, and {free / 2**30:.1f} GiB is free; ask for less, or "
                         f"leave {name} unset to size the cache from memory")


def plan_num_blocks(device: torch.device, bytes_per_block: int, *, ratio: float | None,
                    reserved_ratio: float = 0.01) -> int:
    """Blocks that fit in `ratio` of what the device has free now (weights already loaded).

    CUDA: free memory after the weights, less `reserved_ratio` of the total, times `ratio`
    (default 0.9). CPU: `ratio` (default 0.1) of the RAM currently available.
    """
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = (free - reserved_ratio * total) * (0.9 if ratio is None else ratio)
    else:
        budget = available_host_bytes() * (0.1 if ratio is None else ratio)
    blocks = int(budget // bytes_per_block)
    if blocks < 2:
        raise ValueError(f"not enough memory for the KV cache on {device}: {budget / 2**20:.0f} MiB "
                         "left; lower the dtype, or raise block_device_memory_ratio")
    return blocks


# ---- profiled planning (CUDA) -------------------------------------------------------------------
@dataclass(frozen=True)
class MemoryProfile:
    """Device memory around the profiling step, in bytes."""

    total: int
    peak_used: int  # everything in use at the step's peak: weights, context, activations, others
    activation_peak: int  # the step's own share of it (informational)


def kv_blocks_from_profile(profile: MemoryProfile, bytes_per_block: int, *, ratio: float | None,
                           reserved_ratio: float) -> int:
    """Blocks = (total * ratio - total * reserved_ratio - peak in use) / bytes per block."""
    share = DEFAULT_DEVICE_RATIO if ratio is None else ratio
    budget = profile.total * (share - reserved_ratio) - profile.peak_used
    blocks = int(budget // bytes_per_block)
    if blocks < 2:
        raise ValueError(
            f"not enough device memory for the KV cache: {profile.peak_used / 2**30:.2f} GiB in "
            f"use at the largest step's peak of {profile.total / 2**30:.2f} GiB, "
            f"block_device_memory_ratio {share} and reserved_device_memory_ratio "
            f"{reserved_ratio} leave {max(budget, 0) / 2**20:.0f} MiB; raise "
            "block_device_memory_ratio, or lower max_step_tokens / max_num_seqs")
    return blocks


def profile_step(num_tokens: int, num_seqs: int, block_size: int, num_draft_tokens: int = 0,
                 *, scored_rows: int = 0) -> tuple[StepInput, int]:
    """The largest step the scheduler can build, on a cache of its own: one prefill chunk and
    `num_seqs - 1` decode rows, each a token and its `num_draft_tokens` drafts (speculative
    decoding: every such row gets logits), filling `num_tokens`; every row sampled (so the LM
    head and the sampler see them all). The prefill chunk's first `scored_rows` rows take
    prompt log-probs with the most alternatives (one slice of captured rows' logits:
    `runner.captured_rows`). Returns (step, blocks it needs)."""
    width = 1 + num_draft_tokens
    num_seqs = max(1, min(num_seqs, (num_tokens - 1) // width + 1))
    prefill = num_tokens - (num_seqs - 1) * width
    prefill_blocks = -(-prefill // block_size)
    spare = list(range(prefill_blocks, prefill_blocks + -(-width // block_size)))
    scored = tuple(range(min(scored_rows, prefill)))
    slices = [SeqSlice([0] * prefill, 0, list(range(prefill_blocks)), sample=True,
                       capture=scored, prompt_logprobs=PromptLogprobTargets(
                           (0,) * len(scored), MAX_LOGPROBS) if scored else None)]
    # The decode rows all write the same spare blocks: values are irrelevant, only memory is.
    slices += [SeqSlice([0] * width, 0, spare, sample=True, num_draft_tokens=num_draft_tokens)
               for _ in range(num_seqs - 1)]
    return StepInput(slices, [], []), prefill_blocks + len(spare)


def run_profile_step(model: nn.Module, *, device: torch.device, dtype: torch.dtype,
                     block_size: int, max_step_tokens: int, max_num_seqs: int,
                     attention_backend: str, kv_cache_dtype: str = "auto",
                     num_draft_tokens: int = 0) -> torch.Tensor:
    """Run the profiling step once (no graphs, own tiny cache) and sample every logits row with
    top-k, top-p and log-probs on; returns the sampled token ids. Works on any device."""
    step, num_blocks = profile_step(max_step_tokens, max_num_seqs, block_size, num_draft_tokens,
                                    scored_rows=logit_rows_per_chunk(model.config.vocab_size))
    runner = ModelRunner(model, device=device, dtype=dtype, num_blocks=num_blocks,
                         block_size=block_size, attention_backend=attention_backend,
                         cuda_graphs=False, kv_cache_dtype=kv_cache_dtype)
    result = runner.execute(step)
    config = GenerationConfig(do_sample=True, temperature=0.7, top_k=50, top_p=0.9, logprobs=5)
    rows = [SamplingRow(config=config, prompt_token_ids=[0], output_token_ids=[])
            for _ in range(result.logits.shape[0])]
    return Sampler(seed=0).sample(result.logits, rows).token_ids


def profile_memory(model: nn.Module, *, device: torch.device, dtype: torch.dtype,
                   block_size: int, max_step_tokens: int, max_num_seqs: int,
                   attention_backend: str, kv_cache_dtype: str = "auto",
                   num_draft_tokens: int = 0) -> MemoryProfile:
    """Device memory in use at the peak of the largest step (CUDA only)."""
    torch.cuda.synchronize(device)
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats(device)
    free, total = torch.cuda.mem_get_info(device)
    # The CUDA context, other processes, NCCL buffers: in use, but not through torch's allocator.
    outside_torch = total - free - torch.cuda.memory_reserved(device)
    before = torch.cuda.memory_allocated(device)
    _, num_blocks = profile_step(max_step_tokens, max_num_seqs, block_size, num_draft_tokens)
    # The profile's own cache has the engine's storage type: an FP8 cache's reads widen the
    # gathered entries, and those copies belong to the step's peak.
    cache_bytes = num_blocks * kv_bytes_per_block(model, block_size,
                                                  cache_dtype_for(kv_cache_dtype, dtype))
    run_profile_step(model, device=device, dtype=dtype, block_size=block_size,
                     max_step_tokens=max_step_tokens, max_num_seqs=max_num_seqs,
                     attention_backend=attention_backend, kv_cache_dtype=kv_cache_dtype,
                     num_draft_tokens=num_draft_tokens)
    torch.cuda.synchronize(device)
    # Reserved, not allocated: the allocator keeps the step's segments cached for the next one.
    peak = torch.cuda.max_memory_reserved(device) - cache_bytes
    gc.collect()
    torch.cuda.empty_cache()
    return MemoryProfile(total=total, peak_used=outside_torch + peak,
                         activation_peak=max(0, peak - before))


def plan_device_blocks(model: nn.Module, *, device: torch.device, dtype: torch.dtype,
                       block_size: int, max_step_tokens: int, max_num_seqs: int,
                       attention_backend: str, ratio: float | None,
                       reserved_ratio: float, num_draft_layers: int = 0,
                       kv_cache_dtype: str = "auto", later_device_bytes: int = 0,
                       num_draft_tokens: int = 0) -> int:
    """KV blocks for this model on this device: profiled on CUDA, a share of RAM on the CPU
    (`plan_num_blocks`, unchanged). Parallel runs are not profiled (a forward on rank 0 alone
    would wait for the other ranks in its collectives): they keep `plan_num_blocks`.
    `kv_cache_dtype`: the cache's storage (`EngineConfig.kv_cache_dtype`).
    `later_device_bytes`: CUDA memory the engine takes after the KV cache (LoRA slots), which
    the cache leaves free. `num_draft_tokens`: speculative decoding's drafts per decode row,
    whose rows get logits too."""
    per_block = kv_bytes_per_block(model, block_size, cache_dtype_for(kv_cache_dtype, dtype),
                                   num_draft_layers)
    parallel = torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1
    if device.type != "cuda":
        return plan_num_blocks(device, per_block, ratio=ratio, reserved_ratio=reserved_ratio)
    if parallel:
        blocks = plan_num_blocks(device, per_block, ratio=ratio, reserved_ratio=reserved_ratio)
        return blocks_leaving_room(blocks, per_block, later_device_bytes)
    backend = resolve_attention_backend(attention_backend, model, device)
    profile = profile_memory(model, device=device, dtype=dtype, block_size=block_size,
                             kv_cache_dtype=kv_cache_dtype,
                             max_step_tokens=max_step_tokens, max_num_seqs=max_num_seqs,
                             attention_backend=backend, num_draft_tokens=num_draft_tokens)
    blocks = blocks_leaving_room(kv_blocks_from_profile(profile, per_block, ratio=ratio,
                                                reserved_ratio=reserved_ratio),
                         per_block, later_device_bytes)
    logger.info("memory profile: %.2f GiB of %.2f GiB in use at the largest step's peak "
                "(activations %.2f GiB) -> %d KV blocks (%.2f GiB)", profile.peak_used / 2**30,
                profile.total / 2**30, profile.activation_peak / 2**30, blocks,
                blocks * per_block / 2**30)
    return blocks


def blocks_leaving_room(blocks: int, per_block: int, later_bytes: int) -> int:
    """`blocks` less those `later_bytes` of later allocations would need."""
    left = blocks - -(-later_bytes // per_block)
    if left < 2:
        raise ValueError(f"not enough device memory for the KV cache once {later_bytes / 2**20:.0f} "
                         "MiB of LoRA slots are set aside; lower max_loras or max_lora_rank")
    return left
