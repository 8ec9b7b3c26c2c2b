"""GPU stages of benchmarks/gpu/run.sh, one sub-command each, each writing its own JSON.

    python -m benchmarks.gpu.bench_kernels env     --out DIR  # device, library versions
    python -m benchmarks.gpu.bench_kernels tests   --out DIR  # the kernel tests natively
    python -m benchmarks.gpu.bench_kernels decode  --out DIR  # paged decode attention, GB/s
    python -m benchmarks.gpu.bench_kernels decode-tune --out DIR  # its launch settings swept
    python -m benchmarks.gpu.bench_kernels prefill --out DIR  # paged prefill, TFLOP/s
    python -m benchmarks.gpu.bench_kernels fp8-matmul --out DIR  # quantized-weight matmuls vs bf16
    python -m benchmarks.gpu.bench_kernels moe     --out DIR  # grouped MoE experts vs per-expert

Shapes are Qwen3-0.6B's attention (16 query heads, 8 KV heads, head dim 128, block 16). Each
benchmark times its peer in the same run — the torch backend's method (gather the paged K/V, then
`scaled_dot_product_attention`) — and prints the ratio. Timings are triton's `do_bench` medians
(L2 flushed between runs) and, where capture works, the same under a CUDA graph.
"""

from __future__ import annotations

import argparse
import collections
import importlib.util
import json
import os
import platform
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from benchmarks.gpu.bench_common import require_cuda, time_ms, write_json, write_results
from benchmarks.gpu.bench_decode_tune import stage_decode_tune
from benchmarks.gpu.bench_moe import stage_moe
from benchmarks.gpu.paged_batches import (BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, gather_slots,
                                         make_paged, torch_decode)

REPO = Path(__file__).resolve().parents[2]


# --------------------------------------------------------------------------------------------
# env
# --------------------------------------------------------------------------------------------


def stage_env(out_dir: Path) -> int:
    info: dict[str, Any] = {"python": platform.python_version(), "torch": torch.__version__,
                            "cuda_available": torch.cuda.is_available()}
    try:
        import triton
        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        info.update(device=props.name, capability=f"{props.major}.{props.minor}",
                    sms=props.multi_processor_count, cuda=torch.version.cuda,
                    memory_gib=round(props.total_memory / 2**30, 1))
    print(json.dumps(info, indent=2))
    write_json(out_dir, "env", info)
    return 0


# --------------------------------------------------------------------------------------------
# tests
# --------------------------------------------------------------------------------------------


def stage_tests(out_dir: Path) -> int:
    """tests/test_kernels.py, test_kernels_layers.py and test_kernels_prefill.py natively on the
    GPU (no interpreter): fp32, fp16 and bf16; soft-capping (Gemma 2) and attention sinks
    (GPT-OSS); the FP8-weight matmul's and the grouped MoE matmul's tests; and the sampler's device token histories (tests/test_token_history.py) on the GPU.

    Natively every kernel variant is compiled once (the first H200 run spent its whole 180 s
    there, one test at a time, and printed nothing): so the tests spread over worker processes
    when pytest-xdist is installed (the GPU image has it), each test has a time limit that
    names the one that hangs, and pytest's output streams into the stage's log as it runs."""
    junit = out_dir / "kernel_tests.xml"
    out_dir.mkdir(parents=True, exist_ok=True)
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, "-m", "pytest", "tests/test_kernels.py",
               "tests/test_kernels_layers.py", "tests/test_kernels_prefill.py",
               "tests/test_kernels_softcap.py", "tests/test_kernels_sinks.py",
               "tests/test_fp8_matmul.py",
               "tests/test_kernels_moe.py", "tests/test_kernels_moe_fp4.py",
               "tests/test_token_history.py", "-q", "-rfE",
               "-p", "no:cacheprovider", f"--junitxml={junit}"]
    if importlib.util.find_spec("pytest_timeout") is not None:
        command.append("--timeout=150")
    if importlib.util.find_spec("xdist") is not None:
        command += ["-n", str(max(1, min(8, (os.cpu_count() or 2) // 2)))]
    start = time.perf_counter()
    returncode, tail = run_streamed(command, env)
    seconds = time.perf_counter() - start
    summary: dict[str, Any] = {"returncode": returncode, "seconds": round(seconds, 1),
                               "command": command[3:]}
    if junit.exists():
        suite = ET.parse(junit).getroot()
        suite = suite if suite.tag == "testsuite" else suite.find("testsuite")
        summary.update({key: int(suite.get(key, 0))
                        for key in ("tests", "failures", "errors", "skipped")})
        summary["failed"] = [case.get("name") for case in suite.iter("testcase")
                             if case.find("failure") is not None or case.find("error") is not None]
    if returncode:
        summary["output_tail"] = tail
    write_json(out_dir, "kernel_tests", summary)
    return returncode


def run_streamed(command: list[str], env: dict[str, str], keep: int = 4000) -> tuple[int, str]:
    """Run `command` in the repository with its output passed on line by line as it comes (into
    run.sh's log, so a stage stopped at its time limit still shows how far it got); returns
    the exit status and the last `keep` characters of the output."""
    tail: collections.deque[str] = collections.deque()
    size = 0
    with subprocess.Popen(command, cwd=REPO, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True) as proc:
        for line in proc.stdout or ():  # stdout=PIPE: always a stream
            print(line, end="", flush=True)
            tail.append(line)
            size += len(line)
            while size > keep and len(tail) > 1:
                size -= len(tail.popleft())
    return proc.returncode, "".join(tail)


# --------------------------------------------------------------------------------------------
# decode
# --------------------------------------------------------------------------------------------

# (name, batch, shortest context, longest context)
DECODE_CASES = [("b256-ctx600", 256, 550, 650), ("b4-ctx8k", 4, 7800, 8192)]


def bench_decode_case(name: str, batch: int, lo: int, hi: int, dtype: torch.dtype
                      ) -> dict[str, Any]:
    from ksana_llm.kernels import choose_num_splits, paged_decode_attention
    from ksana_llm.kernels.reference import paged_decode_attention_ref

    scale = HEAD_DIM ** -0.5
    gen = torch.Generator().manual_seed(0)
    lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
    paged = make_paged(lens, dtype)
    q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    out = torch.empty_like(q)
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.lens, scale)
    result = paged_decode_attention(*args, out=out).clone()
    few = slice(0, 4)  # correctness at this shape on a few sequences (the reference is slow)
    expected = paged_decode_attention_ref(q[few], paged.k_cache, paged.v_cache,
                                          paged.block_tables[few], paged.lens[few], scale)
    max_err = (result[few].float() - expected.float()).abs().max().item()
    kernel = time_ms(lambda: paged_decode_attention(*args, out=out))

    slots, mask = gather_slots(paged, max(lens))
    peer = time_ms(lambda: torch_decode(q, paged, slots, mask, scale))
    peer_err = (torch_decode(q, paged, slots, mask, scale).float()
                - result.float()).abs().max().item()

    element = q.element_size()
    kv_bytes = sum(lens) * KV_HEADS * 2 * HEAD_DIM * element
    io_bytes = 2 * q.numel() * element + paged.block_tables.numel() * 4 + batch * 4
    total_bytes = kv_bytes + io_bytes
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    return {
        "case": name, "dtype": str(dtype).removeprefix("torch."), "batch": batch,
        "mean_context": sum(lens) / batch, "heads": HEADS, "kv_heads": KV_HEADS,
        "head_dim": HEAD_DIM, "block_size": BLOCK_SIZE,
        "num_splits": choose_num_splits(batch, KV_HEADS,
                                        paged.block_tables.shape[1] * BLOCK_SIZE, sms),
        "bytes": total_bytes, "max_abs_err_vs_reference": max_err,
        "max_abs_err_vs_torch": peer_err, "triton": kernel, "torch": peer,
        "triton_gbps": total_bytes / kernel["ms"] / 1e6,
        "triton_graph_gbps": (total_bytes / kernel["ms_graph"] / 1e6
                              if kernel.get("ms_graph") else None),
        "torch_gbps": total_bytes / peer["ms"] / 1e6,
        "speedup_vs_torch": peer["ms"] / kernel["ms"],
    }


def stage_decode(out_dir: Path) -> int:
    require_cuda()
    rows = []
    for dtype in (torch.bfloat16, torch.float16):
        for name, batch, lo, hi in DECODE_CASES:
            row = bench_decode_case(name, batch, lo, hi, dtype)
            rows.append(row)
            kernel, peer = row["triton"], row["torch"]
            print(f"decode {name:12s} {row['dtype']:8s} splits={row['num_splits']:2d} "
                  f"triton {kernel['ms'] * 1e3:8.1f} us {row['triton_gbps']:7.0f} GB/s | "
                  f"torch {peer['ms'] * 1e3:8.1f} us {row['torch_gbps']:7.0f} GB/s | "
                  f"x{row['speedup_vs_torch']:.2f} | err {row['max_abs_err_vs_reference']:.2e}")
    write_results(out_dir, "decode_attention", rows)
    return 0


# --------------------------------------------------------------------------------------------
# prefill
# --------------------------------------------------------------------------------------------


@dataclass
class PrefillCase:
    name: str
    batch: int
    query_len: int  # new tokens per sequence
    prefix_len: int  # cached tokens before them


PREFILL_CASES = [PrefillCase("b8-q1024", 8, 1024, 0),
                 PrefillCase("b8-q512-prefix1536", 8, 512, 1536)]


def bench_prefill_case(case: PrefillCase) -> dict[str, Any]:
    from ksana_llm.kernels import paged_prefill_attention

    scale = HEAD_DIM ** -0.5
    dtype = torch.bfloat16
    n, m, p = case.batch, case.query_len, case.prefix_len
    paged = make_paged([p + m] * n, dtype)
    q = torch.randn(n * m, HEADS, HEAD_DIM, device="cuda", dtype=dtype)
    starts = torch.arange(0, n * m + 1, m, dtype=torch.int32, device="cuda")
    args = (q, paged.k_cache, paged.v_cache, paged.block_tables, starts, paged.lens, scale)
    out = torch.empty_like(q)
    kernel = time_ms(lambda: paged_prefill_attention(*args, out=out))

    # Peer: SDPA (flash / efficient backend) over K/V already gathered into dense tensors — it
    # skips the paging work the kernel does, so the ratio flatters the peer.
    pos = torch.arange(p + m, device="cuda")
    slots = paged.block_tables.long()[:, pos // BLOCK_SIZE] * BLOCK_SIZE + pos % BLOCK_SIZE
    k = paged.k_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    v = paged.v_cache.view(-1, KV_HEADS, HEAD_DIM)[slots].transpose(1, 2).contiguous()
    qd = q.view(n, m, HEADS, HEAD_DIM).transpose(1, 2)
    # Causal with the queries at the end of the context: a bottom-right aligned mask.
    attn_mask = None if p == 0 else (torch.arange(m, device="cuda")[:, None] + p >= pos[None, :])

    def peer_fn() -> torch.Tensor:
        return F.scaled_dot_product_attention(qd, k, v, attn_mask=attn_mask, is_causal=p == 0,
                                              scale=scale, enable_gqa=True)

    peer = time_ms(peer_fn)
    result = paged_prefill_attention(*args, out=out)
    err = (peer_fn().transpose(1, 2).reshape(n * m, HEADS, HEAD_DIM).float()
           - result.float()).abs().max().item()
    # QK^T and PV over the causal part: 2 matmuls x 2 flops per multiply-add.
    pairs = n * (m * p + m * (m + 1) / 2)
    flops = 4 * pairs * HEADS * HEAD_DIM
    return {**asdict(case), "dtype": "bfloat16", "triton": kernel, "torch": peer,
            "triton_tflops": flops / kernel["ms"] / 1e9, "torch_tflops": flops / peer["ms"] / 1e9,
            "speedup_vs_torch": peer["ms"] / kernel["ms"], "max_abs_err_vs_torch": err}


def stage_prefill(out_dir: Path) -> int:
    require_cuda()
    rows = []
    for case in PREFILL_CASES:
        row = bench_prefill_case(case)
        rows.append(row)
        print(f"prefill {case.name:20s} triton {row['triton']['ms'] * 1e3:8.1f} us "
              f"{row['triton_tflops']:6.1f} TFLOP/s | torch {row['torch']['ms'] * 1e3:8.1f} us "
              f"{row['torch_tflops']:6.1f} TFLOP/s | x{row['speedup_vs_torch']:.2f} | "
              f"err {row['max_abs_err_vs_torch']:.2e}")
    write_results(out_dir, "prefill_attention", rows)
    return 0


# --------------------------------------------------------------------------------------------
# FP8-weight matmul
# --------------------------------------------------------------------------------------------

# (name, N, K): Llama-3-8B's projections (QKV, gate+up, down) and Qwen3-0.6B's gate+up.
FP8_MATMUL_SHAPES = [("llama8b-qkv", 6144, 4096), ("llama8b-gate-up", 28672, 4096),
                     ("llama8b-down", 4096, 14336), ("qwen3-0.6b-gate-up", 6144, 1024)]
FP8_MATMUL_ROWS = (1, 8, 32, 64, 128, 256)


def bench_fp8_matmul_case(name: str, n: int, k: int, rows: int, layout: str) -> dict[str, Any]:
    """The Triton quantized-weight matmul (FP8 with 128-column block scales or per-row scales;
    int8 codes with 128-column group scales, as GPTQ int8 / compressed-tensors int8 checkpoints
    load; packed 4-bit codes with zero points, as GPTQ int4 / AWQ / W4A16 ones load) against
    bf16 cuBLAS on the same shape and against the dequantize-then-matmul path the engine takes
    for larger batches. GB/s counts the weight bytes each reads once."""
    from ksana_llm.kernels.fp8_matmul import fp8_linear
    from ksana_llm.kernels.reference import fp8_linear_ref
    from ksana_llm.loader.weight_quant import quantize_fp8

    weight = torch.randn(n, k, device="cuda") * 0.02
    if layout == "block128":
        data, block_scale = quantize_fp8(weight, (128, 128))
        scale = block_scale.repeat_interleave(128, 0)[:n].contiguous()
        group = 128
    elif layout == "int8-g128":  # symmetric 8-bit codes, as a GPTQ int8 weight holds
        data = torch.randint(-128, 128, (n, k), device="cuda", dtype=torch.int8)
        scale = torch.rand(n, k // 128, device="cuda") * 0.0003
        group = 128
    elif layout == "int4-g128":  # packed 4-bit codes with zero points (GPTQ int4, AWQ)
        data = torch.randint(0, 256, (n, k // 2), device="cuda", dtype=torch.uint8)
        scale = torch.rand(n, k // 128, device="cuda") * 0.005
        zero_point = torch.randint(0, 16, (n, k // 128), device="cuda", dtype=torch.int8)
        group = 128
    else:
        data, scale = quantize_fp8(weight, (1, k))
        group = k
    if layout != "int4-g128":
        zero_point = None
    dense = weight.to(torch.bfloat16)
    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
    kernel = time_ms(lambda: fp8_linear(x, data, scale, group, None, zero_point))
    cublas = time_ms(lambda: F.linear(x, dense))
    dequant = time_ms(lambda: fp8_linear_ref(x, data, scale, group, None, zero_point))
    err = (fp8_linear(x, data, scale, group, None, zero_point).float()
           - fp8_linear_ref(x.float(), data, scale, group, None, zero_point)).abs().max().item()
    weight_bytes = data.numel() * data.element_size()
    return {"shape": name, "n": n, "k": k, "rows": rows, "scales": layout, "triton": kernel,
            "bf16_cublas": cublas, "dequant_then_matmul": dequant,
            "triton_weight_gbps": weight_bytes / kernel["ms"] / 1e6,
            "cublas_weight_gbps": 2 * n * k / cublas["ms"] / 1e6,
            "speedup_vs_bf16": cublas["ms"] / kernel["ms"],
            "speedup_vs_dequant": dequant["ms"] / kernel["ms"], "max_abs_err": err}


def stage_fp8_matmul(out_dir: Path) -> int:
    require_cuda()
    rows_out = []
    for layout in ("block128", "per-row", "int8-g128", "int4-g128"):
        for name, n, k in FP8_MATMUL_SHAPES:
            for rows in FP8_MATMUL_ROWS:
                row = bench_fp8_matmul_case(name, n, k, rows, layout)
                rows_out.append(row)
                print(f"w8 {name:18s} {layout:9s} m={rows:3d} triton "
                      f"{row['triton']['ms'] * 1e3:8.1f} us {row['triton_weight_gbps']:6.0f} GB/s"
                      f" | bf16 {row['bf16_cublas']['ms'] * 1e3:8.1f} us x"
                      f"{row['speedup_vs_bf16']:.2f} | dequant x{row['speedup_vs_dequant']:.2f}"
                      f" | err {row['max_abs_err']:.1e}")
    write_results(out_dir, "fp8_matmul", rows_out)
    return 0


# --------------------------------------------------------------------------------------------
# MoE experts
# --------------------------------------------------------------------------------------------

STAGES = {"env": stage_env, "tests": stage_tests, "decode": stage_decode,
          "decode-tune": stage_decode_tune,
          "prefill": stage_prefill, "fp8-matmul": stage_fp8_matmul, "moe": stage_moe}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("stage", choices=sorted(STAGES))
    parser.add_argument("--out", type=Path,
                        default=Path(os.environ.get("OUT") or REPO / "benchmarks/gpu/results"),
                        help="folder for the stage's JSON (default: $OUT, else "
                             "benchmarks/gpu/results)")
    args = parser.parse_args(argv)
    return STAGES[args.stage](args.out)


if __name__ == "__main__":
    sys.exit(main())
