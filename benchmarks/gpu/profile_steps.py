"""Where the engine's step time goes on the GPU: torch.profiler over windows of real engine
steps, device time grouped by kernel family (the profile issue 5 asks to explain the figures).

    python -m benchmarks.gpu.profile_steps --out DIR          # on a CUDA machine (run.sh profile)
    python -m benchmarks.gpu.profile_steps --smoke --out DIR  # tiny shapes on the CPU (CI)

The model is bench_engine's random-init Qwen3-0.6B shape in bf16, the engine its settings with
the CUDA defaults (graphs, async scheduling). Windows, each a run of consecutive steps:
- prefill: the first steps after 256 workload prompts arrive (8,192-token chunks);
- decode at 256, 32 and 1 sequences: steps where every sequence decodes, after its prefill.
Per window: wall time per step (the device synchronized at both ends), device time per step
(kernels and copies the profiler saw, graph replays included), the share of the wall the device
was busy, the device time per kernel family and the top kernels. The device being busy most of
the wall says the kernels are the limit; a low share says the host is (launches, the step loop).
Writes profile.json; prints one table per window.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import sys
import time
from collections import defaultdict
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parents[2]
if str(REPO) not in sys.path:  # run as a file as well as with -m
    sys.path.insert(0, str(REPO))

import ksana_llm as kt  # noqa: E402
from benchmarks.gpu.engine_models import SPECS, build_checkpoint, temp_root  # noqa: E402
from benchmarks.workload import allowed_token_ids, build_workload  # noqa: E402

# Kernel families by name (first match wins): ours are Triton kernels named in kernels/; the
# rest are cuBLAS / PyTorch kernel names as they appear in profiles.
FAMILIES = (
    ("attention decode", r"_decode_kernel|_reduce_kernel"),
    ("attention prefill", r"_prefill_kernel"),
    ("kv store", r"_store_kv"),
    ("norm", r"_rms_norm|rms_norm|layer_norm"),
    ("rotary", r"_rotary"),  # with Qwen3's q/k norms and the K/V store fused in
    ("activation", r"_silu_mul"),
    ("matmul", r"gemm|gemv|nvjet|cutlass|xmma|cublas|linear|matmul|splitK|sm90_"),
    ("sampling", r"argmax|topk|sort|softmax|multinomial|log_softmax|exponential|cumsum"),
    ("copies", r"[Mm]emcpy|[Mm]emset"),
    ("elementwise", r"elementwise|vectorized|unrolled|index|gather|scatter|cat|copy|fill|"
                    r"reduce|silu|mul|add"),
)


def family_of(name: str) -> str:
    for family, pattern in FAMILIES:
        if re.search(pattern, name):
            return family
    return "other"


@dataclass
class Window:
    """Steps [first, first + count) of one engine run, profiled."""
    name: str
    first: int
    count: int
    sequences: int
    wall_s: float = 0.0
    trace: Any = None  # the stopped profiler


@dataclass
class WindowReport:
    name: str
    sequences: int
    steps: int
    wall_ms_per_step: float
    device_ms_per_step: float | None  # None on the CPU (no device events)
    device_busy_share: float | None
    device_events: int  # kernels and copies seen (0 on the CPU)
    # device_events / steps: launches per step, what a small batch's step time follows (graph
    # replays count each kernel they run)
    device_events_per_step: float
    families_ms_per_step: dict[str, float] = field(default_factory=dict)
    top_kernels: list[dict[str, Any]] = field(default_factory=list)


def on_device(event: Any) -> bool:
    return str(getattr(event, "device_type", "")).endswith("CUDA")


def report(window: Window, device: torch.device, top: int = 12) -> WindowReport:
    """Sum the window's events: device kernels and copies on a GPU; on the CPU (smoke runs) the
    host ops' own time stands in, so the script is checked end to end."""
    per_name: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    device_events = 0
    for event in window.trace.events():
        if device.type == "cuda":
            if not on_device(event):
                continue
            device_events += 1
            us = event.time_range.elapsed_us()  # a kernel's or copy's own span
        else:
            us = event.self_cpu_time_total
        per_name[event.name] += us / 1e3
        calls[event.name] += 1
    steps = window.count
    families: dict[str, float] = defaultdict(float)
    for name, ms in per_name.items():
        families[family_of(name)] += ms / steps
    busy = sum(per_name.values()) / steps if device.type == "cuda" else None
    wall = window.wall_s * 1e3 / steps
    ranked = sorted(per_name.items(), key=lambda kv: -kv[1])[:top]
    return WindowReport(
        window.name, window.sequences, steps, round(wall, 3),
        None if busy is None else round(busy, 3),
        None if busy is None else round(min(1.0, busy / wall), 3), device_events,
        round(device_events / steps, 1),
        {k: round(v, 3) for k, v in sorted(families.items(), key=lambda kv: -kv[1])},
        [{"kernel": name[:120], "family": family_of(name), "ms_per_step": round(ms / steps, 4),
          "calls_per_step": round(calls[name] / steps, 2)} for name, ms in ranked])


class StepProfiler:
    """Wraps the engine core's `step` (a benchmark-only peek, as engine_steps.count_steps) and
    runs torch.profiler over the windows' steps, on the engine thread that runs them."""

    def __init__(self, engine: kt.Engine, device: torch.device) -> None:
        self.device = device
        self.windows: list[Window] = []
        self.step_index = 0
        self._active: Window | None = None
        self._start = 0.0
        core = engine._core
        original = core.step

        def profiled_step(*args: Any, **kwargs: Any) -> Any:
            self._before(self.step_index)
            result = original(*args, **kwargs)
            self.step_index += 1
            self._after(self.step_index)
            return result

        core.step = profiled_step

    def expect(self, window: Window) -> None:
        """Profile `window` (its step numbers count from the next `restart()`)."""
        self.windows.append(window)

    def restart(self) -> None:
        self.step_index = 0

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def _before(self, index: int) -> None:
        window = next((w for w in self.windows if w.first == index and w.trace is None), None)
        if window is None or self._active is not None:
            return
        activities = [torch.profiler.ProfilerActivity.CPU]
        if self.device.type == "cuda":
            activities.append(torch.profiler.ProfilerActivity.CUDA)
        window.trace = torch.profiler.profile(activities=activities)
        self._sync()
        window.trace.__enter__()
        self._active, self._start = window, time.perf_counter()

    def _after(self, index: int) -> None:
        window = self._active
        if window is None or index < window.first + window.count:
            return
        self._sync()
        window.wall_s = time.perf_counter() - self._start
        window.trace.__exit__(None, None, None)
        self._active = None


def decode_window(name: str, prompts: list[list[int]], budget: int, steps: int) -> Window:
    """The decode steps of `prompts` once all are prefilled (the budget's chunks, plus a margin
    for the step that samples each prompt's first token)."""
    prefill_steps = math.ceil(sum(len(p) for p in prompts) / budget)
    return Window(name, prefill_steps + 3, steps, len(prompts))


def run_windows(engine: kt.Engine, profiler: StepProfiler, prompts: list[list[int]],
                windows: list[Window]) -> None:
    """Serve `prompts` with room for every window's steps, profiling those windows."""
    new_tokens = max(w.first + w.count for w in windows) + 4
    profiler.restart()
    for window in windows:
        profiler.expect(window)
    configs = [kt.GenerationConfig(max_new_tokens=new_tokens, ignore_eos=True) for _ in prompts]
    engine.generate_outputs(prompts, configs, use_tqdm=False)
    missed = [w.name for w in windows if w.trace is None or w.wall_s == 0.0]
    if missed:
        raise RuntimeError(f"windows never reached: {missed} ({profiler.step_index} steps)")


def print_table(rep: WindowReport) -> None:
    device = "-" if rep.device_ms_per_step is None else f"{rep.device_ms_per_step:.3f}"
    busy = "-" if rep.device_busy_share is None else f"{rep.device_busy_share:.0%}"
    print(f"\n{rep.name}: {rep.sequences} sequences, {rep.steps} steps, wall "
          f"{rep.wall_ms_per_step:.3f} ms/step, device {device} ms/step, busy {busy} "
          f"({rep.device_events} device events, {rep.device_events_per_step:g} a step)")
    print("| family | ms/step | share |\n|---|---:|---:|")
    total = sum(rep.families_ms_per_step.values()) or 1.0
    for family, ms in rep.families_ms_per_step.items():
        print(f"| {family} | {ms:.3f} | {ms / total:.0%} |")
    for row in rep.top_kernels[:6]:
        print(f"  {row['ms_per_step']:.4f} ms x{row['calls_per_step']:g}  {row['kernel'][:90]}")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path,
                   default=Path(os.environ.get("OUT") or REPO / "benchmarks/gpu/results"))
    p.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    p.add_argument("--steps", type=int, default=20, help="steps per window")
    args = p.parse_args(argv)
    if args.smoke:
        device, dtype, budget, seqs, steps = torch.device("cpu"), torch.float32, 64, 16, 3
        lengths = (8, 24)
    else:
        if not torch.cuda.is_available():
            sys.exit("needs a CUDA GPU (or --smoke for a CPU check of the script)")
        device, dtype, budget, seqs, steps = (torch.device("cuda"), torch.bfloat16, 8192, 256,
                                              args.steps)
        lengths = (100, 1024)
    spec = SPECS["qwen3-0.6b"]
    root = temp_root(4 * 2**30)
    hf_model, folder = build_checkpoint(spec, device, dtype, args.smoke, root)
    vocab = hf_model.config.vocab_size
    del hf_model
    model = kt.Model.from_pretrained(folder, device=str(device),
                                     dtype=str(dtype).removeprefix("torch."), progress=False)
    workload = build_workload(seqs, *lengths, 0, allowed_token_ids(None, vocab))
    engine = kt.Engine(model, max_batch_size=budget, max_num_seqs=seqs,
                       max_model_len=128 if args.smoke else 2048, preempt_mode=1,
                       **({"num_device_blocks": 256} if args.smoke else {}))
    reports: list[WindowReport] = []
    try:
        profiler = StepProfiler(engine, device)
        engine.generate_outputs([workload.prompts[0][:8]],  # compile and capture outside
                                [kt.GenerationConfig(max_new_tokens=4, ignore_eos=True)],
                                use_tqdm=False)
        full = workload.prompts
        windows = [Window("prefill", 1, min(steps, 5), len(full)),
                   decode_window(f"decode {len(full)}", full, budget, steps)]
        run_windows(engine, profiler, full, windows)
        few = full[:max(1, seqs // 8)]
        windows += [decode_window(f"decode {len(few)}", few, budget, steps)]
        run_windows(engine, profiler, few, windows[-1:])
        windows += [decode_window("decode 1", full[:1], budget, steps)]
        run_windows(engine, profiler, full[:1], windows[-1:])
        for window in windows:
            reports.append(report(window, device))
            print_table(reports[-1])
    finally:
        engine.shutdown()
        shutil.rmtree(root, ignore_errors=True)
    args.out.mkdir(parents=True, exist_ok=True)
    path = args.out / "profile.json"
    path.write_text(json.dumps({"model": spec.name, "device": torch.cuda.get_device_name(device)
                                if device.type == "cuda" else "cpu",
                                "windows": [asdict(r) for r in reports]}, indent=2) + "\n")
    print(f"wrote {path}")
    blind = [r.name for r in reports if device.type == "cuda" and r.device_events == 0]
    if blind:  # CUPTI saw no kernels (graph replays, a profiler started late): no profile
        print(f"the profiler saw no device events in {blind}: their device times are not "
              "measurements", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
