"""Decode attention's launch settings swept on the GPU (`bench_kernels decode-tune`): the data
for choosing `kernels.decode_attention._decode_config` and `choose_num_splits` by measurement,
and what `benchmarks.gpu.tuned_settings` reads to run the engine under the fastest."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from benchmarks.gpu.bench_common import require_cuda, write_results
from benchmarks.gpu.paged_batches import BLOCK_SIZE, HEAD_DIM, HEADS, KV_HEADS, make_paged


# Launch settings the tuning sweep tries: (BLOCK_N, num_warps, num_stages); the default is
# decode_attention._decode_config's (64, 4, 2) for bf16 and 128-wide heads.
DEFAULT_TILES = (64, 4, 2)
DECODE_TILES = [(32, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2), (64, 8, 3), (128, 4, 2),
                (128, 8, 2), (128, 8, 3), (256, 8, 2)]
# The reference workload's full decode steps: 256 sequences whose contexts spread over
# 100-2048 (one split: the tile settings are what matters).
TILE_CASES = [("b256-ctx600", 256, 550, 650), ("b256-ctx100-2048", 256, 100, 2048)]
# Its tail, as requests finish: fewer sequences with long contexts, where the split count
# decides how much of the GPU a launch fills.
SPLIT_CASES = [("b64-ctx1000-2048", 64, 1000, 2048), ("b24-ctx1200-2048", 24, 1200, 2048),
               ("b8-ctx1500-2048", 8, 1500, 2048), ("b1-ctx700", 1, 700, 700)]
# Block-table width of the engine's decode graphs in the workload (max_model_len 2048): the
# capacity the split count is chosen from.
GRAPH_WIDTH = 2048 // BLOCK_SIZE
# `choose_num_splits`' (fill, target) programs per SM compared; the first is the default. The
# last splits even the full batch (2,048 programs at 8 KV heads): ragged contexts leave SMs
# idle at a launch's end, which shorter programs even out.
SPLIT_FILLS = [(1.0, 2.0), (2.0, 4.0), (4.0, 8.0), (8.0, 16.0), (16.0, 32.0)]


def split_counts(batch: int, num_sms: int) -> list[int]:
    """The split counts a case is timed at: powers of two, and each SPLIT_FILLS choice."""
    from ksana_llm.kernels import choose_num_splits

    chosen = {choose_num_splits(batch, KV_HEADS, GRAPH_WIDTH * BLOCK_SIZE, num_sms,
                                split_fill=fill) for fill in SPLIT_FILLS}
    return sorted({1, 2, 4, 8, 16} | chosen)


def stage_decode_tune(out_dir: Path) -> int:
    """Paged decode attention (bf16, Qwen3-0.6B's heads, the graphs' block-table width) under
    every DECODE_TILES setting at `split_counts` (the full-batch cases at the default's "auto"
    too), each checked against the reference on a few sequences and timed (do_bench median):
    the data for choosing `_decode_config` and `choose_num_splits` on the GPU rather than by
    reasoning. Every launch takes the sequences longest context first, as the engine's do
    (`order`); the full-batch cases also time the default settings in row order ("order":
    "none"), what that ordering buys. Prints each case's settings fastest first."""
    from ksana_llm.runner.host_arrays import longest_first

    import triton.testing

    from ksana_llm.kernels import paged_decode_attention
    from ksana_llm.kernels.reference import paged_decode_attention_ref

    require_cuda()
    num_sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows = []
    scale = HEAD_DIM ** -0.5
    cases = [(c, [None, *split_counts(c[1], num_sms)]) for c in TILE_CASES] + \
        [(c, split_counts(c[1], num_sms)) for c in SPLIT_CASES]
    for (name, batch, lo, hi), split_options in cases:
        gen = torch.Generator().manual_seed(1)
        lens = torch.randint(lo, hi + 1, (batch,), generator=gen).tolist()
        paged = make_paged(lens, torch.bfloat16, width=GRAPH_WIDTH)
        q = torch.randn(batch, HEADS, HEAD_DIM, device="cuda", dtype=torch.bfloat16)
        args = (q, paged.k_cache, paged.v_cache, paged.block_tables, paged.lens, scale)
        few = slice(0, min(4, batch))
        expected = paged_decode_attention_ref(q[few], paged.k_cache, paged.v_cache,
                                              paged.block_tables[few], paged.lens[few], scale)
        kv_bytes = sum(lens) * KV_HEADS * 2 * HEAD_DIM * q.element_size()
        out = torch.empty_like(q)
        order = torch.from_numpy(longest_first(lens)).cuda()
        case_rows = []
        variants = [(tiles, splits, order) for tiles in DECODE_TILES for splits in split_options]
        if split_options[0] is None:  # a full-batch case: the default in row order too
            variants.append((DEFAULT_TILES, None, None))
        for tiles, splits, taken in variants:
            def run(tiles=tiles, splits=splits, taken=taken) -> torch.Tensor:
                return paged_decode_attention(*args, out=out, tiles=tiles, num_splits=splits,
                                              order=taken)
            row: dict[str, Any] = {
                "case": name, "batch": batch, "num_sms": num_sms,
                "max_context": paged.block_tables.shape[1] * BLOCK_SIZE,
                "tiles": list(tiles), "num_splits": "auto" if splits is None else splits,
                "order": "none" if taken is None else "longest_first"}
            try:
                err = (run()[few].float() - expected.float()).abs().max().item()
                ms = triton.testing.do_bench(run, warmup=25, rep=100, return_mode="median")
                row.update(ms=ms, gbps=kv_bytes / ms / 1e6, max_abs_err=err)
            except Exception as exc:  # noqa: BLE001 - a setting that fails is a result too
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            case_rows.append(row)
        rows += case_rows
        print(f"\ndecode-tune {name} (KV {kv_bytes / 1e9:.3f} GB):")
        for row in sorted(case_rows, key=lambda r: r.get("ms", float("inf")))[:12]:
            what = (f"{row['ms'] * 1e3:8.1f} us {row['gbps']:6.0f} GB/s err "
                    f"{row['max_abs_err']:.1e}") if "ms" in row else row["error"][:80]
            print(f"  tiles {tuple(row['tiles'])!s:13s} splits {row['num_splits']!s:4s} "
                  f"order {row['order']:13s} {what}")
        unordered = [r for r in case_rows if r["order"] == "none" and "ms" in r]
        ordered = [r for r in case_rows if r["order"] != "none" and "ms" in r
                   and tuple(r["tiles"]) == DEFAULT_TILES and r["num_splits"] == "auto"]
        if unordered and ordered:
            print(f"  longest-first order vs row order (default settings): "
                  f"{unordered[0]['ms'] / ordered[0]['ms']:.3f}x")
    write_results(out_dir, "decode_tune", rows)
    from benchmarks.gpu.tuned_settings import pick_settings

    print(f"\nfastest settings: {pick_settings(rows)}")
    return 0
