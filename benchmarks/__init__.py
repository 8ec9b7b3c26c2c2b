"""Benchmarks for ksana_llm (run them as scripts, e.g. `python benchmarks/offline_throughput.py`)."""
