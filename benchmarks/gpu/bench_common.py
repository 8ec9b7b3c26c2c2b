"""What every GPU benchmark stage shares: the JSON it writes, the CUDA check, the timer."""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch


def write_json(out_dir: Path, name: str, payload: dict[str, Any]) -> Path:
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(payload, indent=2) + "\n")
    print(f"wrote {path}")
    return path


def write_results(out_dir: Path, name: str, rows: list[dict[str, Any]]) -> Path:
    """A benchmark stage's rows, with the device they ran on."""
    return write_json(out_dir, name, {"device": torch.cuda.get_device_name(0), "results": rows})


def require_cuda() -> None:
    if not torch.cuda.is_available():
        sys.exit("this stage needs a CUDA GPU (torch.cuda.is_available() is False)")


def time_ms(fn: Callable[[], Any]) -> dict[str, float | str | None]:
    """Median milliseconds per call: plain launches, and replayed from a CUDA graph (what the
    engine will do for decode) — or why the capture failed."""
    import triton.testing

    result: dict[str, float | str | None] = {
        "ms": triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")}
    try:
        result["ms_graph"] = triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median")
    except Exception as exc:  # report, do not abort the stage: capture is a separate question
        result["ms_graph"] = None
        result["graph_error"] = f"{type(exc).__name__}: {exc}"[:500]
    return result


def format_us(ms: float | None) -> str:
    """Milliseconds as microseconds for a printed row; "n/a" where there is no figure."""
    return "n/a" if ms is None else f"{ms * 1e3:.1f} us"
