"""What a KV block held for its last owner never reaches the next one.

The torch attention backend reads a sequence's context in whole blocks and masks the tail of
its last block, but a masked position still multiplies its V row by a zero weight, and 0 * NaN
is NaN. A NaN or inf a request left in a block (an fp16 overflow, say) would then corrupt
whoever gets the block next, unless blocks are cleared as they change hands
(`BlockManager.take_fresh_blocks`, `ModelRunner._clear_blocks`). The tests fill every block
with NaN, as such a request could have, and check that later requests still produce
transformers' greedy tokens. The Triton kernels load only the positions they attend to: they
need no clearing (and get none), which the last test checks in the interpreter.
"""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.model import Model
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.model_runner import ModelRunner, StepInput
from tests.family_harness import greedy_trace, hf_reference
from tests.hf_references import hf_greedy_tokens
from tests.tiny_models import build_tiny_model

MAX_NEW = 16
PROMPTS = ["The capital of France is", "def fibonacci(n):", "List three primary colors:",
           "Once upon a time, in a small village,"]


def poison(runner: ModelRunner) -> None:
    """Every device block full of NaN, as a request whose K/V overflowed could leave them."""
    for pair in runner.kv_caches + runner.draft_kv_caches:
        for cache in pair:
            cache.fill_(float("nan"))


@pytest.fixture(scope="module")
def reference(default_model, hf_default_model):
    return hf_greedy_tokens(hf_default_model, default_model.tokenizer, PROMPTS, MAX_NEW)


@pytest.mark.parametrize("num_blocks, preempt_mode", [(64, 0), (6, 0), (6, 1)],
                         ids=["roomy", "swapping", "recomputing"])
def test_nan_left_in_blocks_reaches_no_later_request(default_model, reference, num_blocks,
                                                     preempt_mode):
    """Six blocks of 16 tokens for four growing sequences of two blocks each: they preempt each other (swapped
    out and back, or recomputed), so blocks change hands mid-request too."""
    config = kt.GenerationConfig(max_new_tokens=MAX_NEW)
    with kt.Engine(default_model, generation_config=config, num_device_blocks=num_blocks,
                   preempt_mode=preempt_mode, attention_backend="torch") as engine:
        poison(engine._core.runner)
        outputs = engine.generate_outputs(PROMPTS, use_tqdm=False)
        preemptions = engine.stats().num_preemptions
    assert [o.token_ids for o in outputs] == reference
    assert (preemptions > 0) == (num_blocks == 6)


def test_blocks_are_cleared_after_swap_outs_and_before_anything_else(tmp_path):
    """A step's fresh blocks are zeroed in every cache, after its swap-outs (a block swapped
    out may be handed on in the same step: the host gets its old contents), and nothing else."""
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    runner = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32, num_blocks=8,
                         block_size=4, num_host_blocks=2, attention_backend="torch",
                         cuda_graphs=False)
    poison(runner)
    runner.execute(StepInput([], swap_out=[(3, 1)], swap_in=[], fresh_blocks=[3, 5]))
    for device_pair, host_pair in zip(runner.kv_caches, runner.host_caches):
        for cache, host in zip(device_pair, host_pair):
            assert torch.equal(cache[[3, 5]], torch.zeros_like(cache[[3, 5]]))
            assert cache[[0, 1, 2, 4, 6, 7]].isnan().all()
            assert host[1].isnan().all()


def test_triton_kernels_never_read_the_masked_tail(tmp_path):
    hf = build_tiny_model("llama2", tmp_path)
    torch.manual_seed(5)
    prompts = [torch.randint(3, 256, (n,)).tolist() for n in (7, 13)]
    expected = [greedy_trace(hf_reference(hf), p, 6)[0][len(p):] for p in prompts]
    model = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)
    with kt.Engine(model, generation_config=GenerationConfig(max_new_tokens=6, ignore_eos=True),
                   block_token_num=8, num_device_blocks=16,
                   attention_backend="triton") as engine:
        runner = engine._core.runner
        assert not runner.clears_fresh_blocks
        poison(runner)
        outputs = engine.generate_outputs(prompts, use_tqdm=False)
    assert [o.token_ids for o in outputs] == expected
