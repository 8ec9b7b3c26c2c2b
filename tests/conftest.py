"""Shared fixtures: the real default model (SmolLM2-135M-Instruct) converted once per session."""

from __future__ import annotations


import os

import pytest
import torch

# Without a GPU, Triton kernels run in Triton's interpreter. Triton reads TRITON_INTERPRET when it is
# first imported (transformers may import it early), so set it before anything else.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# Two cores on CI: let torch use both, and keep results deterministic across runs.
torch.manual_seed(0)

from tests.engine_fixtures import engine_fixture  # noqa: E402  (after TRITON_INTERPRET is set)


@pytest.fixture(scope="session")
def default_model_dir():
    from ksana_llm.loader import resolve_model_dir

    return resolve_model_dir(None)


@pytest.fixture(scope="session")
def default_model(default_model_dir):
    """The default model loaded once (fp32, CPU) and shared by every test that builds an Engine:
    engines keep their KV caches to themselves, and the weights are only read."""
    import ksana_llm as kt

    return kt.Model.from_pretrained(default_model_dir, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="session")
def model(default_model):
    """`model` in a test is the default model unless its module defines its own."""
    return default_model


# The Python API on the default model: the reference for what a server must answer.
local_engine = engine_fixture(num_device_blocks=256)


@pytest.fixture(scope="session")
def hf_default_model(default_model_dir):
    """transformers' model on the same weights (fp32): the reference for greedy tokens."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(server):
    """The official `openai` client on the module's `server` fixture (a ServerProcess)."""
    import openai

    # 120 s: a request may wait behind a batch of 20 schema-constrained ones on a 2-core CPU.
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def model_name(client):
    return client.models.list().data[0].id
