"""Every benchmark script starts the way the README and benchmarks/gpu/run.sh run it: the
top-level ones as files (`python benchmarks/X.py`, from any folder: they put the repository on
the path themselves to import their siblings), the GPU ones as modules from the repository root.
`--help` goes through each one's imports and argument parser without running a workload
(benchmarks/step_overhead.py once failed at its first import this way).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SCRIPTS = sorted(path for path in (REPO / "benchmarks").glob("*.py")
                 if 'if __name__ == "__main__"' in path.read_text())
GPU_MODULES = ["bench_engine", "bench_kernels", "parity", "profile_steps", "tuned_settings"]


def test_the_scripts_are_found():
    assert {"offline_throughput.py", "step_overhead.py", "benchmark_throughput.py"} <= \
        {path.name for path in SCRIPTS}


@pytest.mark.timeout(300)
def test_every_benchmark_script_starts(tmp_path):
    env = {key: value for key, value in os.environ.items() if key != "PYTHONPATH"}
    commands = [([sys.executable, str(path), "--help"], tmp_path) for path in SCRIPTS]
    commands += [([sys.executable, "-m", f"benchmarks.gpu.{name}", "--help"], REPO)
                 for name in GPU_MODULES]
    # All at once: each spends its seconds importing torch and the engine.
    running = [(command, subprocess.Popen(command, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                          stderr=subprocess.STDOUT, text=True))
               for command, cwd in commands]
    failures = []
    for command, proc in running:
        output, _ = proc.communicate(timeout=240)
        if proc.returncode != 0 or "usage:" not in output:
            failures.append(f"{' '.join(command[1:])}: exit {proc.returncode}\n{output[-1500:]}")
    assert not failures, "\n\n".join(failures)
