"""The Triton attention backend wired into the runner and the engine, checked against transformers
on CPU in Triton's interpreter (TRITON_INTERPRET=1): the same kernels a GPU runs natively, driven
by the same batch metadata."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ksana_llm as kt  # noqa: E402
from ksana_llm.api.model import Model  # noqa: E402
from ksana_llm.generation_config import GenerationConfig  # noqa: E402
from ksana_llm.runner.model_runner import resolve_attention_backend  # noqa: E402
from tests.family_harness import (TritonDriver, check_prefill_and_decode,  # noqa: E402
                                  check_prefix_hit_mixed_batch, greedy_trace, hf_reference)
from tests.tiny_models import build_tiny_model  # noqa: E402


@pytest.fixture(scope="module", params=["yi-gqa4-bias", "mistral-sliding"])
def tiny(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    hf = build_tiny_model(request.param, folder)
    ours = Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False).module
    return hf, ours


def test_triton_backend_logits_match_transformers(tiny):
    hf, ours = tiny
    check_prefill_and_decode(ours, hf_reference(hf), vocab=256, chunks=[16, 16, 8],
                             driver_class=TritonDriver)
    check_prefix_hit_mixed_batch(ours, hf_reference(hf), vocab=256, driver_class=TritonDriver)


def test_qwen3_q_k_norms_run_inside_the_rotary_kernel(tmp_path, monkeypatch):
    """Qwen3 on the Triton backend: its per-head q/k norms are fused into the RoPE launch (no
    separate norm over 3-D heads), which also stores K/V into the cache (no store_kv launch),
    and prefill, decode and a prefix hit still match transformers (the tiny model's norm
    weights are random, so a dropped weight shows; the decode reads what the fused store
    wrote)."""
    from ksana_llm import kernels

    hf = build_tiny_model("qwen3", tmp_path)
    ours = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    fused: list[bool] = []
    head_norms: list[tuple[int, ...]] = []
    real_rotary, real_norm = kernels.apply_rotary_, kernels.rms_norm

    def rotary(*args, **kwargs):
        fused.append(kwargs.get("norm_weights") is not None
                     and kwargs.get("write_kv") is not None)
        return real_rotary(*args, **kwargs)

    def store(*args, **kwargs):
        raise AssertionError("store_kv ran: the RoPE kernel should have stored K/V")

    def norm(x, *args, **kwargs):
        if x.dim() == 3:
            head_norms.append(tuple(x.shape))
        return real_norm(x, *args, **kwargs)

    monkeypatch.setattr(kernels, "apply_rotary_", rotary)
    monkeypatch.setattr(kernels, "rms_norm", norm)
    monkeypatch.setattr(kernels, "store_kv", store)
    check_prefill_and_decode(ours, hf_reference(hf), vocab=256, chunks=[16, 16, 8],
                             driver_class=TritonDriver)
    check_prefix_hit_mixed_batch(ours, hf_reference(hf), vocab=256, driver_class=TritonDriver)
    assert fused and all(fused) and not head_norms
    attention = ours.model.layers[0].self_attn
    assert attention._norm_weights(torch.float32) is not None
    assert attention._norm_weights(torch.bfloat16) is None  # weights in another dtype: unfused


def test_triton_backend_builds_kernel_metadata_only(tiny):
    _, ours = tiny
    driver = TritonDriver(ours)
    seq = driver.new_seq(list(range(3, 13)))
    driver.step([(seq, 10)])
    from ksana_llm.runner.model_runner import SeqSlice

    _, _, meta, _, _ = driver.runner.build([SeqSlice([5], 10, seq.block_table, True)])
    assert meta.kernel_batch is not None and not meta.decode_groups and not meta.prefills
    assert meta.kernel_batch.decode_context_lens.tolist() == [11]


def test_engine_greedy_tokens_equal_on_both_backends(tmp_path):
    hf = build_tiny_model("llama2", tmp_path)
    torch.manual_seed(5)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (7, 23, 40)]
    expected = [greedy_trace(hf_reference(hf), p, 12)[0][len(p):] for p in prompts]
    config = GenerationConfig(max_new_tokens=12, ignore_eos=True)
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)
    with kt.Engine(model, generation_config=config, block_token_num=8, num_device_blocks=64,
                   split_fuse_token_num=16, attention_backend="triton") as engine:
        outputs = engine.generate_outputs(prompts)
    assert [o.token_ids for o in outputs] == expected


def test_engines_sharing_a_model_keep_their_own_kernels(tmp_path, monkeypatch):
    """One loaded model behind a Triton engine and a torch engine at once: the fused kernels
    (RMSNorm + residual, in-place RoPE, SiLU-gated MLP activation) run in the Triton engine's
    steps only, before and after the torch engine's, and both give transformers' greedy
    tokens."""
    from ksana_llm import kernels

    hf = build_tiny_model("llama2", tmp_path)
    prompt = torch.randint(3, 256, (19,), generator=torch.Generator().manual_seed(2)).tolist()
    expected = greedy_trace(hf_reference(hf), prompt, 8)[0][len(prompt):]
    calls: list[str] = []
    for name in ("rms_norm", "apply_rotary_", "silu_and_mul"):
        def counted(*args, _real=getattr(kernels, name), _name=name, **kwargs):
            calls.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(kernels, name, counted)
    config = GenerationConfig(max_new_tokens=8, ignore_eos=True)
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)
    with kt.Engine(model, generation_config=config, block_token_num=8, num_device_blocks=32,
                   attention_backend="triton") as fused, \
            kt.Engine(model, generation_config=config, block_token_num=8, num_device_blocks=32,
                      attention_backend="torch") as plain:
        for engine, uses_kernels in ((fused, True), (plain, False), (fused, True)):
            calls.clear()
            assert engine.generate_outputs([prompt])[0].token_ids == expected
            assert sorted(set(calls)) == (["apply_rotary_", "rms_norm", "silu_and_mul"]
                                          if uses_kernels else [])


def test_backend_choice_is_validated(tmp_path):
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    assert resolve_attention_backend("auto", module, torch.device("cpu")) == "torch"
    with pytest.raises(ValueError, match="attention_backend"):
        resolve_attention_backend("flash", module, torch.device("cpu"))
    with pytest.raises(ValueError, match="attention_backend"):
        kt.EngineConfig(attention_backend="flash")
