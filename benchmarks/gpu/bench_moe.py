"""`run.sh moe`: one MoE layer's experts, the grouped Triton path (kernels/fused_moe.py) against
the per-expert torch path, at Qwen3-30B-A3B's, Mixtral-8x7B's and gpt-oss-120b's shapes, bf16,
FP8 and MXFP4 weights.

    python -m benchmarks.gpu.bench_kernels moe --out DIR
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.bench_common import format_us, require_cuda, time_ms, write_results


# (name, experts, top k, hidden, expert intermediate): Qwen3-30B-A3B's, Mixtral-8x7B's and
# gpt-oss-120b's layers.
MOE_SHAPES = [("qwen3-30b-a3b", 128, 8, 2048, 768), ("mixtral-8x7b", 8, 2, 4096, 14336),
              ("gpt-oss-120b", 128, 4, 2880, 2880)]
QUANTIZATIONS = (None, "fp8", "mxfp4")
MOE_TOKENS = (1, 8, 32, 128, 512, 2048)


def bench_moe_case(name: str, experts: int, top_k: int, hidden: int, inter: int,
                   tokens: int, device: str = "cuda", dtype: torch.dtype = torch.bfloat16,
                   quantization: str | None = None) -> dict[str, Any]:
    """One MoE layer's experts (bf16 unless told; `quantization="fp8"`: FP8 weights with
    per-row scales, as online quantization loads them; "mxfp4": random MXFP4 blocks as
    gpt-oss's checkpoints hold them, kept packed): the grouped Triton path
    (kernels/fused_moe.py, two launches, no host sync: graph-capturable) against the per-expert
    torch path (a matmul pair per active expert after reading the counts back). GB/s counts the
    active experts' weight bytes, each read once."""
    from ksana_llm.layers.fused_kernels import use_fused_kernels
    from ksana_llm.layers.moe import FusedExperts
    from ksana_llm.layers.moe_routers import SoftmaxTopKRouter

    torch.manual_seed(0)
    from ksana_llm.loader.mxfp4 import BLOCK, mxfp4_weight

    layer = FusedExperts(experts, hidden, inter).to(device, dtype)
    if quantization != "mxfp4":
        layer.online_quantization = quantization
    router = SoftmaxTopKRouter(hidden, experts, top_k, renormalize=True).to(device)
    with torch.no_grad():
        router.weight.normal_(0, 0.02)
        for e in range(experts):  # as a checkpoint's per-expert tensors load
            for part, shape in (("gate", (inter, hidden)), ("up", (inter, hidden)),
                                ("down", (hidden, inter))):
                if quantization == "mxfp4":
                    groups = (shape[0], shape[1] // BLOCK)
                    weight = mxfp4_weight(
                        torch.randint(0, 256, (*groups, BLOCK // 2), dtype=torch.uint8,
                                      device=device),
                        torch.randint(118, 122, groups, dtype=torch.uint8, device=device))
                else:
                    weight = torch.randn(shape, device=device, dtype=dtype) * 0.02
                layer.load_checkpoint_tensor(f"{e}.{part}_proj.weight", weight)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        routing = router(x.float())

        def run(grouped: bool) -> torch.Tensor:
            with use_fused_kernels(grouped):
                return layer(x, routing)

        timed = {"grouped": time_ms(lambda: run(True)), "per_expert": time_ms(lambda: run(False))}
        err = (run(True).float() - run(False).float()).abs().max().item()
    active = routing.experts.unique().numel()
    # bytes of the values (packed MXFP4: half a byte each) and of their scales (MXFP4: a byte
    # per 32 values), each active expert's read once
    weight_bytes = active * sum(t[0].numel() * t.element_size()
                                for t in (layer.w13, layer.w2, layer.w13_scale, layer.w2_scale)
                                if t is not None)
    best = {path: min(v for v in (t["ms"], t.get("ms_graph")) if v is not None)
            for path, t in timed.items()}
    return {"shape": name, "weights": quantization or str(dtype).removeprefix("torch."),
            "tokens": tokens, "experts": experts, "top_k": top_k,
            "active_experts": active, **timed,
            "grouped_weight_gbps": weight_bytes / best["grouped"] / 1e6,
            "speedup_vs_per_expert": best["per_expert"] / best["grouped"], "max_abs_err": err}


def stage_moe(out_dir: Path) -> int:
    require_cuda()
    rows_out = []
    for quantization in QUANTIZATIONS:
        for name, experts, top_k, hidden, inter in MOE_SHAPES:
            for tokens in MOE_TOKENS:
                row = bench_moe_case(name, experts, top_k, hidden, inter, tokens,
                                     quantization=quantization)
                rows_out.append(row)
                grouped, per_expert = row["grouped"], row["per_expert"]
                print(f"moe {name:14s} {row['weights']:5s} T={tokens:5d} active "
                      f"{row['active_experts']:3d} grouped {grouped['ms'] * 1e3:8.1f} us (graph "
                      f"{format_us(grouped.get('ms_graph'))}) {row['grouped_weight_gbps']:6.0f} GB/s "
                      f"| per-expert {per_expert['ms'] * 1e3:8.1f} us (graph "
                      f"{format_us(per_expert.get('ms_graph'))}) | x{row['speedup_vs_per_expert']:.2f}"
                      f" | err {row['max_abs_err']:.1e}")
    write_results(out_dir, "moe", rows_out)
    return 0
