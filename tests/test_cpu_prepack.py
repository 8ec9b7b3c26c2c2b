"""CPU float32 weights get oneDNN's prepacked copy only when a second copy fits: half the memory
available at most, unless $KSANA_LLM_CPU_PREPACK forces it on or off. Packed or not, the model
gives transformers' logits."""

from __future__ import annotations

import logging

import pytest
import torch

import ksana_llm as kt
from ksana_llm.layers import linear
from tests.tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    folder = tmp_path_factory.mktemp("prepack")
    hf = build_tiny_model("llama2", folder)
    ids = list(range(5, 25))
    with torch.no_grad():
        expected = hf(torch.tensor([ids])).logits[0]
    return folder, ids, expected


def _packed_count(model: kt.Model) -> int:
    module = model.module
    packed = sum(1 for m in module.modules() if getattr(m, "packed_weight", None) is not None)
    return packed + (module._lm_head_packed is not None)


def _logits(model: kt.Model, ids: list[int]) -> torch.Tensor:
    with kt.Engine(model, num_device_blocks=16) as engine:
        return engine.forward(ids, [{"target_name": "logits"}]).targets[0].tensor


@pytest.mark.parametrize("env, available, packed", [
    (None, None, True),  # no /proc/meminfo: as before
    (None, 10**12, True),  # plenty of memory
    (None, 1000, False),  # a second copy would not fit
    ("1", 1000, True),  # forced on
    ("0", 10**12, False),  # forced off
])
def test_prepacking_follows_memory_and_the_switch(tiny, monkeypatch, caplog, env, available,
                                                  packed):
    folder, ids, expected = tiny
    if env is None:
        monkeypatch.delenv(linear.PREPACK_ENV_VAR, raising=False)
    else:
        monkeypatch.setenv(linear.PREPACK_ENV_VAR, env)
    monkeypatch.setattr(linear, "available_memory_bytes", lambda: available)
    with caplog.at_level(logging.WARNING, logger="ksana_llm.model"):
        model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    # 2 layers x (qkv, o, gate_up, down) + the LM head, or nothing.
    assert _packed_count(model) == (9 if packed else 0)
    assert ("not prepacked" in caplog.text) == (not packed and env is None)
    torch.testing.assert_close(_logits(model, ids), expected, atol=2e-4, rtol=1e-4)


def test_a_bad_switch_value_names_the_variable(tiny, monkeypatch):
    monkeypatch.setenv(linear.PREPACK_ENV_VAR, "yes")
    with pytest.raises(ValueError, match="KSANA_LLM_CPU_PREPACK"):
        kt.Model.from_pretrained(tiny[0], device="cpu", dtype="float32", progress=False)


@pytest.mark.parametrize("prepacked_wins", [True, False], ids=["prepacked", "dense"])
def test_few_row_batches_take_the_matmul_measured_faster(tiny, monkeypatch, prepacked_wins):
    """Where F.linear multiplies a row faster than the prepacked copies (Intel CPUs, as
    measured), decode batches of up to FEW_ROWS rows use it and larger ones the copies; either
    way the greedy tokens are transformers'."""
    from transformers import AutoModelForCausalLM

    from ksana_llm.models import llama

    folder, ids, _ = tiny
    monkeypatch.setenv(linear.PREPACK_ENV_VAR, "1")
    monkeypatch.setattr(llama, "prepacked_wins_few_rows", lambda: prepacked_wins)
    packed_rows: list[int] = []

    def counting(x: torch.Tensor, packed: torch.Tensor, bias) -> torch.Tensor:
        packed_rows.append(x.shape[0])
        return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")

    monkeypatch.setattr(linear, "packed_linear", counting)
    monkeypatch.setattr(llama, "packed_linear", counting)
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    min_rows = 1 if prepacked_wins else linear.FEW_ROWS + 1
    assert {m.packed_min_rows for m in model.module.modules()
            if getattr(m, "packed_weight", None) is not None} == {min_rows}
    config = kt.GenerationConfig(max_new_tokens=6, ignore_eos=True)
    with kt.Engine(model, generation_config=config, num_device_blocks=16) as engine:
        tokens = engine.generate_outputs([ids], use_tqdm=False)[0].token_ids
    hf = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = hf.generate(torch.tensor([ids]), max_new_tokens=6, do_sample=False,
                               min_new_tokens=6)[0, len(ids):].tolist()
    assert tokens == expected
    assert max(packed_rows) == len(ids)  # the prefill takes the copies either way
    assert (min(packed_rows) == 1) == prepacked_wins  # decode steps: one row


@pytest.mark.parametrize("vendor, wins", [("GenuineIntel", False), ("AuthenticAMD", True),
                                           ("", True)])
def test_few_row_choice_follows_the_cpu_measured(monkeypatch, vendor, wins):
    """F.linear for 1-2 rows on Intel CPUs (measured faster on a Xeon VM), the prepacked copies
    elsewhere (measured faster on an EPYC VM, and the default where the vendor is unknown)."""
    monkeypatch.setattr(linear, "cpu_vendor", lambda: vendor)
    assert linear.prepacked_wins_few_rows() is wins


def test_cpu_vendor_reads_proc_cpuinfo():
    with open("/proc/cpuinfo", encoding="ascii", errors="replace") as cpuinfo:
        expected = next((line.split(":")[1].strip() for line in cpuinfo
                         if line.startswith("vendor_id")), "")
    assert linear.cpu_vendor() == expected
