"""A KV block holds whatever its last sequence left in it. The torch attention backends (and
MLA's) gather whole blocks and mask the slots a sequence has not written (the Triton kernels
read up to each context's length); a masked slot must weigh nothing even when what it holds is
not finite (a former request whose activations overflowed), or one request's garbage would
spread to the unrelated requests that reuse its blocks."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from tests.tiny_models import build_tiny_model

PROMPTS = ["The capital of France is", "List three prime numbers and explain why each is prime:"]


@pytest.fixture(scope="module")
def tiny_mla_model(tmp_path_factory) -> kt.Model:
    folder = tmp_path_factory.mktemp("tiny-deepseek-v3")
    build_tiny_model("deepseek-v3", folder)
    return kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)


def _greedy(engine: kt.Engine, prompts: list[list[int]], max_new_tokens: int) -> list[list[int]]:
    config = kt.GenerationConfig(max_new_tokens=max_new_tokens, ignore_eos=True)
    return [o.token_ids for o in engine.generate_outputs(prompts, config, use_tqdm=False)]


def _poisoned_run_is_clean(model: kt.Model, prompts: list[list[int]], poisons: tuple[float, ...],
                           max_new_tokens: int, **engine_args) -> None:
    with kt.Engine(model, num_device_blocks=64, **engine_args) as engine:
        clean = _greedy(engine, prompts, max_new_tokens)
        for poison in poisons:
            for cache in engine._core.runner.kv_caches:
                for part in cache:
                    part.fill_(poison)
            assert _greedy(engine, prompts, max_new_tokens) == clean, poison


@pytest.mark.parametrize("backend, split_fuse, max_new_tokens, poisons", [
    ("torch", 0, 8, (float("nan"), float("inf"))),
    # Prompts prefilled 4 tokens a step: each later chunk gathers its cached blocks too.
    ("torch", 4, 4, (float("nan"),)),
    ("triton", 0, 2, (float("nan"),)),  # (in Triton's interpreter on a CPU: a few steps only)
])
def test_masked_slots_holding_nan_or_inf_change_nothing(model, backend, split_fuse,
                                                        max_new_tokens, poisons):
    """Two prompts of different lengths: a decode group padded to one length, and each last
    block's unwritten tail, read with every cache slot poisoned first."""
    prompts = [model.tokenizer.encode(p) for p in PROMPTS]
    _poisoned_run_is_clean(model, prompts, poisons, max_new_tokens, attention_backend=backend,
                           split_fuse_token_num=split_fuse)


def test_mla_masked_slots_holding_nan_change_nothing(tiny_mla_model):
    """The same for MLA's latent cache (DeepSeek V3), decodes and chunked prefills."""
    torch.manual_seed(0)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (7, 13, 13)]
    for split_fuse in (0, 4):
        _poisoned_run_is_clean(tiny_mla_model, prompts, (float("nan"),), 6,
                               attention_backend="torch", split_fuse_token_num=split_fuse)
