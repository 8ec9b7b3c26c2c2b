"""Captured rows' logits go through the LM head a slice of rows at a time (`runner.
captured_rows`), each slice reduced before the next is made: forward-only logits, prompt
log-probs (several top-k widths in one step) and hidden-only rows against transformers on the
default model, with the LM head never shown more rows than one slice; and the same through the
engine. The profiled step (KV sizing) carries one such slice."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.forward_outputs import ForwardTarget
from ksana_llm.generation_config import MAX_LOGPROBS
from ksana_llm.runner.captured_rows import logit_rows_per_chunk
from ksana_llm.runner.memory import profile_step
from ksana_llm.runner.model_runner import ModelRunner, SeqSlice, StepInput
from ksana_llm.runner.slices import PromptLogprobTargets
from tests.tolerances import LOGIT_ATOL

PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
          "Berlin is the capital of Germany.")
ROWS_PER_SLICE = 3  # divides none of the row counts below: slices straddle the kinds' borders


@pytest.fixture(scope="module")
def ids(model):
    ids = model.tokenizer.encode(PROMPT)
    assert len(ids) > 2 * ROWS_PER_SLICE and len(ids) % ROWS_PER_SLICE
    return ids


@pytest.fixture(scope="module")
def hf(model, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    return out.logits[0].float(), out.hidden_states[-1][0]


@contextlib.contextmanager
def lm_head_rows(module: torch.nn.Module) -> Iterator[list[int]]:
    """The row count of every LM-head call on `module` while inside."""
    calls: list[int] = []
    original = module.compute_logits

    def counted(hidden: torch.Tensor) -> torch.Tensor | None:
        calls.append(hidden.shape[0])
        return original(hidden)

    module.compute_logits = counted  # an instance attribute: the class's method is untouched
    try:
        yield calls
    finally:
        del module.compute_logits


def check_prompt_logprobs(packed: torch.Tensor, expected: torch.Tensor, targets: list[int],
                          k: int, width: int) -> None:
    """`packed` rows [chosen, rank, top `width` values, top `width` ids] against log-probs
    `expected` [rows, vocab]; the first k of the top entries checked."""
    assert packed.shape == (len(targets), 2 + 2 * width) and packed.dtype == torch.float64
    for row, ref, token in zip(packed, expected, targets):
        lp = float(ref[token])
        assert float(row[0]) == pytest.approx(lp, abs=LOGIT_ATOL)
        assert int((ref > lp + LOGIT_ATOL).sum()) + 1 <= int(row[1]) \
            <= int((ref >= lp - LOGIT_ATOL).sum())
        top_v, top_i = ref.topk(k)
        assert row[2 + width:2 + width + k].long().tolist() == top_i.tolist()
        assert row[2:2 + k].tolist() == pytest.approx(top_v.tolist(), abs=LOGIT_ATOL)


def test_captured_rows_in_slices_match_transformers(model, ids, hf):
    logits, hidden = hf
    log_probs = torch.log_softmax(logits, dim=-1)
    n = len(ids)
    module = model.module
    runner = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32,
                         num_blocks=32, block_size=16, attention_backend="torch",
                         cuda_graphs=False)
    runner.capture_chunk_elements = ROWS_PER_SLICE * module.config.vocab_size
    blocks = -(-n // 16)

    def table(j: int) -> list[int]:
        return list(range(j * blocks, (j + 1) * blocks))

    slices = [
        # hidden rows only, listed first: the rows that need logits still form one block
        SeqSlice(ids, 0, table(0), sample=False, capture=(0, 5, n - 1)),
        SeqSlice(ids, 0, table(1), sample=False, capture=tuple(range(n)), capture_logits=True),
        SeqSlice(ids, 0, table(2), sample=False, capture=tuple(range(n - 1)),
                 prompt_logprobs=PromptLogprobTargets(tuple(ids[1:]), 3)),
        # a narrower top-k in the same step, and a sampled row beside the captured ones
        SeqSlice(ids, 0, table(3), sample=True, capture=tuple(range(2, n - 1)),
                 prompt_logprobs=PromptLogprobTargets(tuple(ids[3:]), 1)),
    ]
    with lm_head_rows(module) as calls:
        result = runner.execute(StepInput(slices, [], []))
    captured = result.captured
    assert sorted(captured) == [0, 1, 2, 3]

    only_hidden = captured[0]
    assert only_hidden.logits is None and only_hidden.prompt_logprobs is None
    torch.testing.assert_close(only_hidden.hidden, hidden[[0, 5, n - 1]], atol=LOGIT_ATOL,
                               rtol=1e-5)
    full = captured[1].logits.wait()
    assert full.shape == logits.shape and full.dtype == torch.float32
    torch.testing.assert_close(full, logits, atol=LOGIT_ATOL, rtol=1e-5)
    torch.testing.assert_close(captured[1].hidden, hidden, atol=LOGIT_ATOL, rtol=1e-5)
    check_prompt_logprobs(captured[2].prompt_logprobs.wait(), log_probs[:n - 1], ids[1:], 3, 3)
    check_prompt_logprobs(captured[3].prompt_logprobs.wait(), log_probs[2:n - 1], ids[3:], 1, 3)
    assert captured[2].logits is None and captured[3].logits is None
    torch.testing.assert_close(result.logits[0], logits[-1], atol=LOGIT_ATOL, rtol=1e-5)

    # Every captured logits row went through the LM head once, a slice at a time; then the
    # sampled row.
    captured_rows = n + (n - 1) + (n - 3)
    assert calls[:-1] == [ROWS_PER_SLICE] * (captured_rows // ROWS_PER_SLICE) + \
        [captured_rows % ROWS_PER_SLICE] * bool(captured_rows % ROWS_PER_SLICE)
    assert calls[-1] == 1

    # A tensor-parallel worker rank (`host_outputs=False`, as `distributed/worker.py` builds
    # it): the same LM-head calls, row for row (each is a collective under TP, matched with
    # rank 0's), but nothing copied to the host or reduced: nobody reads it there.
    worker = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32,
                         num_blocks=32, block_size=16, attention_backend="torch",
                         cuda_graphs=False, host_outputs=False)
    worker.capture_chunk_elements = runner.capture_chunk_elements
    with lm_head_rows(module) as worker_calls:
        on_worker = worker.execute(StepInput(slices, [], [])).captured
    assert worker_calls == calls
    assert all(c.logits is None and c.prompt_logprobs is None for c in on_worker.values())
    torch.testing.assert_close(on_worker[1].hidden, hidden, atol=LOGIT_ATOL, rtol=1e-5)
    with pytest.raises(ValueError, match="prompt_logprobs: one target token per captured row"):
        runner.execute(StepInput([SeqSlice(ids, 0, table(0), sample=False, capture=(0, 1),
                                           prompt_logprobs=PromptLogprobTargets((5,), 1))],
                                 [], []))


def test_engine_forward_and_prompt_logprobs_in_slices(model, ids, hf):
    logits, _ = hf
    log_probs = torch.log_softmax(logits, dim=-1)
    n = len(ids)
    with kt.Engine(model, num_device_blocks=64) as engine:
        engine._core.runner.capture_chunk_elements = 2 * model.module.config.vocab_size
        with lm_head_rows(model.module) as calls:
            out = engine.forward(ids, [ForwardTarget("logits", [[0, -1]]),
                                       ForwardTarget("logits", [[0, n - 2]],
                                                     token_logprobs=True)])
            scored = engine.generate_outputs(ids, kt.GenerationConfig(
                max_new_tokens=1, prompt_logprobs=2), use_tqdm=False)[0]
    assert max(calls) <= 2 and len(calls) > n
    torch.testing.assert_close(out.targets[0].tensor, logits, atol=LOGIT_ATOL, rtol=1e-5)
    expected = log_probs[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(out.targets[1].token_logprobs, expected, atol=LOGIT_ATOL,
                               rtol=1e-5)
    entries = scored.prompt_logprobs
    assert len(entries) == n and entries[0] is None
    for p in range(1, n):
        assert entries[p]["token_id"] == ids[p]
        assert entries[p]["logprob"] == pytest.approx(float(log_probs[p - 1, ids[p]]),
                                                      abs=LOGIT_ATOL)
        assert list(entries[p]["top_logprobs"]) == log_probs[p - 1].topk(2).indices.tolist()


def test_profiled_step_scores_one_slice_of_prompt_rows(model):
    vocab = model.module.config.vocab_size
    rows = logit_rows_per_chunk(vocab)
    assert rows == 2**27 // vocab
    step, _ = profile_step(8192, 256, 16, scored_rows=rows)
    prefill = step.slices[0]
    assert prefill.capture == tuple(range(rows)) and not prefill.capture_logits
    assert prefill.prompt_logprobs == PromptLogprobTargets((0,) * rows, MAX_LOGPROBS)
    assert all(not s.capture and s.prompt_logprobs is None for s in step.slices[1:])
    short, _ = profile_step(64, 4, 16, scored_rows=rows)  # no more rows than the chunk has
    assert short.slices[0].capture == tuple(range(61))
