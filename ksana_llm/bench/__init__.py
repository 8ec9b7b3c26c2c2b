"""The load client for a running server: `ksana-llm bench`, also run as
`python benchmarks/benchmark_throughput.py`. It takes KsanaLLM's `benchmark_throughput.py`
flags (see `ksana_llm.bench.client`) and reports KsanaLLM's perf columns.

- `flags`: the command line, its settings (`BenchConfig`) and the prompts it names;
- `client`: request bodies, the load loops and `main`;
- `stream`: the streamed answers (OpenAI SSE, KsanaLLM's NUL-delimited chunks);
- `results`: per-request records, statistics, arrival times and the CSV files;
- `workload`: random-token workloads (`--random_workload`, `--random_input_len`).
"""
