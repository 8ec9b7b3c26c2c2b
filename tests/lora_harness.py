"""What the LoRA tests share: a tiny Llama with three PEFT adapters (`lora_setup`, a fixture),
the prompts, PEFT's greedy tokens, and an engine over the tiny model."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from tests.family_harness import greedy_trace, hf_reference
from tests.lora_adapters import ALL_TARGETS, make_adapter
from tests.tiny_models import build_tiny_model

NUM_TOKENS = 12
PROMPTS = [[1, 5, 9, 33, 17, 99, 120, 7, 8, 3, 44, 61, 70, 23, 5, 200, 19],
           [1, 77, 12, 250, 31],
           [1, 5, 9, 33, 17, 99, 120, 7, 8, 3, 44, 61, 70, 23, 5, 200, 19, 88, 4, 180, 66]]


@pytest.fixture(scope="module")
def lora_setup(tmp_path_factory):
    """A tiny GQA Llama with biases (weights wide enough for varied greedy tokens) and three
    adapters: every projection at rank 8; q/v/down at rank 4 with rsLoRA; and one with a rank
    pattern and an alpha pattern (an alternation, matched as PEFT matches it)."""
    folder = tmp_path_factory.mktemp("lora")
    base = build_tiny_model("yi-gqa4-bias", folder / "base")
    with torch.no_grad():
        for name, param in base.named_parameters():
            if param.dim() == 2:
                param.normal_(0, 0.2)
    base.save_pretrained(folder / "base")
    adapters = {
        "all": make_adapter(base, folder / "all", seed=1, targets=ALL_TARGETS, rank=8),
        "qv-rslora": make_adapter(base, folder / "qv-rslora", seed=2,
                                  targets=["q_proj", "v_proj", "down_proj"], rank=4,
                                  use_rslora=True),
        "patterns": make_adapter(base, folder / "patterns", seed=3,
                                 targets=["k_proj", "o_proj", "up_proj"], rank=2,
                                 rank_pattern={"o_proj": 6},
                                 alpha_pattern={"up_proj|k_proj": 1.5}),
    }
    return folder, base, adapters


def expected_tokens(model: torch.nn.Module, prompt: list[int]) -> list[int]:
    return greedy_trace(hf_reference(model), prompt, NUM_TOKENS)[0][len(prompt):]


def make_engine(model_dir: Path, **kwargs) -> kt.Engine:
    model = Model.from_pretrained(model_dir, device="cpu", dtype="float32", progress=False)
    config = GenerationConfig(max_new_tokens=NUM_TOKENS, ignore_eos=True)
    settings = dict(block_token_num=4, num_device_blocks=128, split_fuse_token_num=8)
    return kt.Engine(model, generation_config=config, **{**settings, **kwargs})


def submit_all(engine: kt.Engine, jobs: list[tuple[list[int], str | None]]) -> list[list[int]]:
    """Submit every job before waiting for any, so they share steps (and their batches mix
    adapters, chunked prefills and decodes)."""
    handles = [engine.submit(kt.Request(prompt, lora=lora)) for prompt, lora in jobs]
    return [handle.result().token_ids for handle in handles]


def rewrite_adapter(folder: Path, target: Path, *, config: dict | None = None,
             tensors=None) -> str:
    """A copy of adapter `folder` with some config keys or tensors changed."""
    target.mkdir()
    settings = json.loads((folder / "adapter_config.json").read_text())
    (target / "adapter_config.json").write_text(json.dumps({**settings, **(config or {})}))
    weights = load_file(folder / "adapter_model.safetensors")
    save_file(tensors(weights) if tensors else weights, target / "adapter_model.safetensors")
    return str(target)
