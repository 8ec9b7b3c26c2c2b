"""Building an `EngineCore` for a model and an `EngineConfig`: KV pool sizing, the model runner
(local, or driving worker ranks), the scheduler's limits, the sampler."""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

import torch

from ksana_llm.api.model import Model
from ksana_llm.config import EngineConfig
from ksana_llm.distributed.executor import DistributedRunner
from ksana_llm.engine.core import EngineCore
from ksana_llm.engine.kv_cache import BlockManager
from ksana_llm.engine.ngram_proposer import NgramProposer
from ksana_llm.engine.scheduler_records import SchedulerConfig
from ksana_llm.kernels.kv_quant import cache_dtype_for
from ksana_llm.loader.kv_scales import KV_SCALES_FILENAME, load_kv_cache_scales
from ksana_llm.loader.weight_map import find_weight_map
from ksana_llm.logits_processor import LogitsProcessorContext, build_logits_processors
from ksana_llm.runner.memory import available_host_bytes, check_block_count, plan_device_blocks
from ksana_llm.runner.drafting import draft_layers_for
from ksana_llm.runner.lora_slots import lora_device_bytes
from ksana_llm.runner.model_runner import ModelRunner, kv_bytes_per_block
from ksana_llm.runner.sampler import Sampler

logger = logging.getLogger("ksana_llm.engine")


def model_context(model: Model, cfg: EngineConfig) -> int:
    """The longest sequence the model serves: its context, or with `disable_sliding_window`
    (vLLM's) its sliding window, within which windowed attention is full attention (for models
    whose windowed layers alternate with full ones, Gemma 2 / 3, their layers' window). A
    `max_model_len` beyond that window is a ValueError; a model without a window ignores it."""
    window = (getattr(model.module, "sliding_window", None)
              or getattr(model.module, "layer_sliding_window", None))
    if not cfg.disable_sliding_window or not window:
        return model.max_context
    if cfg.max_model_len is not None and cfg.max_model_len > window:
        raise ValueError(f"max_model_len={cfg.max_model_len} is more than the model's sliding "
                         f"window ({window}), to which disable_sliding_window caps sequences")
    return min(model.max_context, int(window))


def build_core(model: Model, cfg: EngineConfig, tokenizer: Any,
               on_worker_failure: Callable[[str], None],
               lora_adapters: list[tuple[int, str]] = ()) -> EngineCore:
    """The core; its `max_model_len` is the context a request may use (the model's, bounded by
    `cfg.max_model_len` and by the KV pool). `on_worker_failure` hears of a dead worker rank.
    `lora_adapters`: (adapter id, folder) of the LoRA adapters every rank registers as it
    starts."""
    # Refused before anything is allocated or any worker rank is told to build a runner.
    async_scheduling = resolve_async_scheduling(cfg, model)
    logits_processors = build_logits_processors(cfg.logits_processors, LogitsProcessorContext(
        device=model.device, vocab_size=model.vocab_size, engine_config=cfg,
        hf_config=model.hf_config, tokenizer=tokenizer))
    # The MTP method drafts with the model's own layers, which need a KV cache of their own.
    mtp_tokens = cfg.num_speculative_tokens if cfg.speculative_method == "mtp" else 0
    draft_layers = draft_layers_for(model.module, mtp_tokens)
    cache_dtype = cache_dtype_for(cfg.kv_cache_dtype, model.dtype)
    per_block = kv_bytes_per_block(model.module, cfg.block_token_num, cache_dtype, draft_layers)
    explicit_blocks = cfg.num_device_blocks
    if cfg.kv_cache_memory_bytes is not None:
        explicit_blocks = cfg.kv_cache_memory_bytes // per_block
        if explicit_blocks < 2:
            raise ValueError(f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes} holds "
                             f"{explicit_blocks} KV blocks of {per_block} bytes "
                             f"({cfg.block_token_num} tokens); it takes at least 2")
    if explicit_blocks is not None:
        check_block_count(model.device, explicit_blocks, per_block,
                          None if cfg.kv_cache_memory_bytes is None
                          else f"kv_cache_memory_bytes={cfg.kv_cache_memory_bytes}")
    # CUDA: what remains after a profiled run of the largest step; CPU: a share of RAM.
    num_blocks = explicit_blocks or plan_device_blocks(
        model.module, device=model.device, dtype=model.dtype, kv_cache_dtype=cfg.kv_cache_dtype,
        block_size=cfg.block_token_num,
        max_step_tokens=cfg.max_step_tokens, max_num_seqs=cfg.max_num_seqs,
        attention_backend=cfg.attention_backend, ratio=cfg.block_device_memory_ratio,
        reserved_ratio=cfg.reserved_device_memory_ratio, num_draft_layers=draft_layers,
        num_draft_tokens=cfg.num_speculative_tokens,
        later_device_bytes=lora_device_bytes(model.module, num_slots=cfg.num_lora_slots,
                                             max_rank=cfg.max_lora_rank, dtype=model.dtype,
                                             max_step_tokens=cfg.max_step_tokens))
    # A sequence can never outgrow the model's context, nor the whole KV pool.
    # An explicit cap past either is refused (vLLM's rule), not silently lowered: a client told
    # the larger context would see its long requests fail. A KsanaLLM YAML's max_token_len is
    # lowered to the model's context instead (KsanaLLM's rule; clamp_max_model_len).
    context = model_context(model, cfg)
    pool = num_blocks * cfg.block_token_num
    requested = cfg.max_model_len
    if requested is not None and requested > context:
        if not cfg.clamp_max_model_len:
            raise ValueError(f"max_model_len={requested} is more than the model's context "
                             f"({context} tokens)")
        logger.warning("max_model_len %d is more than the model's context: lowered to %d",
                       requested, context)
        requested = context
    if requested is not None and requested > pool:
        raise ValueError(f"max_model_len={requested} is more than the KV cache holds "
                         f"({num_blocks} blocks x {cfg.block_token_num} tokens = {pool}): give "
                         f"it more blocks (num_device_blocks, block_device_memory_ratio) or "
                         f"lower max_model_len")
    max_model_len = min(requested or context, context, pool)
    num_host_blocks = host_swap_blocks(cfg, num_blocks, per_block, model.device)
    block_manager = BlockManager(num_blocks, cfg.block_token_num,
                                 enable_prefix_caching=cfg.enable_prefix_caching,
                                 num_host_blocks=num_host_blocks)
    runner_kwargs = dict(num_blocks=num_blocks, block_size=cfg.block_token_num,
                         num_host_blocks=num_host_blocks,
                         attention_backend=cfg.attention_backend,
                         max_model_len=max_model_len, cuda_graphs=cfg.enable_cuda_graphs,
                         cuda_graph_sizes=capture_sizes(cfg), num_speculative_tokens=mtp_tokens,
                         kv_cache_dtype=cfg.kv_cache_dtype, kv_scales=kv_scales(model, cache_dtype, cfg),
                         max_loras=cfg.num_lora_slots, max_lora_rank=cfg.max_lora_rank,
                         max_cpu_loras=cfg.max_cpu_loras,
                         # A parallel run registers them below, where every rank's refusal
                         # is heard.
                         lora_adapters=list(lora_adapters) if model.runtime is None else [],
                         lora_weight_map=lora_weight_map(model) if cfg.num_lora_slots else None)
    runner = ModelRunner(model.module, device=model.device, dtype=model.dtype, **runner_kwargs)
    if model.runtime is not None:
        # A parallel run: every step also goes to the worker ranks, which build the same
        # runner (same block count, so block tables mean the same thing everywhere).
        model.mark_workers_taken()  # told to build this runner: they serve no other engine
        runner = DistributedRunner(runner, model.runtime, runner_kwargs, model.workers,
                                   on_failure=on_worker_failure)
        try:
            for lora_id, path in lora_adapters:
                runner.register_lora(lora_id, path)
        except BaseException:
            runner.close()
            raise
    scheduler_config = SchedulerConfig(
        max_step_tokens=cfg.max_step_tokens, max_num_seqs=cfg.max_num_seqs,
        split_fuse_token_num=cfg.split_fuse_token_num, preempt_mode=cfg.preempt_mode,
        policy=cfg.scheduler_policy, max_loras=cfg.num_lora_slots,
        lora_max_wait_steps=cfg.lora_max_wait_steps,
        speculative_disable_by_batch_size=cfg.speculative_disable_by_batch_size,
        long_rope_switch=getattr(model.module, "long_rope_switch", None),
        # Admission control happens in submit(); requests it admits to start at once sit in
        # the core's waiting list until the next step, so the core's bound leaves them room.
        max_queue_size=cfg.max_queue_size + cfg.max_num_seqs)
    logger.info("KV cache: %d blocks of %d tokens (%.0f MiB, %s), %d host blocks", num_blocks,
                cfg.block_token_num, num_blocks * per_block / 2**20, cache_dtype, num_host_blocks)
    overlap = cfg.overlap_output_processing
    if overlap is None:
        overlap = model.device.type == "cuda"
    return EngineCore(runner, block_manager, scheduler_config, tokenizer,
                      max_model_len=max_model_len, sampler=Sampler(cfg.seed, logits_processors, cfg.logprobs_mode),
                      overlap_outputs=overlap,
                      async_scheduling=async_scheduling,
                      num_speculative_tokens=cfg.num_speculative_tokens,
                      ngram=NgramProposer(cfg.prompt_lookup_min, cfg.prompt_lookup_max)
                      if cfg.num_speculative_tokens and cfg.speculative_method == "ngram"
                      else None)


# The host swap pool on CUDA when neither swap_space nor block_host_memory_factor is given:
# vLLM's default swap space. It is pinned at start (swap copies run asynchronously), so
# mirroring an H200's ~130 GB device pool would pin most of the machine's RAM.
CUDA_DEFAULT_SWAP_GIB = 4.0


def host_swap_blocks(cfg: EngineConfig, num_blocks: int, per_block: int,
                     device: torch.device) -> int:
    """Blocks of the host swap pool (none in recompute mode): swap_space GiB when given, else
    block_host_memory_factor x the device blocks when given, else a mirror of the device pool
    on the CPU (committed only as blocks are swapped out) and CUDA_DEFAULT_SWAP_GIB on CUDA;
    never more than half the free host RAM."""
    if cfg.preempt_mode != 0:
        return 0
    if cfg.swap_space is not None:
        wanted = int(cfg.swap_space * 2**30) // per_block
    elif cfg.block_host_memory_factor is not None:
        wanted = int(num_blocks * cfg.block_host_memory_factor)
    elif device.type == "cuda":
        wanted = min(num_blocks, int(CUDA_DEFAULT_SWAP_GIB * 2**30) // per_block)
    else:
        wanted = num_blocks
    blocks = min(wanted, available_host_bytes() // 2 // per_block)
    if blocks < wanted and (cfg.swap_space is not None
                            or cfg.block_host_memory_factor is not None):
        logger.warning("the host swap pool asked for (%.2f GiB) is more than half the free host "
                       "memory: it gets %.2f GiB", wanted * per_block / 2**30,
                       blocks * per_block / 2**30)
    return blocks


def kv_scales(model: Model, cache_dtype: torch.dtype, cfg: EngineConfig) -> list[float] | None:
    """Per-layer scales of an E4M3 cache, from the model folder; None (all 1.0) otherwise."""
    if cache_dtype != torch.float8_e4m3fn:
        return None
    # Every layer of the model (a pipeline stage runs some of them; layers look their scale up
    # by their global index).
    num_layers = int(getattr(model.hf_config, "num_hidden_layers", 0) or model.module.num_layers)
    scales = load_kv_cache_scales(model.path, num_layers)
    if scales is None:
        # vLLM's default too: fine while |K|, |V| stay under E4M3's 448, clipped beyond.
        logger.warning("kv_cache_dtype %s without %s in %s: every layer's scale is 1.0",
                       cfg.kv_cache_dtype, KV_SCALES_FILENAME, model.path)
    return scales


def lora_weight_map(model: Model) -> str | None:
    """The model's weight-name map file, which adapters' module names go through too."""
    found = find_weight_map(model.path, getattr(model.hf_config, "model_type", None))
    return None if found is None else str(found)


def resolve_async_scheduling(cfg: EngineConfig, model: Model) -> bool:
    """`cfg.async_scheduling`, with None = on for a single-rank CUDA run without speculative
    decoding. Parallel runs cannot: their worker ranks would need the sampled tokens, which only
    this rank's device holds."""
    single_rank = model.runtime is None
    if cfg.async_scheduling is None:
        return single_rank and model.device.type == "cuda" and not cfg.num_speculative_tokens
    if cfg.async_scheduling and not single_rank:
        raise ValueError("async_scheduling needs a single-rank run (tensor_parallel_size=1 and "
                         "pipeline_parallel_size=1)")
    return cfg.async_scheduling


def capture_sizes(cfg: EngineConfig) -> int | list[int]:
    """The decode batch sizes to capture (a list) or the largest (an int, the default buckets
    below it). `cuda_graph_sizes` follows vLLM: one value is the largest, several are the
    sizes; sizes above max_num_seqs (batches never that large) are dropped."""
    sizes = cfg.cuda_graph_sizes
    if not sizes:
        return cfg.cuda_graph_max_batch_size or cfg.max_num_seqs
    if len(sizes) == 1:
        return min(sizes[0], cfg.max_num_seqs)
    return [s for s in sizes if s <= cfg.max_num_seqs] or cfg.max_num_seqs
