"""Compile each kernel for a GPU target, without a GPU: `python -m ksana_llm.kernels.compile_check`.

The interpreter (TRITON_INTERPRET=1) runs kernels as numpy code and accepts things GPU compilation
rejects (tl.dot tiles under 16, loop-carried type changes, too much shared memory). This tool runs
each launcher on CPU tensors of real model shapes with the kernels swapped for recorders, then
compiles every recorded launch ahead of time for the target (default sm_90, Hopper) through
triton's own pipeline down to a cubin (triton ships ptxas), and checks the shared memory each
kernel needs against the target's limit. Prints one JSON line per compiled kernel; exits non-zero
on the first failure.

It must run without TRITON_INTERPRET (the kernels have to be JIT functions, not interpreted ones),
hence a separate process from the interpreter-mode tests. Written against triton 3.x's
`ASTSource(fn, signature, constexprs)` / `triton.compile(src, target=GPUTarget(...))`.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import torch

# Shared memory one block may use (bytes) per compute capability (CUDA programming guide).
SHARED_MEMORY_LIMIT = {80: 166912, 86: 101376, 89: 101376, 90: 232448}

_TRITON_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16",
                 torch.int8: "i8", torch.int16: "i16", torch.int32: "i32", torch.int64: "i64",
                 torch.uint8: "u8",
                 torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}
_OPTION_NAMES = ("num_warps", "num_stages")


@dataclass
class Launch:
    kernel: Any  # the triton JITFunction
    args: tuple[Any, ...]
    kwargs: dict[str, Any]


@dataclass
class LaunchRecorder:
    """Takes a @triton.jit kernel's place: `kernel[grid](...)` records the arguments instead of
    running them."""

    kernel: Any
    launches: list[Launch] = field(default_factory=list)

    def __getitem__(self, grid: Any) -> Callable[..., None]:
        def launch(*args: Any, **kwargs: Any) -> None:
            self.launches.append(Launch(self.kernel, args, kwargs))
        return launch


@contextlib.contextmanager
def recording(module: ModuleType, *names: str) -> Iterator[list[Launch]]:
    """Within the block, launches of `module`'s kernels `names` are recorded, not run."""
    launches: list[Launch] = []
    originals = {name: getattr(module, name) for name in names}
    try:
        for name, kernel in originals.items():
            recorder = LaunchRecorder(kernel, launches)
            setattr(module, name, recorder)
        yield launches
    finally:
        for name, kernel in originals.items():
            setattr(module, name, kernel)


def _signature(launch: Launch) -> tuple[dict[str, str], dict[str, Any], dict[str, Any]]:
    """(signature, constexprs, options) as triton's launcher would derive them: tensors become
    typed pointers, ints i32 / i64 (1 specialises to a constant, as at run time, unless the
    kernel opts out), floats fp32."""
    fn = launch.kernel
    kwargs = dict(launch.kwargs)
    options = {name: kwargs.pop(name) for name in _OPTION_NAMES if name in kwargs}
    bound = dict(zip(fn.arg_names, launch.args, strict=False))  # trailing args: kwargs
    bound.update(kwargs)
    signature: dict[str, str] = {}
    constexprs: dict[str, Any] = {}
    for param in fn.params:
        name = param.name
        value = bound[name]
        specialised_one = (isinstance(value, int) and not isinstance(value, bool) and value == 1
                           and not param.do_not_specialize)
        if param.is_constexpr or specialised_one:
            signature[name] = "constexpr"
            constexprs[name] = value
        elif isinstance(value, torch.Tensor):
            signature[name] = "*" + _TRITON_TYPES[value.dtype]
        elif isinstance(value, bool):
            signature[name] = "i1"
        elif isinstance(value, int):
            signature[name] = "i32" if -2**31 <= value < 2**31 else "i64"
        elif isinstance(value, float):
            signature[name] = "fp32"
        else:
            raise TypeError(f"{fn.__name__}: cannot type argument {name}={value!r}")
    return signature, constexprs, options


def compile_launch(launch: Launch, capability: int) -> dict[str, Any]:
    """Compile one recorded launch for sm_<capability>; returns what it needs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature, constexprs, options = _signature(launch)
    source = ASTSource(launch.kernel, signature, constexprs)
    compiled = triton.compile(source, target=GPUTarget("cuda", capability, 32), options=options)
    shared = int(compiled.metadata.shared)
    limit = SHARED_MEMORY_LIMIT.get(capability)
    if limit is not None and shared > limit:
        raise RuntimeError(f"{launch.kernel.__name__}: needs {shared} bytes of shared memory, "
                           f"sm_{capability} allows {limit}")
    constants = {k: v for k, v in constexprs.items() if k.isupper()}
    return {"kernel": launch.kernel.__name__, "sm": capability, "shared_bytes": shared,
            **options, "constexprs": constants}


@dataclass(frozen=True)
class ShapeConfig:
    name: str
    dtype: torch.dtype
    head_dim: int
    heads: int
    kv_heads: int
    block_size: int
    kv_dtype: torch.dtype | None = None  # the KV cache's storage type; None = dtype
    # MLA: V is a view of K's first `latent_values` columns (the latent), and only the attention
    # kernels and the store run on this cache shape
    latent_values: int | None = None


CONFIGS = (
    ShapeConfig("qwen3-0.6b-fp16", torch.float16, 128, 16, 8, 16),
    ShapeConfig("llama3-8b-bf16", torch.bfloat16, 128, 32, 8, 32),
    ShapeConfig("mha-hd80-fp16", torch.float16, 80, 8, 8, 64),
    # fp32 takes the exact "ieee" dots and the smaller tiles
    ShapeConfig("gqa4-hd96-fp32", torch.float32, 96, 4, 1, 8),
    # FP8 KV caches (kv_cache_dtype): the tiles widen from E4M3 / E5M2 in registers
    ShapeConfig("qwen3-0.6b-bf16-kv-fp8e4m3", torch.bfloat16, 128, 16, 8, 16,
                torch.float8_e4m3fn),
    ShapeConfig("llama3-8b-fp16-kv-fp8e5m2", torch.float16, 128, 32, 8, 32, torch.float8_e5m2),
    # DeepSeek-V3's MLA: latent 512 + rope 64 per token, 16 query heads a rank at TP 8 (one head
    # block) and 128 at TP 1 (eight), all on the one latent "head"
    ShapeConfig("deepseek-v3-mla-tp8-bf16", torch.bfloat16, 576, 16, 1, 64, latent_values=512),
    ShapeConfig("deepseek-v3-mla-tp1-bf16", torch.bfloat16, 576, 128, 1, 64, latent_values=512),
)


def in_quick_set(config: ShapeConfig, launch: Launch) -> bool:
    """What the unit test compiles (each compile costs ~1 s of CPU): every variant at the Qwen3
    fp16 shape, plus the fp32 attention kernels (their dots take the "ieee" path) with every
    option on, plus the kernels that touch an FP8 cache, plus the quantized-weight matmuls in
    bf16."""
    if config.name == "qwen3-0.6b-fp16":
        return True
    if launch.kernel.__name__ in ("_fp8_linear_kernel", "_int4_linear_kernel"):
        return config.name == "llama3-8b-bf16"
    if launch.kernel.__name__ in ("_expert_matmul_kernel", "_expert_int4_matmul_kernel"):
        # every dtype: fp32 has its own tiles
        return config.name in ("llama3-8b-bf16", "gqa4-hd96-fp32")
    if config.latent_values is not None:  # MLA's caches: the attention kernels and the store
        return config.name == "deepseek-v3-mla-tp1-bf16"
    if config.kv_dtype is not None:  # the kernels that read or write the cache
        return launch.kernel.__name__ in ("_store_kv_kernel", "_decode_kernel",
                                          "_prefill_kernel")
    return config.name == "gqa4-hd96-fp32" and launch.kwargs.get("USE_ALIBI") is True


def record_launches(config: ShapeConfig) -> list[Launch]:
    """Every kernel variant the engine can launch (decode with one and several splits, with and
    without window / ALiBi / logit soft-capping, over a cache of the model's dtype or FP8; prefill of one and of
    several sequences; norm with and without residual; rotary on views of a fused QKV, with
    and without q/k norms and the K/V store; the SiLU-gated activation; the quantized-weight
    matmuls: FP8 with block and per-row scales, int8 codes, packed 4-bit codes; the grouped MoE
    matmuls of a decode step and of a prefill, dense, 8-bit and packed 4-bit) at one model
    shape. The tensors are empty CPU tensors: nothing runs."""
    from ksana_llm.kernels import (_common, decode_attention, fp8_matmul, fused_moe,
                                   gated_activation, kv_store, prefill_attention, rmsnorm, rotary)

    dtype, head_dim, heads, kv_heads = config.dtype, config.head_dim, config.heads, config.kv_heads
    k_cache = torch.empty(64, config.block_size, kv_heads, head_dim,
                          dtype=config.kv_dtype or dtype)
    v_cache = torch.empty_like(k_cache) if config.latent_values is None \
        else k_cache[..., :config.latent_values]
    tables = torch.zeros(4, 16, dtype=torch.int32)
    lens = torch.ones(4, dtype=torch.int32)
    slopes = torch.ones(heads)
    launches: list[Launch] = []
    with recording(kv_store, "_store_kv_kernel") as rec:
        kv = torch.empty(8, kv_heads, head_dim, dtype=dtype)
        if config.latent_values is None:
            kv_store.store_kv(kv, kv, k_cache, v_cache, torch.zeros(8, dtype=torch.int64))
        else:  # MLA stores the latent alone (its V cache is empty)
            kv_store.store_kv(kv, kv[..., :0], k_cache, k_cache[..., :0],
                              torch.zeros(8, dtype=torch.int64))
    launches += rec
    with recording(decode_attention, "_decode_kernel", "_reduce_kernel") as rec:
        q = torch.empty(4, heads, head_dim, dtype=dtype)
        # As the engine launches it: programs take the sequences longest first.
        decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                order=torch.arange(3, -1, -1, dtype=torch.int32))
        decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                sliding_window=100, alibi_slopes=slopes,
                                                num_splits=3)
        # Gemma 2's soft-capped logits, on its windowed and its full layers
        decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                sliding_window=100, softcap=50.0)
        decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                softcap=50.0, num_splits=3)
        # GPT-OSS's attention sinks, folded in by the kernel itself or by the reduce step
        sinks = torch.zeros(heads)
        decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                sliding_window=100, sinks=sinks, num_splits=1)
        decode_attention.paged_decode_attention(q, k_cache, v_cache, tables, lens, 0.1,
                                                sinks=sinks, num_splits=3)
    launches += rec
    with recording(prefill_attention, "_prefill_kernel") as rec:
        q = torch.empty(40, heads, head_dim, dtype=dtype)
        prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, tables[:1], torch.tensor([0, 40], dtype=torch.int32),
            lens[:1], 0.1)
        prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 1, 20, 30, 40], dtype=torch.int32),
            lens, 0.1, sliding_window=64, alibi_slopes=slopes)
        prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 1, 20, 30, 40], dtype=torch.int32),
            lens, 0.1, sliding_window=64, softcap=50.0)
        prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 1, 20, 30, 40], dtype=torch.int32),
            lens, 0.1, softcap=50.0)
        prefill_attention.paged_prefill_attention(
            q, k_cache, v_cache, tables, torch.tensor([0, 1, 20, 30, 40], dtype=torch.int32),
            lens, 0.1, sliding_window=64, sinks=torch.zeros(heads))
    launches += rec
    if config.latent_values is not None:
        return launches
    with recording(rmsnorm, "_rms_norm_kernel") as rec:
        x = torch.empty(8, heads * head_dim, dtype=dtype)
        rmsnorm.rms_norm(x, torch.empty(x.shape[1], dtype=dtype), 1e-6)
        rmsnorm.rms_norm(x, torch.empty(x.shape[1]), 1e-6, residual=x)
        rmsnorm.rms_norm(x, torch.empty(x.shape[1]), 1e-6, residual=x, weight_in_float32=True)
    launches += rec
    with recording(rotary, "_rotary_kernel") as rec:
        qkv = torch.empty(8, (heads + 2 * kv_heads) * head_dim, dtype=dtype)
        q = qkv[:, :heads * head_dim].view(8, heads, head_dim)
        k = qkv[:, heads * head_dim:(heads + kv_heads) * head_dim].view(8, kv_heads, head_dim)
        cos = torch.empty(8, head_dim // 2, dtype=dtype)
        rotary.apply_rotary_(q, k, cos, cos)
        # Qwen3's q/k norms fused in, over a full and a partial rotary dim.
        norms = (torch.empty(head_dim, dtype=dtype), torch.empty(head_dim, dtype=dtype))
        rotary.apply_rotary_(q, k, cos, cos, norm_weights=norms)
        rotary.apply_rotary_(q, k, cos[:, :head_dim // 4], cos[:, :head_dim // 4],
                             norm_weights=norms)
        if config.kv_dtype is None and config.latent_values is None:
            # ... storing K/V into a cache of the model's dtype too (the Triton path's layers)
            v = qkv[:, (heads + kv_heads) * head_dim:].view(8, kv_heads, head_dim)
            write = _common.CacheWrite(v, k_cache, v_cache, torch.zeros(8, dtype=torch.int64))
            rotary.apply_rotary_(q, k, cos, cos, write_kv=write)
            rotary.apply_rotary_(q, k, cos, cos, norm_weights=norms, write_kv=write)
    launches += rec
    with recording(gated_activation, "_silu_mul_kernel") as rec:
        # (any MLP width from MAX_BLOCK up launches the same variant)
        gated_activation.silu_and_mul(torch.empty(8, 2 * 3072, dtype=dtype))
    launches += rec
    with recording(fp8_matmul, "_fp8_linear_kernel", "_int4_linear_kernel") as rec:
        # A decode batch and a larger one through FP8 weights with 128x128 block scales (FP8
        # checkpoints) and with per-row scales (online quantization), through int8 codes in
        # groups of 128 (GPTQ / AWQ / compressed-tensors integer checkpoints), and through
        # packed 4-bit codes with zero points, in groups of 128 and per row.
        hidden = heads * head_dim
        weight = torch.empty(hidden, hidden, dtype=torch.float8_e4m3fn)
        codes = torch.empty(hidden, hidden, dtype=torch.int8)
        packed = torch.empty(hidden, hidden // 2, dtype=torch.uint8)
        for rows in (4, 48):
            x = torch.empty(rows, hidden, dtype=dtype)
            fp8_matmul.fp8_linear(x, weight, torch.empty(hidden, hidden // 128), 128)
            fp8_matmul.fp8_linear(x, weight, torch.empty(hidden, 1), hidden,
                                  torch.empty(hidden, dtype=dtype))
            fp8_matmul.fp8_linear(x, codes, torch.empty(hidden, hidden // 128), 128)
            fp8_matmul.fp8_linear(x, codes, torch.empty(hidden, hidden // 128), 128,  # asymmetric
                                  zero_point=torch.empty(hidden, hidden // 128,
                                                         dtype=torch.int16))
            for groups in (hidden // 128, 1):
                fp8_matmul.fp8_linear(x, packed, torch.empty(hidden, groups),
                                      hidden // groups,
                                      zero_point=torch.empty(hidden, groups, dtype=torch.int8))
    launches += rec
    with recording(fused_moe, "_expert_matmul_kernel", "_expert_int4_matmul_kernel") as rec:
        # 64 experts of a quarter of the hidden size each, top 8 (Qwen3-MoE's proportions):
        # a decode batch (16-row blocks) and a prefill (64-row blocks), gate/up then down.
        hidden, experts, top_k = heads * head_dim, 64, 8
        inter = hidden // 4
        w13 = torch.empty(experts, 2 * inter, hidden, dtype=dtype)
        w2 = torch.empty(experts, hidden, inter, dtype=dtype)
        fp8 = torch.empty(experts, hidden, inter, dtype=torch.float8_e4m3fn)
        codes = torch.empty(experts, hidden, inter, dtype=torch.int8)
        for tokens in (4, 1024):
            routing = torch.arange(tokens * top_k).remainder(experts).view(tokens, top_k)
            blocks = fused_moe.align_to_experts(
                routing, experts, fused_moe.expert_block_size(tokens * top_k, experts))
            fused_moe.expert_matmul(torch.empty(tokens, hidden, dtype=dtype), w13, blocks, top_k)
            down_input = torch.empty(tokens * top_k, inter, dtype=dtype)
            fused_moe.expert_matmul(down_input, w2, blocks, 1)
            # 8-bit experts: FP8 with 128-column block scales and per row, int8 codes in
            # groups of 128 with zero points
            fused_moe.expert_matmul(down_input, fp8, blocks, 1,
                                    torch.empty(experts, hidden, inter // 128), 128)
            fused_moe.expert_matmul(down_input, fp8, blocks, 1, torch.empty(experts, hidden, 1),
                                    inter)
            groups = torch.empty(experts, hidden, inter // 128)
            fused_moe.expert_matmul(down_input, codes, blocks, 1, groups, 128,
                                    torch.empty(groups.shape, dtype=torch.int16))
            # packed 4-bit codes in groups of 128, in activation order (GPTQ) and not
            packed = torch.empty(experts, hidden, inter // 2, dtype=torch.uint8)
            for order in (None, torch.empty(experts, inter, dtype=torch.int64)):
                fused_moe.expert_matmul(down_input, packed, blocks, 1, groups, 128,
                                        torch.empty(groups.shape, dtype=torch.int8), order)
            # MXFP4 experts (GPT-OSS): packed e2m1 codes in blocks of 32, E8M0 scale bytes, no
            # zero points
            for groups in (inter // 32, 1):  # and one block a row (a rank's single block)
                fused_moe.expert_matmul(down_input, packed, blocks, 1,
                                        torch.empty(experts, hidden, groups, dtype=torch.uint8),
                                        32, fp4=True)
    launches += rec
    return launches


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sm", type=int, nargs="+", default=[90],
                        help="compute capabilities to compile for (default: 90)")
    parser.add_argument("--quick", action="store_true",
                        help="a representative subset (what tests/test_kernels.py compiles)")
    args = parser.parse_args(argv)
    from ksana_llm.kernels import interpreter_mode

    if interpreter_mode():
        parser.error("unset TRITON_INTERPRET: the kernels must be compiled, not interpreted")
    for capability in args.sm:
        for config in CONFIGS:
            for launch in record_launches(config):
                if args.quick and not in_quick_set(config, launch):
                    continue
                result = compile_launch(launch, capability)
                print(json.dumps({"config": config.name, **result}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
