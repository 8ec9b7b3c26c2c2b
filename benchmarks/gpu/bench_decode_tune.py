"""Decode attention's launch settings swept on the GPU (`bench_kernels decode-tune`): the data
for choosing `kernels.decode_attention._decode_config` and `choose_num_splits` by measurement."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.bench_common import require_cuda, write_results
from benchmarks.gpu.paged_batches import HEAD_DIM, HEADS, KV_HEADS, make_paged


# Launch settings the tuning sweep tries: (BLOCK_N, num_warps, num_stages); the default is
# decode_attention._decode_config's (64, 4, 2) for bf16 and 128-wide heads.
DECODE_TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 4, 2),
                (128, 8, 2), (128, 8, 3), (256, 8, 2)]
# The reference workload's decode steps: 256 sequences whose contexts spread over 100-2048.
TUNE_CASES = [("b256-ctx600", 256, 550, 650), ("b256-ctx100-2048", 256, 100, 2048)]


def stage_decode_tune(out_dir: Path) -> int:
    """Paged decode attention (bf16, Qwen3-0.6B's heads) under every DECODE_TILES setting and
    split count 1 / 2 / auto, each checked against the reference on a few sequences and timed
    (do_bench median): the data for choosing `_decode_config` and `choose_num_splits` on the
    GPU rather than by reasoning. Prints each case's settings fastest first."""
    import triton.testing

    from ksana_llm.kernels import paged_decode_attention
    from ksana_llm.kernels.reference import paged_decode_attention_ref

    require_cuda()
    rows = []
    scale = HEAD_DIM ** -0.5
    for name, batch, lo, hi in TUNE_CASES:
        gen = torch.Generator().manual_seed(1)
        lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
        paged = make_paged(lens, torch.bfloat16)
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.lens, scale)
        few = slice(0, 4)
        expected = paged_decode_attention_ref(q[few], paged.k_cache, paged.v_cache,
                                              paged.block_tables[few], paged.lens[few], scale)
        kv_bytes = sum(lens) * KV_HEADS * 2 * HEAD_DIM * q.element_size()
        out = torch.empty_like(q)
        case_rows = []
        for tiles in DECODE_TILES:
            for splits in (None, 1, 2):
                def run(tiles=tiles, splits=splits) -> torch.Tensor:
                    return paged_decode_attention(*args, out=out, tiles=tiles, num_splits=splits)
                row: dict[str, Any] = {"case": name, "tiles": list(tiles),
                                       "num_splits": "auto" if splits is None else splits}
                try:
                    err = (run()[few].float() - expected.float()).abs().max().item()
                    ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                    row.update(ms=ms, gbps=kv_bytes / ms / 1e6, max_abs_err=err)
                except Exception as exc:  # noqa: BLE001 - a setting that fails is a result too
                    row["error"] = f"{type(exc).__name__}: {exc}"[:300]
                case_rows.append(row)
        rows += case_rows
        print(f"\ndecode-tune {name} (KV {kv_bytes / 1e9:.2f} GB):")
        for row in sorted(case_rows, key=lambda r: r.get("ms", float("inf"))):
            what = (f"{row['ms'] * 1e3:8.1f} us {row['gbps']:6.0f} GB/s err "
                    f"{row['max_abs_err']:.1e}") if "ms" in row else row["error"][:80]
            print(f"  tiles {tuple(row['tiles'])!s:13s} splits {row['num_splits']!s:4s} {what}")
    write_results(out_dir, "decode_tune", rows)
    return 0
