"""Load client for a running ksana-llm server, with KsanaLLM's `benchmark_throughput.py` flags.

    python benchmarks/benchmark_throughput.py --port 8080 --input_csv ksana_llm/bench/sample_prompts.csv \\
        --backend ksana --stream --request_rate 4 --prompt_num 64 --max_new_tokens 128 \\
        --percentiles 50 90 99 --perf_csv perf.csv --output_csv out.csv

The client lives in the package (`ksana_llm.bench.client`, also `ksana-llm bench ...`, which takes
the same flags); this file runs it from a source checkout. See `ksana_llm/bench/client.py` for
the flags and what they do.
"""

from __future__ import annotations

import sys
from pathlib import Path

if str(Path(__file__).resolve().parent.parent) not in sys.path:  # run as a file, not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ksana_llm.bench.client import BenchConfig, main  # noqa: E402,F401

if __name__ == "__main__":
    sys.exit(main())
