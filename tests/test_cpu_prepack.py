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
    packed = sum(1 for m in module.modules() if getattr(m, "_packed", None) is not None)
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
