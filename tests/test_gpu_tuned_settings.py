"""`benchmarks/gpu/tuned_settings.py` (run.sh's engine-qwen3-tuned stage): the decode settings
chosen from a decode-tune sweep's rows, and the engine benchmark run under them (--smoke on
CPU: the plumbing; the choice only acts on a GPU's Triton path)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from benchmarks.gpu.bench_decode_tune import (DECODE_TILES, SPLIT_CASES, SPLIT_FILLS,
                                              TILE_CASES, split_counts)
from benchmarks.gpu.tuned_settings import DEFAULT_TILES, WORKLOAD_CASE, pick_settings
from ksana_llm.kernels import choose_num_splits

NUM_SMS = 132
CONTEXT = 2048


CASES = TILE_CASES + SPLIT_CASES


def sweep_rows(tile_ms: dict[tuple[int, int, int], float], ideal_fill: tuple[float, float]
               ) -> list[dict]:
    """Rows as decode-tune writes them: the workload case at each tile setting (split count
    "auto"), and every case at each tile setting and split count, fastest at the count
    `ideal_fill` chooses (1 ms more per split away from it)."""
    rows = [{"case": WORKLOAD_CASE, "batch": 256, "num_sms": NUM_SMS, "max_context": CONTEXT,
             "tiles": list(t), "num_splits": "auto", "ms": ms} for t, ms in tile_ms.items()]
    for name, batch, *_ in CASES:
        ideal = choose_num_splits(batch, 8, CONTEXT, NUM_SMS, split_fill=ideal_fill)
        for tiles in DECODE_TILES:
            for splits in split_counts(batch, NUM_SMS):
                rows.append({"case": name, "batch": batch, "num_sms": NUM_SMS,
                             "max_context": CONTEXT, "tiles": list(tiles),
                             "num_splits": splits, "ms": 1.0 + abs(splits - ideal)})
    return rows


def chosen_splits(fill: tuple[float, float]) -> list[int]:
    return [choose_num_splits(batch, 8, CONTEXT, NUM_SMS, split_fill=fill)
            for _, batch, *_ in CASES]


def test_the_fastest_settings_are_picked_when_clearly_faster():
    tile_ms = {t: 1.0 for t in DECODE_TILES}
    tile_ms[(128, 8, 2)] = 0.8
    rows = sweep_rows(tile_ms, ideal_fill=(16.0, 32.0))
    # A launch in row order (decode-tune times the default so, for comparison) is never a
    # candidate: the engine's launches take sequences longest first.
    rows.append({"case": WORKLOAD_CASE, "batch": 256, "num_sms": NUM_SMS,
                 "max_context": CONTEXT, "tiles": [64, 8, 2], "num_splits": "auto",
                 "order": "none", "ms": 0.1})
    settings = pick_settings(rows)
    assert settings.tiles == (128, 8, 2) and settings.tiles_speedup == pytest.approx(1.25)
    # Whichever fill wins, it chooses the fastest split count in every case (the full batch
    # split too, here).
    assert chosen_splits(settings.split_fill) == chosen_splits((16.0, 32.0))
    assert chosen_splits(settings.split_fill)[0] > 1
    assert settings.split_fill in SPLIT_FILLS and settings.split_speedup > 1
    assert settings.env() == {"KSANA_DECODE_TILES": "128,8,2",
                              "KSANA_DECODE_SPLIT_FILL": ",".join(
                                  f"{f:g}" for f in settings.split_fill)}


def test_the_defaults_stay_unless_a_setting_gains_enough():
    tile_ms = {t: 1.0 for t in DECODE_TILES}
    tile_ms[(128, 8, 2)] = 0.99  # 1%: within noise
    settings = pick_settings(sweep_rows(tile_ms, ideal_fill=SPLIT_FILLS[0]))
    assert settings.tiles == DEFAULT_TILES and settings.split_fill == SPLIT_FILLS[0]
    assert settings.tiles_speedup == settings.split_speedup == 1.0
    with pytest.raises(ValueError, match="no timing of the default tiles"):
        pick_settings([r for r in sweep_rows(tile_ms, SPLIT_FILLS[0])
                       if r["tiles"] != list(DEFAULT_TILES)])


def test_engine_benchmark_runs_under_the_tuned_settings(tmp_path):
    tile_ms = {t: 1.0 for t in DECODE_TILES}
    tile_ms[(128, 4, 2)] = 0.5
    source = tmp_path / "decode_tune.json"
    source.write_text(json.dumps({"device": "test", "results": sweep_rows(tile_ms, (2.0, 4.0))}))
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    env.pop("KSANA_DECODE_TILES", None)
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks.gpu.tuned_settings", "--from", str(source), "--out",
         str(tmp_path), "--", sys.executable, "-m", "benchmarks.gpu.bench_engine", "--smoke",
         "--models", "qwen3-0.6b", "--ours-only", "--tag", "tuned", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    settings = json.loads((tmp_path / "tuned_settings.json").read_text())
    assert settings["env"]["KSANA_DECODE_TILES"] == "128,4,2"
    report = json.loads((tmp_path / "engine_qwen3-0.6b-tuned.json").read_text())
    assert report["tag"] == "tuned" and report["decode_env"] == settings["env"]
    assert report["throughput"]["ksana_llm"]["exact_lengths"]
    assert report["throughput"]["hf_generate_batch"] is None  # --ours-only: no peers
    assert report["batch1"]["graphs_on"]["ms_per_token"] > 0
    assert "ksana_llm graphs on (tuned)" in proc.stdout
    # Without the sweep's file the stage says what to run first.
    missing = subprocess.run([sys.executable, "-m", "benchmarks.gpu.tuned_settings", "--from",
                              str(tmp_path / "none.json")], capture_output=True, text=True)
    assert missing.returncode != 0 and "run the decode-tune stage first" in missing.stderr
