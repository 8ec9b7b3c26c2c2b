#!/usr/bin/env bash
# GPU checks and benchmarks in one go, from the repository root on a CUDA machine:
#     bash benchmarks/gpu/run.sh            # all stages
#     bash benchmarks/gpu/run.sh decode     # only the named stages
# Each stage writes its own JSON into $OUT when set (the device runner), else
# benchmarks/gpu/results/. A failing stage is reported and the next one still runs; the script
# exits non-zero if any stage failed. Needs a CUDA build of torch, triton, and `pip install -e .`.
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-python}"
RESULTS="${OUT:-benchmarks/gpu/results}"
mkdir -p "$RESULTS"
unset TRITON_INTERPRET  # compiled kernels on the GPU, never the interpreter

STAGES=("$@")
if [ ${#STAGES[@]} -eq 0 ]; then
    STAGES=(env tests decode prefill)
fi

failed=()
run_stage() {  # run_stage NAME CMD...: one section of output per stage, failures collected
    local name="$1"; shift
    echo
    echo "=== stage: $name ($(date -u +%H:%M:%S)) ==="
    local start=$SECONDS
    if "$@"; then
        echo "=== $name: ok in $((SECONDS - start)) s ==="
    else
        echo "=== $name: FAILED (exit $?) after $((SECONDS - start)) s ==="
        failed+=("$name")
    fi
}

for stage in "${STAGES[@]}"; do
    case "$stage" in
        # device, driver and library versions
        env)     run_stage env     "$PYTHON" -m benchmarks.gpu.bench_kernels env --out "$RESULTS" ;;
        # tests/test_kernels.py natively on the GPU (fp32, fp16, bf16)
        tests)   run_stage tests   "$PYTHON" -m benchmarks.gpu.bench_kernels tests --out "$RESULTS" ;;
        # paged decode attention at the Qwen3-0.6B shape: batch 256 x ~600 tokens, and 4 x 8k
        decode)  run_stage decode  "$PYTHON" -m benchmarks.gpu.bench_kernels decode --out "$RESULTS" ;;
        # paged prefill attention: fresh prompts and chunks after a cached prefix
        prefill) run_stage prefill "$PYTHON" -m benchmarks.gpu.bench_kernels prefill --out "$RESULTS" ;;
        *) echo "unknown stage '$stage' (stages: env tests decode prefill)" >&2; exit 2 ;;
    esac
done

echo
echo "results in $RESULTS"
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed stages: ${failed[*]}" >&2
    exit 1
fi
