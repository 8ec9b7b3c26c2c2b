"""The GPU benchmark scripts (benchmarks/gpu/bench_engine.py's stages, parity.py) in `--smoke`
mode on CPU: tiny shapes, the same code paths and JSON reports as on the H200, so a GPU session
spends its minutes measuring, not debugging."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import json  # noqa: E402

import pytest  # noqa: E402

import ksana_llm as kt  # noqa: E402


def test_gpu_benchmark_smoke_mode_runs_on_cpu(tmp_path):
    """`benchmarks/gpu/bench_engine.py --smoke`: the whole GPU benchmark with tiny shapes on the
    CPU, both models, ours against HF generate_batch, graphs on and off."""
    from benchmarks.gpu import bench_engine

    assert bench_engine.main(["--smoke", "--out", str(tmp_path)]) == 0
    for name in ("qwen3-0.6b", "llama-3-8b"):
        report = json.loads((tmp_path / f"engine_{name}.json").read_text())
        ours = report["throughput"]["ksana_llm"]
        assert ours["exact_lengths"] and ours["output_tokens"] == report["workload"]["output_tokens"]
        assert report["throughput"]["hf_generate_batch"]["output_tokens_per_s"] > 0
        assert report["ratio_vs_hf_generate_batch"] > 0
        assert report["cuda_graphs"]["on"]["status"].startswith("off: device is cpu")
        assert report["batch1"]["graphs_on"]["ms_per_token"] > 0
        assert report["batch1"]["graphs_off"]["ms_per_token"] > 0
        gc_on = report["gc_during_workload"]["on"]  # the collector's passes in our timed run
        assert gc_on["passes"] >= gc_on["full_passes"] >= 0 and gc_on["total_ms"] >= 0


def test_gpu_benchmark_fp8_stage_smoke(tmp_path):
    """run.sh's engine-qwen3-fp8 stage: the same workload with an E4M3 KV cache, its own file."""
    from benchmarks.gpu import bench_engine

    assert bench_engine.main(["--smoke", "--models", "qwen3-0.6b", "--kv-cache-dtype",
                              "fp8_e4m3", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_qwen3-0.6b-kv-fp8_e4m3.json").read_text())
    assert report["kv_cache_dtype"] == "fp8_e4m3"
    assert report["throughput"]["ksana_llm"]["exact_lengths"]


def test_gpu_benchmark_lora_stage_smoke(tmp_path):
    """run.sh's engine-qwen3-lora stage: the workload through random adapters, its own file."""
    from benchmarks.gpu import bench_engine

    assert bench_engine.main(["--smoke", "--models", "qwen3-0.6b", "--lora-adapters", "2",
                              "--lora-rank", "4", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_qwen3-0.6b-lora2.json").read_text())
    assert report["lora"] == {"adapters": 2, "rank": 4}
    assert report["throughput"]["ksana_llm"]["exact_lengths"]
    assert report["batch1"]["graphs_on"]["ms_per_token"] > 0
    assert not report["errors"]


@pytest.mark.parametrize("name,experts_key", [("qwen3-30b-a3b-12l", "num_experts"),
                                               ("deepseek-v2-lite-8l", "n_routed_experts")])
def test_gpu_benchmark_moe_stages_smoke(tmp_path, name, experts_key):
    """run.sh's engine-qwen3moe and engine-deepseek stages: the workload on a Qwen3-MoE and on
    a DeepSeek-V2 (MLA; tiny on CPU), each its own file."""
    from benchmarks.gpu import bench_engine

    assert bench_engine.main(["--smoke", "--models", name, "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / f"engine_{name}.json").read_text())
    assert report["shape"][experts_key] == 8
    assert report["throughput"]["ksana_llm"]["exact_lengths"]
    assert report["ratio_vs_hf_generate_batch"] > 0 and not report["errors"]


def test_gpu_benchmark_int4_stage_smoke(tmp_path):
    """run.sh's engine-qwen3-int4w stage: ours on the checkpoint rewritten as W4A16 (the writer
    itself is checked against compressed-tensors in tests/test_int4_checkpoint_writer.py)."""
    from benchmarks.gpu import bench_engine

    assert bench_engine.main(["--smoke", "--models", "qwen3-0.6b", "--int4-weights",
                              "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "engine_qwen3-0.6b-wint4.json").read_text())
    assert report["quantization"].startswith("int4 checkpoint (W4A16")
    assert report["throughput"]["ksana_llm"]["exact_lengths"]
    assert report["batch1"]["graphs_on"]["ms_per_token"] > 0
    assert not report["errors"]


def test_gpu_parity_smoke_mode_runs_on_cpu(tmp_path):
    """`benchmarks/gpu/parity.py --smoke`: CPU serial engine against the device-default engine
    (here the Triton interpreter with async scheduling and overlapped outputs), three rounds."""
    from benchmarks.gpu import parity

    assert parity.main(["--smoke", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "parity.json").read_text())
    assert report["ok"] and report["tokens_compared"] == report["tokens"] == 3 * 8 * 8
    assert report["device"]["attention_backend"] == "triton"
    assert report["device"]["async_scheduling"] and report["device"]["steps_ahead"] > 0
    assert report["device"]["prefix_cache_hits"] > 0  # the second round reused the first's KV


def test_gpu_parity_gpt_oss_smoke_runs_on_cpu(tmp_path):
    """`parity.py --model gpt-oss --smoke`: a tiny GPT-OSS saved as the released checkpoints are
    (MXFP4 expert blocks), its experts kept packed, CPU serial vs the Triton interpreter."""
    from benchmarks.gpu import parity

    folder = parity.build_gpt_oss_checkpoint(parity.GPT_OSS_TINY, tmp_path / "model")
    loaded = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    assert loaded.module.model.layers[0].mlp.experts.fp4 == {"w13": True, "w2": True}
    assert parity.main(["--smoke", "--model", "gpt-oss", "--out", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "parity_gpt_oss.json").read_text())
    assert report["ok"] and report["tokens_compared"] == report["tokens"] == 3 * 8 * 8
    assert "MXFP4" in report["model"] and report["device"]["attention_backend"] == "triton"


def test_gpu_parity_allows_a_difference_only_at_a_near_tie():
    from types import SimpleNamespace

    from benchmarks.gpu.parity import compare

    def output(ids: list[int], tops: list[dict[int, float]]) -> SimpleNamespace:
        return SimpleNamespace(token_ids=ids, logprobs=[
            {"token_id": t, "logprob": top.get(t, -9.0), "top_logprobs": top}
            for t, top in zip(ids, tops)])

    tied = [{5: -0.1, 6: -2.0}, {7: -0.6931, 8: -0.6935}, {9: -0.2, 1: -1.9}]
    cpu = output([5, 7, 9], tied)
    assert compare(cpu, output([5, 7, 9], tied), tie=1e-3)["ok"]
    at_tie = compare(cpu, output([5, 8, 3], tied), tie=1e-3)
    assert at_tie["ok"] and at_tie["compared"] == 1 and at_tie["first_difference"] == 1
    assert not compare(cpu, output([5, 8, 3], tied), tie=1e-4)["ok"]  # not a tie at 1e-4
    assert not compare(cpu, output([6, 7, 9], tied), tie=1e-3)["ok"]  # no tie at token 0
    assert not compare(cpu, output([5, 7], tied), tie=1e-3)["ok"]  # a token missing


def test_gpu_profile_stage_smoke(tmp_path):
    """`benchmarks/gpu/profile_steps.py --smoke`: every window reached and profiled on the CPU
    (host ops stand in for kernels there), and kernel names land in the right families."""
    from benchmarks.gpu import profile_steps

    assert profile_steps.main(["--smoke", "--out", str(tmp_path)]) == 0
    windows = json.loads((tmp_path / "profile.json").read_text())["windows"]
    assert [w["name"] for w in windows] == ["prefill", "decode 16", "decode 2", "decode 1"]
    for w in windows:
        assert w["steps"] == 3 and w["wall_ms_per_step"] > 0 and w["top_kernels"]
        assert sum(w["families_ms_per_step"].values()) > 0
    family = profile_steps.family_of
    assert family("_decode_kernel") == family("_reduce_kernel") == "attention decode"
    assert family("_prefill_kernel") == "attention prefill"
    assert family("nvjet_tst_128x64_64x4_1x2_h_bz_coopA_NTN") == "matmul"
    assert family("sm90_xmma_gemm_bf16bf16_bf16f32") == "matmul"
    assert family("_rms_norm_kernel") == "norm" and family("Memcpy DtoH (Device -> Pinned)") \
        == "copies"
    assert family("void at::native::vectorized_elementwise_kernel<4>") == "elementwise"
    assert family("_silu_mul_kernel") == "activation" and family("_rotary_kernel") == "rotary"
    assert all(w["device_events_per_step"] == 0 for w in windows)  # none on the CPU


def test_hf_generate_batch_cap_cancels_what_is_unfinished(monkeypatch, tmp_path):
    """HF generate_batch stopped at its cap cancels every unfinished request before leaving
    the manager, which would otherwise finish them all first (164 s past a 60 s cap on the
    H200): the cap bounds the peer's time, as the JSON says it does."""
    from transformers.generation.continuous_batching.continuous_api import (
        ContinuousBatchingManager)

    from benchmarks.gpu.engine_models import SPECS, build_checkpoint
    from benchmarks.gpu.hf_peer import run_hf_capped
    from benchmarks.workload import allowed_token_ids, build_workload

    cancelled = []
    original = ContinuousBatchingManager.cancel_request

    def recording_cancel(self, request_id):
        cancelled.append(request_id)
        return original(self, request_id)

    monkeypatch.setattr(ContinuousBatchingManager, "cancel_request", recording_cancel)
    model, _ = build_checkpoint(SPECS["qwen3-0.6b"], torch.device("cpu"), torch.float32, True,
                                tmp_path)
    workload = build_workload(8, 400, 480, 0, allowed_token_ids(None, 512))
    out = run_hf_capped(model, workload, 16, 256, cap_s=0.5)
    assert not out["complete"] and out["requests_finished"] < 8
    assert len(cancelled) == 8 - out["requests_finished"] and len(set(cancelled)) == len(cancelled)
    assert out["output_tokens_counted"] > 0 and "extrapolated" in out


def test_host_overhead_stage_runs_without_a_tokenizer(tmp_path):
    """run.sh's host-overhead stage: benchmarks/step_overhead.py on a model folder without a
    tokenizer (the GPU machine has no default model), its phases in the JSON."""
    import subprocess
    import sys

    out = tmp_path / "step_overhead.json"
    proc = subprocess.run([sys.executable, "-m", "benchmarks.step_overhead", "--num-seqs", "16",
                           "--steps", "8", "--overlap", "on", "--async-scheduling", "on",
                           "--no-tokenizer", "--json-out", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    report = json.loads(out.read_text())
    assert report["tokenizer"] is False and report["decode_steps"] > 0
    assert report["ms_per_step"]["host"] > 0 and "no tokenizer" in proc.stdout
    # The collector's passes during the run, reported apart from the phase medians.
    assert report["freeze_gc_heap"] == "on" and "garbage collector:" in proc.stdout
    assert report["gc"]["passes"] >= report["gc"]["full_passes"] >= 0
    assert report["gc"]["total_ms"] >= report["gc"]["longest_ms"] >= 0
