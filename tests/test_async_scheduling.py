"""Async scheduling (`EngineConfig.async_scheduling`): step k + 1 is planned and launched before
step k's sampled tokens are read back; the runner takes those tokens from the device.

On a CPU nothing runs concurrently, so these tests pin down the mechanism and what must not
change: which steps run ahead, that no sequence computes more than it may, that tokens a
stopped sequence sampled after its end are dropped, that prefix-cache blocks are published with
the real token ids, and that the runner's device-side input patch feeds the same forward as
known ids would (eager path and CUDA-graph static buffers). Output equality for a mixed batch,
with and without preemption, is in `test_output_overlap.py`.
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest  # noqa: E402

import ksana_llm as kt  # noqa: E402
from ksana_llm.api.core_builder import resolve_async_scheduling  # noqa: E402
from ksana_llm.api.model import Model  # noqa: E402
from ksana_llm.config import EngineConfig  # noqa: E402
from ksana_llm.engine.kv_cache import BlockManager  # noqa: E402
from ksana_llm.engine.request import PENDING_TOKEN, Sequence  # noqa: E402
from ksana_llm.generation_config import GenerationConfig  # noqa: E402
from ksana_llm.runner.model_runner import (ModelRunner, PendingInputs, SeqSlice,  # noqa: E402
                                           StepInput)
from tests.tiny_models import build_tiny_model  # noqa: E402
from tests.tolerances import LOGIT_ATOL  # noqa: E402

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


def _drive(engine: kt.Engine, requests: list[kt.Request]):
    """Run the requests on the engine's core by hand; returns (sequences, per-step records of
    (request id, slice tokens, pending-input slice?) for every scheduled slice)."""
    engine._stop_step_loop()  # the core and its KV cache stay, driven by hand
    core = engine._core
    seqs = []
    for request in requests:
        seq, _ = engine._requests.sequence(request, engine.generation_config)
        core.add(seq)
        seqs.append(seq)
    steps: list[list[tuple[str, list[int], bool]]] = []
    execute = core.runner.execute

    def recording_execute(step: StepInput):
        if not step.slices:
            return execute(step)  # a step that only reads back the one before
        pending = set(step.pending.slices) if step.pending is not None else set()
        ids = {id(s.block_table): s for s in seqs}
        steps.append([(ids[id(sl.block_table)].request_id if id(sl.block_table) in ids else "?",
                       list(sl.token_ids), j in pending) for j, sl in enumerate(step.slices)])
        return execute(step)

    core.runner.execute = recording_execute
    outputs = []
    while core.has_work():
        outputs.extend(core.step())
    return seqs, steps, outputs


def test_steps_run_ahead_and_no_sequence_computes_more_than_it_may(default_model):
    eos = default_model.tokenizer.eos_token_id
    with kt.Engine(default_model, num_device_blocks=64, async_scheduling=True) as sync_free:
        long, short = (kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=n, ignore_eos=True),
                                  request_id=name) for name, n in (("long", 9), ("short", 4)))
        seqs, steps, outputs = _drive(sync_free, [long, short])
    long_seq, short_seq = seqs
    # Each decode slice of a running-ahead step feeds the previous step's token from the device:
    # the host holds a placeholder for it.
    decodes = [(rid, tokens, pending) for step in steps[1:] for rid, tokens, pending in step]
    assert decodes and all(tokens == [PENDING_TOKEN] and pending for _, tokens, pending in decodes)
    # A sequence is computed for exactly its prompt and its max_new_tokens - 1 fed-back tokens:
    # once its last token is sampled it is not scheduled again, though that token is not known.
    assert sum(1 for rid, _, _ in decodes if rid == "long") == 9 - 1
    assert sum(1 for rid, _, _ in decodes if rid == "short") == 4 - 1
    assert len(long_seq.output_token_ids) == 9 and PENDING_TOKEN not in long_seq.output_token_ids
    assert len(short_seq.output_token_ids) == 4 and short_seq.num_pending_tokens == 0
    assert sync_free._core.num_steps_ahead == len(steps)
    # Outputs carry every token once, in order.
    for seq in seqs:
        got = [t for o in outputs if o.request_id == seq.request_id for t in o.new_token_ids]
        assert got == seq.output_token_ids

    # A sequence that stops on a token (here: the token it would produce 3rd) still ran in the
    # step launched ahead of that discovery; the token sampled there is dropped.
    with kt.Engine(default_model, num_device_blocks=64, async_scheduling=False) as reference:
        free = reference.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=6,
                                                                      ignore_eos=True),
                                          use_tqdm=False)[0]
    stop_token = free.token_ids[2]
    assert stop_token not in free.token_ids[:2] and stop_token != eos
    with kt.Engine(default_model, num_device_blocks=64, async_scheduling=True) as engine:
        stopping = kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=6, ignore_eos=True,
                                                          stop_token_ids=[stop_token]),
                              request_id="stopping")
        (seq,), steps, outputs = _drive(engine, [stopping])
    assert seq.output_token_ids == free.token_ids[:3]
    assert [t for o in outputs for t in o.new_token_ids] == free.token_ids[:3]
    assert outputs[-1].finished and outputs[-1].stop_reason == stop_token
    assert sum(1 for step in steps for rid, _, _ in step if rid == "stopping") == 1 + 3  # 1 wasted


def test_penalties_and_grammars_run_ahead(default_model):
    """Penalties and n-gram bans read the token ids the sampler keeps on the device; a grammar
    advances on the host, so a step sampling one reads the step in flight back after launching
    its forward and before sampling. Either way every step runs ahead, and the tokens are a
    synchronous engine's, including a grammar that ends while a step for it is in flight."""
    penalties = dict(repetition_penalty=1.5, presence_penalty=0.5, frequency_penalty=0.7,
                     no_repeat_ngram_size=2)
    requests = {
        "plain": kt.GenerationConfig(max_new_tokens=10, ignore_eos=True),
        "penalised": kt.GenerationConfig(max_new_tokens=8, ignore_eos=True, **penalties),
        "sampled": kt.GenerationConfig(max_new_tokens=8, ignore_eos=True, do_sample=True,
                                       num_return_sequences=2, seed=11, **penalties),
        "constrained": kt.GenerationConfig(max_new_tokens=6, ignore_eos=True,
                                           structured_output={"kind": "regex",
                                                              "value": "[a-z ]{60}"}),
        # Its grammar ends after a few tokens, while the next step for it is in flight.
        "short grammar": kt.GenerationConfig(max_new_tokens=10,
                                             structured_output={"kind": "regex",
                                                                "value": "[a-z ]{8}"}),
    }
    results = {}
    for run_ahead in (False, True):
        with kt.Engine(default_model, num_device_blocks=64, async_scheduling=run_ahead) as engine:
            seqs, steps, outputs = _drive(engine, [kt.Request(PROMPT, config, request_id=name)
                                                   for name, config in requests.items()])
            histories = list(engine._core.sampler._histories.values())
        results[run_ahead] = {(o.request_id, o.index): [] for o in outputs}
        for o in outputs:
            results[run_ahead][(o.request_id, o.index)].extend(o.new_token_ids)
        # Every penalised sequence held a slot of the device table; all are released.
        assert len(histories) == 1 and histories[0].num_rows == 0
    assert results[True] == results[False]
    assert len(results[True]) == 6
    # The penalties changed what greedy decoding gives; the short grammar ended by itself.
    assert results[True][("penalised", 0)] != results[True][("plain", 0)][:8]
    assert 1 < len(results[True][("short grammar", 0)]) < 10
    assert len(results[True][("constrained", 0)]) == 6
    # Every step after the first (the prefill's) fed its tokens from the device.
    assert all(any(p for _, _, p in step) for step in steps[1:])
    assert engine._core.num_steps_ahead == len(steps)
    assert all(PENDING_TOKEN not in s.output_token_ids for s in seqs)


def test_prefix_cache_publishes_the_real_tokens(default_model):
    """Blocks completed by a pending token are published once it is known, under the same keys
    as without async scheduling; a follow-up request reusing prompt + output hits them."""
    config = kt.GenerationConfig(max_new_tokens=21, ignore_eos=True)
    keys, hits, texts = {}, {}, {}
    for run_ahead in (False, True):
        with kt.Engine(default_model, num_device_blocks=64, block_token_num=4,
                       async_scheduling=run_ahead) as engine:
            first = engine.generate_outputs(PROMPT, config, use_tqdm=False)[0]
            bm = engine._core.block_manager
            keys[run_ahead] = set(bm.cached_blocks)
            follow_up = first.prompt_token_ids + first.token_ids
            before = bm.prefix_hits
            texts[run_ahead] = engine.generate(follow_up, kt.GenerationConfig(max_new_tokens=5))
            hits[run_ahead] = bm.prefix_hits - before
    assert keys[True] == keys[False] and len(keys[True]) >= 8
    assert hits[True] == hits[False] > 0
    assert texts[True] == texts[False]


def test_block_hashes_cover_known_tokens_only():
    bm = BlockManager(8, 4)
    seq = Sequence("s", [1, 2, 3, 4, 5, 6, 7], GenerationConfig())
    seq.output_token_ids.append(PENDING_TOKEN)  # completes the second block, unknown yet
    seq.num_pending_tokens = 1
    bm.update_block_hashes(seq)
    assert len(seq.block_hashes) == 1
    seq.output_token_ids[-1] = 8
    seq.num_pending_tokens = 0
    bm.update_block_hashes(seq)
    assert len(seq.block_hashes) == 2


# ---- the runner's device-side input patch -------------------------------------------------------
@pytest.mark.parametrize("graphs", [False, True], ids=["eager", "graph-buffers"])
def test_pending_inputs_feed_the_same_forward_as_known_ids(tmp_path, graphs):
    build_tiny_model("llama2", tmp_path)
    module = Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False).module
    runner = ModelRunner(module, device=torch.device("cpu"), dtype=torch.float32, num_blocks=16,
                         block_size=4, attention_backend="triton" if graphs else "torch",
                         cuda_graphs=False)
    if graphs:
        runner.setup_cuda_graphs(4, capture=False)  # the static buffers, run eagerly on a CPU
    prompts = [[5, 9, 13, 2, 7], [3, 8, 1], [4, 4, 6, 11, 12, 2]]
    tables = [[0, 1], [2], [3, 4]]
    runner.execute(StepInput([SeqSlice(p, 0, t, sample=True) for p, t in zip(prompts, tables)],
                             [], []))
    next_ids = [17, 23, 29]
    known = [SeqSlice([tok], len(p), t, sample=True)
             for tok, p, t in zip(next_ids, prompts, tables)]
    # The same step with the tokens pending: rows of the "previous step's" samples, in another
    # order, except the middle sequence, whose token the host knows.
    source = torch.tensor([29, 99, 17])
    pending = [SeqSlice([PENDING_TOKEN], s.start, s.block_table, sample=True) for s in known]
    pending[1] = known[1]
    kv_before = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    steps_before = runner.decode_graphs.steps_run if graphs else 0
    expected = runner.execute(StepInput(known, [], []))
    kv_known = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    for (k, v), (k0, v0) in zip(runner.kv_caches, kv_before):
        k.copy_(k0)
        v.copy_(v0)
    got = runner.execute(StepInput(pending, [], [], pending=PendingInputs([0, 2], [2, 0], source)))
    if graphs:
        assert runner.decode_graphs.steps_run == steps_before + 2
    assert got.sampled == expected.sampled
    torch.testing.assert_close(got.logits, expected.logits)
    for (k, v), (k1, v1) in zip(runner.kv_caches, kv_known):
        torch.testing.assert_close(k, k1)
        torch.testing.assert_close(v, v1)


# ---- configuration -------------------------------------------------------------------------------
def test_async_scheduling_setting():
    cuda, cpu = torch.device("cuda"), torch.device("cpu")  # device objects only
    single = SimpleNamespace(runtime=None, device=cuda)
    parallel = SimpleNamespace(runtime=object(), device=cuda)
    assert resolve_async_scheduling(EngineConfig(), single) is True
    assert resolve_async_scheduling(EngineConfig(), SimpleNamespace(runtime=None, device=cpu)) \
        is False
    assert resolve_async_scheduling(EngineConfig(), parallel) is False
    assert resolve_async_scheduling(EngineConfig(async_scheduling=False), single) is False
    assert resolve_async_scheduling(EngineConfig(async_scheduling=True),
                                    SimpleNamespace(runtime=None, device=cpu)) is True
    with pytest.raises(ValueError, match="async_scheduling needs a single-rank run"):
        resolve_async_scheduling(EngineConfig(async_scheduling=True), parallel)
    with pytest.raises(ValueError, match="async_scheduling"):
        EngineConfig(async_scheduling="maybe")


def test_beams_ending_in_their_first_step_keep_their_prompt_logprobs(default_model):
    """A beam search that ends in the step finishing its prompt answers in that step, so the
    step's captured prompt log-probs are read then, not with the next step's read-back."""
    configs = [kt.GenerationConfig(max_new_tokens=1, num_beams=2, prompt_logprobs=1),
               kt.GenerationConfig(max_new_tokens=3, num_beams=2, prompt_logprobs=1),
               kt.GenerationConfig(max_new_tokens=1, prompt_logprobs=1)]
    results = {}
    for run_ahead in (False, True):
        with kt.Engine(default_model, num_device_blocks=64, async_scheduling=run_ahead) as engine:
            results[run_ahead] = engine.generate_outputs([PROMPT] * 3, configs, use_tqdm=False)
    for sync, ahead in zip(results[False], results[True]):
        assert ahead.token_ids == sync.token_ids
        assert ahead.prompt_logprobs is not None
        assert len(ahead.prompt_logprobs) == len(sync.prompt_logprobs) == len(sync.prompt_token_ids)
        for a, b in zip(ahead.prompt_logprobs[1:], sync.prompt_logprobs[1:]):
            assert a["token_id"] == b["token_id"]
            assert a["logprob"] == pytest.approx(b["logprob"], abs=LOGIT_ATOL)
