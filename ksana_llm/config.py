"""Engine-wide configuration: one object holding every user-facing knob.

Names follow vLLM where KsanaLLM's are ambiguous: `max_step_tokens` is the token budget of one
forward step (the KTransformers guide's `Engine(max_batch_size=)`), `max_num_seqs` the number of
sequences in one step (KsanaLLM YAML `batch_scheduler.max_batch_size`).
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from types import MappingProxyType
from typing import Any, Literal, get_args

from pydantic import (BaseModel, ConfigDict, Field, PositiveInt, ValidationError, field_validator,
                      model_validator)

from ksana_llm.engine.scheduling_policy import (SchedulingPolicy, resolve_scheduling_policy,
                                                scheduling_policy_source)
from ksana_llm.generation_config import MAX_LOGPROBS

DType = Literal["auto", "float32", "float16", "bfloat16"]
def _takes_bool(annotation: Any) -> bool:
    return annotation is bool or bool in get_args(annotation)


# Other spellings of the model dtypes (the one table: Model.from_pretrained reads it too).
DTYPE_ALIASES: Mapping[str, str] = MappingProxyType({
    "fp32": "float32", "float": "float32", "fp16": "float16", "half": "float16", "bf16": "bfloat16"})
# KV cache storage (kernels.kv_quant.FP8_KV_DTYPES): "auto" = the model's dtype; "fp8" = E4M3.
KvCacheDType = Literal["auto", "fp8", "fp8_e4m3", "fp8_e5m2"]
KV_CACHE_DTYPES: tuple[str, ...] = get_args(KvCacheDType)
# Weight quantization at load (loader.fp8_weights.WEIGHT_QUANTIZATIONS): "fp8" = the projections'
# weights as FP8 with per-row scales; "w8a8_int8" = as int8 with per-row scales, their inputs
# quantized to int8 per token. A quantized checkpoint stays as it is without it.
WeightQuantization = Literal["fp8", "w8a8_int8"]
WEIGHT_QUANTIZATIONS: tuple[str, ...] = get_args(WeightQuantization)

# Where a model's weights come from (loader.load_format.LOAD_FORMATS, which cannot import this
# module, spells the same; tests/test_cli_flags.py holds them equal).
LoadFormat = Literal["auto", "safetensors", "pt", "gguf", "dummy"]
LOAD_FORMATS: tuple[str, ...] = get_args(LoadFormat)
# What requested log-probs report (runner.logprobs_mode.LOGPROBS_MODES spells the same; held
# equal by tests/test_cli_flags.py).
LogprobsMode = Literal["raw_logprobs", "raw_logits", "processed_logprobs", "processed_logits"]
LOGPROBS_MODES: tuple[str, ...] = get_args(LogprobsMode)

# Where speculative decoding's drafts come from: the model's MTP layer, or the sequence itself.
SpeculativeMethod = Literal["mtp", "ngram"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)
# The longest n-gram the ngram method looks up: each size costs an index entry per token.
MAX_PROMPT_LOOKUP = 16

# A server's part in prefill/decode disaggregation (`serve --kv-role`, YAML connector.group_role).
KV_ROLES: tuple[str, ...] = ("prefill", "decode", "both")

# LoRA slots when max_loras is not set and lora_modules are: each slot costs device memory, and
# (under CUDA graphs) its low-rank products in every decode step.
DEFAULT_MAX_LORAS = 4


class ReasoningConfig(BaseModel):
    """The thinking block's text (vLLM's `--reasoning-config`), which the engine watches for:
    a request's `thinking_token_budget` forces `reasoning_end_str` once the block is that long,
    and structured output constrains only what follows the block. `reasoning_end_tag`: the
    text that ends the block when the model writes it (default: `reasoning_end_str`), for an
    end string that leads into the tag with a phrase ("Time to answer.</think>")."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    reasoning_start_str: str = Field(min_length=1)
    reasoning_end_str: str = Field(min_length=1)
    reasoning_end_tag: str | None = Field(None, min_length=1)

    @property
    def end_tag(self) -> str:
        return self.reasoning_end_tag or self.reasoning_end_str


class ProfilerConfig(BaseModel):
    """vLLM's `--profiler-config` (torch.profiler): where `Engine.stop_profile` (`POST
    /stop_profile`) writes the trace of the steps since `start_profile`, and what it records."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    profiler: Literal["torch"] = "torch"
    torch_profiler_dir: str = Field(min_length=1)
    torch_profiler_with_stack: bool = True
    torch_profiler_record_shapes: bool = False
    torch_profiler_with_memory: bool = False
    torch_profiler_with_flops: bool = False
    torch_profiler_use_gzip: bool = True


class EngineConfig(BaseModel):
    """Validated, immutable engine settings. Invalid values raise a ValueError naming the field."""

    # arbitrary types: scheduler_policy may be a user's SchedulingPolicy object.
    model_config = ConfigDict(extra="forbid", frozen=True, allow_inf_nan=False,
                              arbitrary_types_allowed=True)

    model: str | None = Field(None, description="HF folder, .gguf file or Hugging Face hub id; "
                                                 "None -> default model")
    revision: str | None = Field(
        None, description="vLLM's: the branch, tag or commit of a hub model id (default main)")
    download_dir: str | None = Field(
        None, description="vLLM's: the Hugging Face cache a hub model id is read from and "
                          "downloaded into (default HF_HUB_CACHE / HF_HOME's)")
    tokenizer: str | None = Field(
        None, description="folder of the tokenizer to use instead of the model's own (vLLM "
                          "--tokenizer, KsanaLLM tokenizer_dir); None -> the model's")
    tokenizer_revision: str | None = Field(
        None, description="vLLM's: the revision of a hub tokenizer (or, without tokenizer, of "
                          "the hub model's own)")
    # A secret: not in the config's repr (logs, errors).
    hf_token: str | bool | None = Field(
        None, repr=False,
        description="vLLM's: the hub token downloads use (None or True: huggingface_hub's own)")
    skip_tokenizer_init: bool = Field(
        False, description="vLLM's: load no tokenizer. Prompts are token ids, outputs carry "
                           "token ids and no text; text inputs and stop strings are refused")
    trust_remote_code: bool = Field(
        False, description="vLLM's: run the ksana_plugin.py a Hugging Face hub repository ships "
                           "(its own Python code; a local folder's plugin runs either way) and "
                           "a folder's own tokenizer code (tokenizer_config.json auto_map)")
    device: str = Field("auto", description="'cpu', 'cuda', 'cuda:N' or 'auto'")
    dtype: DType = Field("auto", description="'auto' = float32 on CPU, bfloat16 on CUDA")
    quantization: WeightQuantization | None = Field(
        None, description="'fp8': keep the projections' weights as FP8 (E4M3, one scale per "
                          "row), quantized as they load: half the memory of 16-bit weights "
                          "(KsanaLLM quantization_config.weight.quant_method fp8_e4m3, vLLM "
                          "--quantization fp8). FP8 checkpoints (quant_method 'fp8') load as "
                          "FP8 either way")
    load_format: LoadFormat = Field(
        "auto", description="vLLM's: where the weights come from: the folder's safetensors, else "
                            ".bin (auto); only safetensors or only .bin files; a .gguf file; or "
                            "'dummy': made-up weights of the config's shapes (profiling)")
    hf_overrides: dict[str, Any] | None = Field(
        None, description="config.json values changed before the model is built (vLLM "
                          "--hf-overrides), e.g. {\"max_position_embeddings\": 65536}")

    # KV cache (KsanaLLM block_manager.*)
    block_token_num: int = Field(16, ge=1, le=1024, description="tokens per KV block")
    num_device_blocks: int | None = Field(None, ge=2, description="explicit KV block count")
    kv_cache_memory_bytes: int | None = Field(
        None, ge=1, description="vLLM's: the KV cache's size per device (per rank) in bytes, "
                                "instead of a share of free memory; as many blocks as fit "
                                "(at least 2)")
    block_device_memory_ratio: float | None = Field(
        None, gt=0, le=1,
        description="CUDA: share of the device's memory that weights, the largest step's "
                    "activations (profiled at start-up) and KV blocks may use together, default "
                    "0.9; CPU: share of available RAM for KV blocks, default 0.1")
    reserved_device_memory_ratio: float = Field(
        0.01, ge=0, lt=1, description="share of the device's memory kept free of KV blocks "
                                      "(CUDA graphs, allocator slack, other users)")
    block_host_memory_factor: float | None = Field(
        None, ge=0, description="host swap pool size as a multiple of the device block count; "
                                "None: the device pool's size on the CPU (committed only as "
                                "blocks are swapped out), 4 GiB per rank on CUDA (pinned at "
                                "start; vLLM's default swap space)")
    swap_space: float | None = Field(
        None, ge=0, description="host swap pool size in GiB per rank (vLLM's --swap-space); "
                                "given, it replaces block_host_memory_factor")
    enable_prefix_caching: bool = True
    kv_cache_dtype: KvCacheDType = Field(
        "auto", description="KV cache storage: 'auto' = the model's dtype; 'fp8_e5m2' or "
                            "'fp8_e4m3' (= 'fp8') keep one byte per number, twice the tokens of "
                            "a 16-bit cache in the same memory, with K/V rounded to FP8. E4M3 "
                            "reads per-layer scales from the model folder's "
                            "kv_cache_scales.json (1.0 without one); E5M2 needs none "
                            "(KsanaLLM quantization_config.kv_cache.dtype)")

    # scheduler (KsanaLLM batch_scheduler.*)
    max_step_tokens: int = Field(2048, ge=1, description="token budget of one forward step")
    max_num_seqs: int = Field(256, ge=1, description="sequences in one forward step")
    split_fuse_token_num: int = Field(
        0, ge=0, description="max prefill tokens of one sequence per step (0 = only the budget)")
    preempt_mode: Literal[0, 1] = Field(0, description="0 = swap to host, 1 = recompute")
    scheduler_policy: str | SchedulingPolicy = Field(
        "fifo", description="'fifo'; 'priority' (lower Request.priority first, preempting "
                            "lower priorities); or a custom order: a SchedulingPolicy, its "
                            "class, or its import path 'module:Class'")
    logits_processors: tuple[str | type, ...] = Field(
        (), description="vLLM's --logits-processors: engine-wide ksana_llm.LogitsProcessor "
                        "subclasses, or their import paths 'module:Class', made once per engine "
                        "and run in this order on every step's logits for the requests they "
                        "apply to (set per request with GenerationConfig.extra_args)")
    reasoning_config: ReasoningConfig | None = Field(
        None, description="vLLM's --reasoning-config: the text that opens and ends the "
                          "model's thinking block, for thinking_token_budget and for structured "
                          "output after the thinking (serve sets it from --reasoning-parser)")
    profiler_config: ProfilerConfig | None = Field(
        None, description="vLLM's --profiler-config: Engine.start_profile / stop_profile (and "
                          "the server's /start_profile, /stop_profile) trace the engine's steps "
                          "with torch.profiler into torch_profiler_dir")
    logprobs_mode: LogprobsMode = Field(
        "raw_logprobs", description="vLLM's: what requested log-probs report: log_softmax of "
                                    "the model's logits (raw_logprobs) or the logits "
                                    "(raw_logits); or, processed_*, of the logits each token "
                                    "was chosen from, after the processors and, for sampled "
                                    "requests, temperature / top-k / top-p / min-p")
    max_logprobs: int = Field(
        MAX_LOGPROBS, ge=-1, description="vLLM's: the most top alternatives a request's logprobs / "
                               "prompt_logprobs may ask for; -1: no cap, a request may ask for "
                               "the whole vocabulary (logprobs=-1), which costs vocabulary-wide "
                               "rows of host and device memory per token")
    max_queue_size: int = Field(1000, ge=1, description="waiting requests before QueueFullError")
    waiting_timeout_ms: int | None = Field(
        None, ge=1, description="a request never scheduled within this many ms fails with "
                                "QueueTimeoutError (KsanaLLM waiting_timeout_in_ms); None = no limit")
    max_model_len: int | None = Field(None, ge=1, description="default: the model's context size")
    clamp_max_model_len: bool = Field(
        False, description="a max_model_len above the model's context is lowered to it (with a "
                           "warning) instead of refused: KsanaLLM's rule for its YAML's "
                           "max_token_len, which a YAML file's value follows")
    disable_sliding_window: bool = Field(
        False, description="vLLM's: cap sequences at the model's sliding window (Mistral, "
                           "windowed Qwen), within which its attention is full; no effect on "
                           "models without one")

    seed: int | None = Field(None, description="seed of the shared sampling RNG")

    # parallelism (KsanaLLM setting.global.*); see ksana_llm.distributed
    tensor_parallel_size: int = Field(
        1, ge=0, description="ranks one model is split across; 0 = every visible GPU")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="pipeline stages (layers split between ranks or nodes)")
    attention_backend: Literal["auto", "torch", "triton"] = Field(
        "auto", description="'auto' = Triton kernels on CUDA when installed, torch SDPA otherwise")
    enable_cuda_graphs: bool = Field(
        True, description="replay CUDA graphs for pure-decode steps; effective only on CUDA with "
                          "the triton attention backend and a model without host syncs")
    cuda_graph_max_batch_size: int | None = Field(
        None, ge=1, description="largest decode batch captured in a graph (larger batches run "
                                "eagerly); default: max_num_seqs")
    cuda_graph_sizes: list[PositiveInt] | None = Field(
        None, min_length=1, description="vLLM's cuda_graph_sizes: one value is the largest "
        "decode batch captured (the default buckets 1, 2, 4, 8, then multiples of 8 below it), "
        "several are the sizes captured; a batch runs in the smallest that holds it, eagerly "
        "above the largest; sizes above max_num_seqs are dropped")
    overlap_output_processing: bool | None = Field(
        None, description="detokenize and deliver a step's outputs while the device runs the next "
                          "step (outputs arrive one step later; requests with stop strings or "
                          "best_of/beam search are not deferred); None = on for CUDA")
    freeze_gc_heap: bool = Field(
        True, description="freeze the objects alive once the engine has started (gc.freeze), so "
                          "the garbage collector's full passes no longer walk them and stall "
                          "the step loop (200+ ms each otherwise); thawed when the engine "
                          "stops. Process-wide: turn off to keep a host program's collector "
                          "as it was")
    enable_sleep_mode: bool = Field(
        False, description="vLLM's: allow Engine.sleep() / wake_up(), which free and take back "
                           "the KV cache and the weights' device memory while the engine idles")
    async_scheduling: bool | None = Field(
        None, description="plan and launch each decode step before the previous step's tokens "
                          "are read back (the device feeds them in), so the host's scheduling "
                          "and output work overlaps the device; beam search steps wait for their "
                          "tokens, structured output steps read the previous step back between "
                          "their forward and their sampling. Needs a "
                          "single-rank run; None = on for CUDA")

    num_speculative_tokens: int = Field(
        0, ge=0, le=8,
        description="speculative decoding: tokens drafted per sequence and step, verified by "
                    "the main model in the next step (KsanaLLM mtp_step_num). Greedy outputs are "
                    "unchanged and sampled ones keep their distribution. 0 = off. Turns "
                    "async_scheduling off")
    speculative_method: SpeculativeMethod = Field(
        "mtp", description="where drafts come from: 'mtp' = the model's MTP layer (DeepSeek "
                           "V3/R1 checkpoints with MTP weights; needs pipeline_parallel_size 1); "
                           "'ngram' = the sequence's own prompt and output (prompt lookup, any "
                           "model)")
    speculative_disable_by_batch_size: int | None = Field(
        None, ge=2,
        description="speculative decoding pauses while a step runs at least this many sequences "
                    "(vLLM's speculative_disable_by_batch_size): at large batches the device is "
                    "busy anyway and verifying drafts costs more than it saves. None = never")
    prompt_lookup_min: int = Field(1, ge=1, le=MAX_PROMPT_LOOKUP, description="ngram method: the shortest run of last "
                                                        "tokens looked up")
    prompt_lookup_max: int = Field(4, ge=1, le=MAX_PROMPT_LOOKUP, description="ngram method: the longest run of last "
                                                        "tokens looked up (the longest found "
                                                        "wins)")

    # LoRA adapters (vLLM's --lora-modules, --max-loras, --max-lora-rank)
    lora_modules: dict[str, str] = Field(
        default_factory=dict,
        description="LoRA adapters loaded at start-up: name -> PEFT adapter folder. A request "
                    "picks one by name (Request.lora; the OpenAI `model` field)")
    max_loras: int | None = Field(
        None, ge=1, le=64,
        description="adapter slots on the device: the most distinct adapters in one step. Any "
                    "number of adapters may be loaded (each held in host memory); one whose "
                    "requests arrive while every slot is used waits for a free slot. Default: "
                    f"the number of lora_modules, at most {DEFAULT_MAX_LORAS}")
    max_cpu_loras: int | None = Field(
        None, ge=1,
        description="host copies of adapters kept (vLLM's max_cpu_loras): past it the least "
                    "recently used copy is dropped, and read again from its folder when its "
                    "adapter next takes a slot (if the folder is gone by then, that adapter's "
                    "requests fail and the others go on). At least max_loras. None: all")
    max_lora_rank: int = Field(16, ge=1, le=1024, description="the largest adapter rank a slot "
                                                            "holds")
    lora_max_wait_steps: int | None = Field(
        64, ge=0,
        description="steps a request may wait for a LoRA slot while newer requests of the "
                    "adapters holding every slot go ahead; after that the held adapter with "
                    "the fewest requests takes no newer ones until its slot frees for it. 0: "
                    "at once; None: never (vLLM's way: throughput first, but a busy adapter "
                    "may hold its slot for ever)")

    @model_validator(mode="before")
    @classmethod
    def _no_flags_for_numbers(cls, data: Any) -> Any:
        """True / False given for a number (pydantic would read them as 1 / 0)."""
        if isinstance(data, dict):
            for name, value in data.items():
                info = cls.model_fields.get(name)
                if isinstance(value, bool) and info is not None and not _takes_bool(info.annotation):
                    raise ValueError(f"{name} must be a number, got {value!r}")
        return data

    # What Model.from_pretrained takes, taken here too: a Path, a torch.device, a torch.dtype
    # or a dtype's common short name.
    @field_validator("model", mode="before")
    @classmethod
    def _model_path(cls, value: Any) -> Any:
        return os.fspath(value) if isinstance(value, os.PathLike) else value

    @field_validator("device", mode="before")
    @classmethod
    def _device_name(cls, value: Any) -> Any:
        is_torch_device = not isinstance(value, str) and hasattr(value, "type") and hasattr(value, "index")
        return str(value) if is_torch_device else value

    @field_validator("scheduler_policy", mode="before")
    @classmethod
    def _scheduling_policy(cls, value: Any) -> Any:
        """Checked here (imported, not made), so that a bad policy is refused with the config; a
        name or import path stays a string, a class becomes its instance."""
        if isinstance(value, str):
            scheduling_policy_source(value)
            return "fifo" if value == "fcfs" else value
        return resolve_scheduling_policy(value)

    @field_validator("logits_processors", mode="before")
    @classmethod
    def _logits_processors(cls, value: Any) -> Any:
        """Each entry checked here (imported, not made): a bad path is refused with the config.
        Paths stay strings, so the config still prints as what was given."""
        if isinstance(value, (str, type)):
            value = [value]
        if not isinstance(value, (list, tuple)):
            raise ValueError("logits_processors must be a list of LogitsProcessor classes or "
                             f"import paths, got {type(value).__name__}")
        # Imported here: the module imports generation_config, which a light entry point
        # (`ksana-llm --help`) need not load unless processors are named.
        from ksana_llm.logits_processor import logits_processor_class

        for i, spec in enumerate(value):
            try:
                logits_processor_class(spec)
            except ValueError as exc:
                raise ValueError(f"logits_processors[{i}]: {exc}") from None
        return tuple(value)

    @field_validator("dtype", mode="before")
    @classmethod
    def _dtype_name(cls, value: Any) -> Any:
        name = str(value).removeprefix("torch.") if not isinstance(value, str) else value
        return DTYPE_ALIASES.get(name, name)

    @model_validator(mode="after")
    def _check_budget(self) -> EngineConfig:
        if self.split_fuse_token_num > self.max_step_tokens:
            raise ValueError("split_fuse_token_num must be <= max_step_tokens")
        if self.kv_cache_memory_bytes is not None and self.num_device_blocks is not None:
            raise ValueError("give kv_cache_memory_bytes or num_device_blocks, not both (each "
                             "sets the KV cache's size)")
        if self.cuda_graph_sizes is not None and self.cuda_graph_max_batch_size is not None:
            raise ValueError("give cuda_graph_sizes or cuda_graph_max_batch_size, not both (the "
                             "largest size is the largest batch captured)")
        if self.num_speculative_tokens and self.async_scheduling:
            raise ValueError("num_speculative_tokens does not work with async_scheduling=True "
                             "(a step's inputs depend on how many drafts the last one accepted)")
        if self.prompt_lookup_min > self.prompt_lookup_max:
            raise ValueError(f"prompt_lookup_min ({self.prompt_lookup_min}) must be <= "
                             f"prompt_lookup_max ({self.prompt_lookup_max})")
        if self.num_speculative_tokens and self.speculative_method == "mtp" \
                and self.pipeline_parallel_size > 1:
            raise ValueError("num_speculative_tokens needs pipeline_parallel_size 1 (the MTP "
                             "layer sits on the last stage, the logits on the first)")
        if self.max_cpu_loras is not None and self.max_cpu_loras < self.num_lora_slots:
            raise ValueError(f"max_cpu_loras ({self.max_cpu_loras}) must be >= the LoRA slots "
                             f"({self.num_lora_slots}, max_loras): a step may copy that many "
                             "adapters into slots, each from its host copy")
        for name in self.lora_modules:
            if not name or name != name.strip():
                raise ValueError(f"lora_modules: adapter name {name!r} must be non-empty, without "
                                 "surrounding spaces")
        return self

    def updated(self, overrides: Mapping[str, Any],
                spelled: Mapping[str, str] | None = None) -> EngineConfig:
        """A copy with `overrides`, validated; a bad value is a ValueError naming its field, or
        the name the caller gave it (`spelled`: field -> that name), without pydantic's links."""
        try:
            return EngineConfig(**{**self.model_dump(), **overrides})
        except ValidationError as exc:
            names = {name: name for name in (*type(self).model_fields, *overrides)}
            raise named_validation_error(exc, {**names, **(spelled or {})}) from None

    @property
    def num_lora_slots(self) -> int:
        """Adapter slots the engine allocates (0: LoRA off)."""
        return self.max_loras or min(len(self.lora_modules), DEFAULT_MAX_LORAS)


def named_validation_error(exc: ValidationError, sources: Mapping[str, str]) -> ValueError:
    """Re-word pydantic's errors with what set each field (`sources`: field -> a YAML key or a
    command-line flag), without pydantic's links."""
    lines = []
    for err in exc.errors():
        field = str(err["loc"][0]) if err["loc"] else ""
        if field:
            where = sources.get(field, f"{field} (override)")
        else:  # a cross-field check: name the keys of the fields its message mentions
            named = [source for name, source in sources.items() if name in str(err["msg"])]
            where = ", ".join(named) or "config"
        message = str(err["msg"]).removeprefix("Value error, ")
        got = f" (got {err['input']!r})" if field and "input" in err else ""
        lines.append(f"{where}: {message}{got}")
    return ValueError("; ".join(lines))
