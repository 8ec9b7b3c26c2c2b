"""The decode-attention settings `run.sh decode-tune` measured fastest, applied to a command:

    python -m benchmarks.gpu.tuned_settings --from DIR/decode_tune.json [--out DIR] -- CMD ...

picks the tiles (BLOCK_N, num_warps, num_stages) fastest on the workload's full decode step and
the split heuristic's (fill, target) fastest over all the swept cases, full steps and the tail
(`bench_decode_tune`), writes them
to DIR/tuned_settings.json, and runs CMD with KSANA_DECODE_TILES / KSANA_DECODE_SPLIT_FILL set
(`kernels.decode_attention` reads them). run.sh's `engine-qwen3-tuned` stage runs the engine's
workload that way, so one device call shows whether the sweep's winner wins end to end before
it becomes the default. A setting replaces the default only when it is MIN_GAIN faster.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from benchmarks.gpu.bench_decode_tune import DEFAULT_TILES, SPLIT_CASES, SPLIT_FILLS, TILE_CASES
from benchmarks.gpu.paged_batches import KV_HEADS

# The reference workload's full decode step (contexts 100-2048): the case the tiles are
# chosen on.
WORKLOAD_CASE = TILE_CASES[-1][0]
MIN_GAIN = 0.02


@dataclass(frozen=True)
class TunedSettings:
    tiles: tuple[int, int, int]
    split_fill: tuple[float, float]
    tiles_speedup: float  # the default tiles' time over these on WORKLOAD_CASE
    split_speedup: float  # the default fill's summed time over the cases over this one's

    def env(self) -> dict[str, str]:
        return {"KSANA_DECODE_TILES": ",".join(str(t) for t in self.tiles),
                "KSANA_DECODE_SPLIT_FILL": ",".join(f"{f:g}" for f in self.split_fill)}


def pick_settings(rows: list[dict[str, Any]]) -> TunedSettings:
    """The fastest settings in decode-tune's `rows`; ValueError when the rows lack the
    default's timings (a sweep that failed)."""
    from ksana_llm.kernels import choose_num_splits

    # The engine's launches take sequences longest first: rows timed in row order (decode-tune
    # times the default so too, for comparison) are not candidates.
    timed = [r for r in rows if "ms" in r and r.get("order") != "none"]
    full = {tuple(r["tiles"]): r["ms"] for r in timed
            if r["case"] == WORKLOAD_CASE and r["num_splits"] == "auto"}
    if DEFAULT_TILES not in full:
        raise ValueError(f"decode_tune: no timing of the default tiles {DEFAULT_TILES} on "
                         f"{WORKLOAD_CASE}")
    fastest = min(full, key=full.__getitem__)
    tiles = fastest if full[fastest] * (1 + MIN_GAIN) < full[DEFAULT_TILES] else DEFAULT_TILES

    cases = {name for name, *_ in TILE_CASES + SPLIT_CASES}
    tail: dict[str, dict[int, float]] = {}
    shape: dict[str, tuple[int, int, int]] = {}
    for r in timed:
        if r["case"] in cases and tuple(r["tiles"]) == tiles and r["num_splits"] != "auto":
            tail.setdefault(r["case"], {})[int(r["num_splits"])] = r["ms"]
            shape[r["case"]] = (r["batch"], r["max_context"], r["num_sms"])

    def total(fill: tuple[float, float]) -> float:
        """The cases' summed time at the split counts `fill` chooses (inf: not timed)."""
        return sum(tail[case].get(choose_num_splits(batch, KV_HEADS, context, sms,
                                                    split_fill=fill), float("inf"))
                   for case, (batch, context, sms) in shape.items())

    default_fill = SPLIT_FILLS[0]
    best_fill = min(SPLIT_FILLS, key=total) if tail else default_fill
    fill = best_fill if tail and total(best_fill) * (1 + MIN_GAIN) < total(default_fill) \
        else default_fill
    return TunedSettings(tuple(tiles), tuple(fill), full[DEFAULT_TILES] / full[tiles],
                         total(default_fill) / total(fill) if tail else 1.0)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    command: list[str] = []
    if "--" in argv:
        cut = argv.index("--")
        argv, command = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--from", dest="source", type=Path, required=True,
                   help="decode_tune.json written by `run.sh decode-tune`")
    p.add_argument("--out", type=Path, default=None, help="where tuned_settings.json goes")
    args = p.parse_args(argv)
    if not args.source.exists():
        sys.exit(f"{args.source} is missing: run the decode-tune stage first")
    settings = pick_settings(json.loads(args.source.read_text())["results"])
    env = settings.env()
    print(f"tuned decode settings: {settings} -> {env}", flush=True)
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "tuned_settings.json").write_text(
            json.dumps({**asdict(settings), "env": env}, indent=2) + "\n")
    if command:
        os.execvpe(command[0], command, {**os.environ, **env})
    return 0


if __name__ == "__main__":
    sys.exit(main())
