#!/usr/bin/env bash
# GPU checks and benchmarks in one go, from the repository root on a CUDA machine:
#     bash benchmarks/gpu/run.sh            # all stages (more than one 600 s device call on
#                                           # an H200: split them; engine-qwen3 took 288 s on
#                                           # 2026-12-04, 164 s of it HF past its cap, now cut)
#     bash benchmarks/gpu/run.sh decode     # only the named stages
# Stages: env, tests (kernel tests natively), graph-tests (tests/test_cuda_graphs.py with real
# capture), parity (the engine's greedy tokens on CUDA vs on the CPU, fp32, benchmarks/gpu/
# parity.py), profile (device time per kernel family in prefill and decode steps,
# benchmarks/gpu/profile_steps.py), engine-qwen3 / engine-llama8b (the reference workload: our
# engine vs HF generate_batch, batch-1 decode, CUDA graphs on/off), decode, prefill (kernel benchmarks);
# decode-tune (decode attention's tiles and split counts swept on the workload's shapes) and
# engine-qwen3-tuned (after it: ours on the Qwen3 workload under its fastest settings) and
# host-overhead (the step loop's host time per decode step on this machine's CPU); spec
# (speculative decoding, benchmarks/speculative_decoding.py on CUDA) and engine-qwen3-fp8 (the
# Qwen3 workload with an FP8 E4M3 KV cache) and engine-qwen3-lora (the Qwen3 workload through 4
# random rank-16 LoRA adapters, round robin) and engine-qwen3-fp8w / engine-llama8b-fp8w (the
# workloads with FP8 projection weights, online quantization) and engine-qwen3-int4w /
# engine-llama8b-int4w (the workloads on the checkpoint rewritten as W4A16: 4-bit weights held
# packed) and fp8-matmul (the quantized-weight
# matmul, FP8, int8 codes and packed 4-bit codes, against bf16 cuBLAS) and moe (MoE layers'
# experts, grouped Triton launches vs one cuBLAS pair per expert) and engine-qwen3moe (the
# workload on 12 of Qwen3-30B-A3B's layers: MoE decode in CUDA graphs) and engine-deepseek (on
# DeepSeek-V2-Lite's dimensions, 8 layers: MLA and MoE) only when named.
# Each stage writes its own JSON into $OUT when set (the device runner), else
# benchmarks/gpu/results/; the engine summary table is printed last. A failing stage is
# reported and the next one still runs; the script exits non-zero if any stage failed.
#
# Python packages the GPU image lacks (pydantic and its dependencies) travel as wheels in .whl/:
# run `bash benchmarks/gpu/fetch_wheels.sh` on the development machine first, and carry `.whl`.
# Check the whole script on a CPU with: python -m benchmarks.gpu.bench_engine --smoke
set -euo pipefail
cd "$(dirname "$0")/../.."

PYTHON="${PYTHON:-$(command -v python3 || command -v python)}"
RESULTS="${OUT:-benchmarks/gpu/results}"
mkdir -p "$RESULTS"
unset TRITON_INTERPRET  # compiled kernels on the GPU, never the interpreter
export PYTHONUNBUFFERED=1
exec > >(tee -a "$RESULTS/run.log") 2>&1  # the whole log comes back with the JSON files

if ! "$PYTHON" -c "import pydantic" 2>/dev/null; then
    if compgen -G ".whl/*.whl" >/dev/null; then
        "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
            --target /tmp/ksana-site .whl/*.whl
        export PYTHONPATH="/tmp/ksana-site${PYTHONPATH:+:$PYTHONPATH}"
    else
        echo "pydantic is missing and there is no .whl/: run benchmarks/gpu/fetch_wheels.sh" \
             "on the development machine and carry .whl" >&2
    fi
fi

STAGES=("$@")
if [ ${#STAGES[@]} -eq 0 ]; then
    STAGES=(env tests graph-tests parity engine-qwen3 profile engine-llama8b decode prefill)
fi

# Seconds a stage may run before it is stopped (a hung stage must not eat the device lease).
declare -A LIMIT=([env]=60 [tests]=240 [graph-tests]=150 [parity]=240 [parity-gptoss]=180
                  [engine-qwen3]=300
                  [profile]=180 [decode-tune]=240 [engine-qwen3-tuned]=240 [host-overhead]=120
                  [engine-llama8b]=330 [decode]=120 [prefill]=120 [spec]=240
                  [engine-qwen3-fp8]=300 [engine-qwen3-lora]=300 [engine-qwen3-fp8w]=300
                  [engine-llama8b-fp8w]=330 [engine-qwen3-int4w]=300 [engine-llama8b-int4w]=360
                  [fp8-matmul]=270 [moe]=240 [engine-qwen3moe]=420
                  [engine-deepseek]=420)

failed=()
run_stage() {  # run_stage NAME CMD...: one section of output per stage, failures collected
    local name="$1"; shift
    echo
    echo "=== stage: $name ($(date -u +%H:%M:%S), limit ${LIMIT[$name]} s) ==="
    local start=$SECONDS
    if timeout --kill-after=15 "${LIMIT[$name]}" "$@"; then
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
        # tests/test_kernels*.py natively on the GPU (fp32, fp16, bf16)
        tests)   run_stage tests   "$PYTHON" -m benchmarks.gpu.bench_kernels tests --out "$RESULTS" ;;
        # decode graphs captured and replayed for real, logits and KV cache vs the eager path;
        # sleep mode on the GPU (weights offloaded to host memory, graphs captured again)
        graph-tests) run_stage graph-tests "$PYTHON" -m pytest tests/test_cuda_graphs.py \
                         tests/test_sleep_mode.py -q -p no:cacheprovider -k "not smoke" ;;
        # greedy tokens with the CUDA defaults (graphs, async scheduling) vs the CPU, fp32
        parity)  run_stage parity  "$PYTHON" -m benchmarks.gpu.parity --out "$RESULTS" ;;
        # the same on a small GPT-OSS with MXFP4 experts: sinks, float32-weight norms, packed FP4
        parity-gptoss) run_stage parity-gptoss "$PYTHON" -m benchmarks.gpu.parity --model gpt-oss \
                           --out "$RESULTS" ;;
        # reference workload, Qwen3-0.6B shape: ours (graphs on, off) vs HF generate_batch
        engine-qwen3)   run_stage engine-qwen3 "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models qwen3-0.6b --out "$RESULTS" ;;
        # ours alone on the same workload under the decode settings the decode-tune stage
        # (run before it, same $OUT) found fastest: KSANA_DECODE_TILES / _SPLIT_FILL
        engine-qwen3-tuned) run_stage engine-qwen3-tuned "$PYTHON" -m benchmarks.gpu.tuned_settings \
                            --from "$RESULTS/decode_tune.json" --out "$RESULTS" -- \
                            "$PYTHON" -m benchmarks.gpu.bench_engine --models qwen3-0.6b \
                            --ours-only --tag tuned --out "$RESULTS" ;;
        # the same with an FP8 (E4M3) KV cache: twice the tokens in the same memory
        engine-qwen3-fp8) run_stage engine-qwen3-fp8 "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models qwen3-0.6b --kv-cache-dtype fp8_e4m3 --out "$RESULTS" ;;
        # the same with FP8 weights (W8A16: the Triton FP8 matmul for decode batches)
        engine-qwen3-fp8w) run_stage engine-qwen3-fp8w "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models qwen3-0.6b --quantization fp8 --out "$RESULTS" ;;
        engine-llama8b-fp8w) run_stage engine-llama8b-fp8w "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models llama-3-8b --quantization fp8 --out "$RESULTS" ;;
        # the same on 4-bit weights (W4A16 checkpoint, held packed: the Triton W4A16 matmul)
        engine-qwen3-int4w) run_stage engine-qwen3-int4w "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models qwen3-0.6b --int4-weights --out "$RESULTS" ;;
        engine-llama8b-int4w) run_stage engine-llama8b-int4w "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models llama-3-8b --int4-weights --out "$RESULTS" ;;
        # the same through 4 LoRA adapters (HF generate_batch runs the base model)
        engine-qwen3-lora) run_stage engine-qwen3-lora "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models qwen3-0.6b --lora-adapters 4 --out "$RESULTS" ;;
        # an MoE model: Qwen3-30B-A3B's layers (12 of 48), grouped Triton experts, graphs on/off
        engine-qwen3moe) run_stage engine-qwen3moe "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models qwen3-30b-a3b-12l --out "$RESULTS" ;;
        # MLA + MoE: DeepSeek-V2-Lite (8 of its 27 layers)
        engine-deepseek) run_stage engine-deepseek "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models deepseek-v2-lite-8l --out "$RESULTS" ;;
        # the same at the Llama-3-8B shape
        engine-llama8b) run_stage engine-llama8b "$PYTHON" -m benchmarks.gpu.bench_engine \
                            --models llama-3-8b --out "$RESULTS" ;;
        # where step time goes: torch.profiler over prefill and decode windows (256, 32, 1
        # sequences) of the Qwen3-0.6B engine, device time by kernel family
        profile) run_stage profile "$PYTHON" -m benchmarks.gpu.profile_steps --out "$RESULTS" ;;
        # decode attention's launch settings (tile width, warps, stages; splits) swept at the
        # workload's shapes: the data for tuning _decode_config
        decode-tune) run_stage decode-tune "$PYTHON" -m benchmarks.gpu.bench_kernels decode-tune \
                         --out "$RESULTS" ;;
        # this machine's host side of a decode step (the step loop's Python, 256 sequences, no
        # tokenizer as in the workload): whether the GPU's steps outlast it (benchmarks/
        # step_overhead.py; a tiny model on the CPU, so no device time is spent)
        host-overhead) run_stage host-overhead "$PYTHON" -m benchmarks.step_overhead --overlap on \
                           --async-scheduling on --no-tokenizer --steps 200 \
                           --json-out "$RESULTS/step_overhead.json" ;;
        # paged decode attention at the Qwen3-0.6B shape: batch 256 x ~600 tokens, and 4 x 8k
        decode)  run_stage decode  "$PYTHON" -m benchmarks.gpu.bench_kernels decode --out "$RESULTS" ;;
        # the FP8-weight matmul (Llama-3-8B / Qwen3 shapes, 1-256 rows) vs bf16 cuBLAS
        fp8-matmul) run_stage fp8-matmul "$PYTHON" -m benchmarks.gpu.bench_kernels fp8-matmul \
                        --out "$RESULTS" ;;
        # MoE experts (Qwen3-30B-A3B / Mixtral layers, 1-2048 tokens): grouped vs per-expert
        moe)     run_stage moe     "$PYTHON" -m benchmarks.gpu.bench_kernels moe --out "$RESULTS" ;;
        # paged prefill attention: fresh prompts and chunks after a cached prefix
        prefill) run_stage prefill "$PYTHON" -m benchmarks.gpu.bench_kernels prefill --out "$RESULTS" ;;
        # speculative decoding (DeepSeek MTP, fitted head) on the GPU: k = 0..3 vs HF generate
        spec)    run_stage spec "$PYTHON" benchmarks/speculative_decoding.py --device cuda \
                     --json-out "$RESULTS/spec.json" ;;
        *) echo "unknown stage '$stage' (stages: env tests graph-tests parity parity-gptoss profile decode-tune engine-qwen3 engine-qwen3-tuned host-overhead" \
                "engine-qwen3-fp8 engine-qwen3-lora engine-qwen3-fp8w engine-qwen3-int4w engine-qwen3moe"\
                " engine-deepseek engine-llama8b"\
                " engine-llama8b-fp8w engine-llama8b-int4w"\
                " decode prefill fp8-matmul moe spec)" >&2; exit 2 ;;
    esac
done

echo
echo "results in $RESULTS"
"$PYTHON" -m benchmarks.gpu.bench_engine --summarize "$RESULTS" || true
if [ ${#failed[@]} -gt 0 ]; then
    echo "failed stages: ${failed[*]}" >&2
    exit 1
fi
