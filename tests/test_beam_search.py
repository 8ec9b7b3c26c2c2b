"""Beam search on the real default model: the same sequences and scores as
`transformers.generate(num_beams=k)` (also with stop strings), through batching, preemption (both
modes) and block forking; invalid combinations are ValueErrors naming the field."""

from __future__ import annotations

import itertools
import math
import time

import pytest
import torch

import ksana_llm as kt
from tests.engine_fixtures import stats_once_blocks_free
from tests.family_harness import one_thread
from tests.tiny_models import build_tiny_model
from tests.tolerances import LOGIT_ATOL

MAX_NEW = 12


# (num_beams, num_return_sequences, length_penalty, early_stopping)
CASES = [
    (2, 2, 1.0, False),
    (4, 4, 0.6, True),
    (4, 3, 1.5, "never"),
]


@pytest.fixture(scope="module")
def prompts(default_model):
    """Chat answers that end with EOS inside the limit (finished hypotheses compete with running
    beams) and raw text that runs to the limit."""
    tok = default_model.tokenizer

    def chat(text: str) -> list[int]:
        return tok.encode(tok.apply_chat_template([{"role": "user", "content": text}],
                                                  add_generation_prompt=True, tokenize=False))

    return [chat("What is the capital of France?"), tok.encode("The three primary colors are"),
            chat("Name one planet.")]


@pytest.fixture(scope="module")
def hf_model(hf_default_model):
    return hf_default_model  # the session's transformers model (conftest), not a second load


def _config(num_beams, num_return, length_penalty, early_stopping, **kwargs) -> kt.GenerationConfig:
    return kt.GenerationConfig(max_new_tokens=MAX_NEW, num_beams=num_beams,
                               num_return_sequences=num_return, length_penalty=length_penalty,
                               early_stopping=early_stopping, **kwargs)


def _hf_beams(hf_model, ids: list[int], config: kt.GenerationConfig, eos: tuple[int, ...]):
    """transformers' returned sequences (generated part, cut after the first EOS: the rest is
    padding) and their sequences_scores."""
    with torch.no_grad(), one_thread():
        out = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=config.max_new_tokens, do_sample=False,
            num_beams=config.num_beams, num_return_sequences=config.num_return_sequences,
            length_penalty=config.length_penalty, early_stopping=config.early_stopping,
            repetition_penalty=config.repetition_penalty,
            no_repeat_ngram_size=config.no_repeat_ngram_size or None,
            return_dict_in_generate=True, output_scores=True)
    sequences = []
    for row in out.sequences[:, len(ids):].tolist():
        cut = next((i + 1 for i, t in enumerate(row) if t in eos), len(row))
        sequences.append(row[:cut])
    return sequences, out.sequences_scores.tolist()


@pytest.fixture(scope="module")
def reference(hf_model, prompts, default_model):
    """(prompt index, case) -> transformers' beams, for the prompt/case pairs the tests use."""
    pairs = [(0, c) for c in CASES] + [(1, CASES[0]), (2, CASES[1])]
    return {(p, case): _hf_beams(hf_model, prompts[p], _config(*case), default_model.eos_token_ids)
            for p, case in pairs}


# Two candidate beams whose transformers scores lie closer than this are a tie: which one wins
# is decided by fp32 rounding (see tests/tolerances.py).
TIE = LOGIT_ATOL


def _hf_score(hf_model, prompt: list[int], tokens: list[int], config: kt.GenerationConfig
              ) -> float:
    """transformers' beam score of `tokens` generated after `prompt`: the log-probs its beam
    search adds up (log-softmax, then the penalty processors), over len ** length_penalty
    (generate's normalisation, EOS counted)."""
    from transformers import (LogitsProcessorList, NoRepeatNGramLogitsProcessor,
                              RepetitionPenaltyLogitsProcessor)

    processors = LogitsProcessorList()
    if config.repetition_penalty != 1.0:
        processors.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        processors.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    ids = torch.tensor([prompt + tokens])
    with torch.no_grad(), one_thread():
        logprobs = torch.log_softmax(hf_model(ids).logits[0, len(prompt) - 1:-1], dim=-1)
    total = sum(float(processors(ids[:, :len(prompt) + i], logprobs[i:i + 1])[0, token])
                for i, token in enumerate(tokens))
    return total / len(tokens) ** config.length_penalty


def _assert_beams_or_ties(out: kt.RequestOutput, sequences: list[list[int]], scores: list[float],
                          hf_model, prompt: list[int], config: kt.GenerationConfig) -> None:
    """transformers' beams with its scores, rank by rank. Where a beam differs, the two were a
    tie: transformers itself scores ours within TIE of its own (so a wrong beam cannot pass)."""
    assert len(out.sequences) == len(sequences)
    # The rescoring the tie check relies on gives generate's own score for its best beam.
    assert _hf_score(hf_model, prompt, sequences[0], config) == pytest.approx(scores[0], abs=2e-4)
    ours = [s.score for s in out.sequences]
    assert ours == pytest.approx(scores, abs=2e-4), (ours, scores)
    for rank, (s, reference) in enumerate(zip(out.sequences, sequences)):
        if s.token_ids != reference:
            assert _hf_score(hf_model, prompt, s.token_ids, config) == pytest.approx(
                scores[rank], abs=TIE), (rank, s.token_ids, reference)


def _assert_same(out: kt.RequestOutput, expected, hf_model, prompt: list[int],
                 config: kt.GenerationConfig) -> None:
    _assert_beams_or_ties(out, *expected, hf_model, prompt, config)
    assert out.token_ids == out.sequences[0].token_ids and out.text == out.sequences[0].text
    for s in out.sequences:
        assert s.finish_reason == ("stop" if len(s.token_ids) < MAX_NEW else "length") or (
            s.token_ids[-1] == 2 and s.finish_reason == "stop")


def test_beams_and_scores_match_transformers(default_model, hf_model, prompts, reference):
    # Every case at once: beam groups of different widths share the batch.
    keys = list(reference)
    with kt.Engine(default_model, num_device_blocks=256) as engine:
        outs = engine.generate_outputs([prompts[p] for p, _ in keys],
                                       [_config(*c) for _, c in keys], use_tqdm=False)
        assert engine.stats().num_free_kv_blocks == 256
    for out, (p, case) in zip(outs, keys):
        _assert_same(out, reference[(p, case)], hf_model, prompts[p], _config(*case))
    # Hypotheses that ended with EOS competed with running beams (and won, for the chat prompt).
    assert outs[0].sequences[0].token_ids[-1] in default_model.eos_token_ids
    assert any(len(s.token_ids) == MAX_NEW for o in outs for s in o.sequences)


@pytest.fixture(scope="module")
def peaky_tiny(tmp_path_factory):
    """A tiny random Llama whose logits are far apart (few near-ties) and whose stop tokens 2 and
    7 win often enough that finished hypotheses compete with running beams at every width."""
    folder = tmp_path_factory.mktemp("tiny_beam")
    hf = build_tiny_model("llama2", folder)
    with torch.no_grad():
        hf.lm_head.weight.mul_(40)
        ids = torch.randint(3, 256, (4, 24), generator=torch.Generator().manual_seed(1))
        hidden = hf.model(ids).last_hidden_state.reshape(-1, hf.config.hidden_size)
        best = (hidden @ hf.lm_head.weight.T).max(-1).values
        mean = hidden.mean(0)
        for token, quantile in ((2, 0.7), (7, 0.5)):  # logit ~ that quantile of the best logit
            hf.lm_head.weight[token] = mean / (mean @ mean) * best.quantile(quantile)
    hf.save_pretrained(folder)
    return hf, kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)


def _hf_tiny_beams(hf, ids: list[int], k: int, lp: float, es: bool | str):
    with torch.no_grad(), one_thread():
        out = hf.generate(torch.tensor([ids]), max_new_tokens=10, num_beams=k,
                          num_return_sequences=k, length_penalty=lp, early_stopping=es,
                          do_sample=False, eos_token_id=[2, 7], pad_token_id=0,
                          return_dict_in_generate=True, output_scores=True)
    rows = out.sequences[:, len(ids):].tolist()
    cut = [next((j + 1 for j, t in enumerate(r) if t in (2, 7)), len(r)) for r in rows]
    return [r[:c] for r, c in zip(rows, cut)], out.sequences_scores.tolist()


def test_beam_search_grid_matches_transformers_on_a_tiny_model(peaky_tiny):
    """Every width, length penalty sign and early_stopping mode, two stop tokens."""
    hf, model = peaky_tiny
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (5, 9, 17)]
    cases = list(itertools.product([2, 3, 4], [-0.5, 0.0, 1.0, 2.0], [True, False, "never"]))
    expected = [_hf_tiny_beams(hf, prompts[i % 3], *case) for i, case in enumerate(cases)]
    with kt.Engine(model, num_device_blocks=256) as engine:
        outs = engine.generate_outputs(
            [prompts[i % 3] for i in range(len(cases))],
            [kt.GenerationConfig(max_new_tokens=10, num_beams=k, num_return_sequences=k,
                                 length_penalty=lp, early_stopping=es, stop_token_ids=[7])
             for k, lp, es in cases], use_tqdm=False)
    for case, out, (sequences, scores) in zip(cases, outs, expected):
        assert [s.token_ids for s in out.sequences] == sequences, case
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4), case
    stopped = [s for seqs, _ in expected for s in seqs if s[-1] in (2, 7)]
    assert len(stopped) > 20 and {s[-1] for s in stopped} == {2, 7}


def test_length_penalties_past_the_float_range_fail_nothing(peaky_tiny):
    """`length ** length_penalty` past the float range (3 ** 1000: transformers raises
    OverflowError) or under it (3 ** -1000 = 0) used to fail the step and so kill the engine;
    now such requests finish with their beams and everyone else is served on. (No transformers
    reference exists at these values: it raises, or scores every hypothesis -inf.)"""
    hf, model = peaky_tiny
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (7, 12)]
    plain = kt.GenerationConfig(max_new_tokens=10, stop_token_ids=[7])
    with kt.Engine(model, num_device_blocks=128) as engine:
        before = [out.token_ids for out in engine.generate_outputs(prompts, plain, use_tqdm=False)]
        for penalty in (1000.0, 1e308, -1000.0):
            configs = [kt.GenerationConfig(max_new_tokens=10, num_beams=3, num_return_sequences=3,
                                           length_penalty=penalty, stop_token_ids=[7])] * 2
            outs = engine.generate_outputs(prompts, configs, use_tqdm=False)
            for out in outs:
                assert len(out.sequences) == 3 and all(s.token_ids for s in out.sequences), penalty
                assert not any(math.isnan(s.score) for s in out.sequences), penalty
        after = [out.token_ids for out in engine.generate_outputs(prompts, plain, use_tqdm=False)]
        assert engine.failure is None
    assert after == before


@pytest.mark.parametrize("preempt_mode", [0, 1], ids=["swap", "recompute"])
def test_beams_survive_preemption(peaky_tiny, preempt_mode):
    hf, model = peaky_tiny
    g = torch.Generator().manual_seed(5)
    prompts = [torch.randint(3, 256, (n,), generator=g).tolist() for n in (6, 11, 17, 13)]
    cases = [(4, 1.0, False), (3, 0.5, "never"), (4, 2.0, True), (2, 0.0, False)]
    expected = [_hf_tiny_beams(hf, ids, *case) for ids, case in zip(prompts, cases)]
    # 10 blocks of 4 tokens hold the longest sequence (27 tokens) but not 13 beams: beams are
    # preempted, come back, and wait idle for their siblings' log-probs.
    with kt.Engine(model, num_device_blocks=10, block_token_num=4,
                   preempt_mode=preempt_mode) as engine:
        outs = engine.generate_outputs(
            prompts, [kt.GenerationConfig(max_new_tokens=10, num_beams=k, num_return_sequences=k,
                                          length_penalty=lp, early_stopping=es, stop_token_ids=[7])
                      for k, lp, es in cases], use_tqdm=False)
        stats = engine.stats()
        assert stats.num_preemptions > 0
        assert stats.num_free_kv_blocks == 10 and stats.num_swapped == 0
    for case, out, (sequences, scores) in zip(cases, outs, expected):
        assert [s.token_ids for s in out.sequences] == sequences, case
        assert [s.score for s in out.sequences] == pytest.approx(scores, abs=1e-4), case


def test_beams_catching_up_in_chunks_beside_an_idle_sibling_finish(peaky_tiny):
    """A prompt longer than the step budget, a pool that holds one beam's KV and a bit: a beam
    catching up in chunks ran short of blocks held by an idle sibling, gave up its own, came
    back and ran short again, forever. It now takes the idle sibling's."""
    hf, model = peaky_tiny
    prompt = torch.randint(3, 256, (22,), generator=torch.Generator().manual_seed(0)).tolist()
    config = kt.GenerationConfig(max_new_tokens=10, num_beams=4, num_return_sequences=2,
                                 early_stopping=False, stop_token_ids=[7])
    sequences, scores = _hf_tiny_beams(hf, prompt, 4, 1.0, False)
    with kt.Engine(model, num_device_blocks=9, block_token_num=4, preempt_mode=1,
                   max_step_tokens=4) as engine:
        out = engine.submit(kt.Request(prompt, generation_config=config)).result(timeout=120)
        assert engine.stats().num_preemptions > 0
    assert [s.token_ids for s in out.sequences] == sequences[:2]
    assert [s.score for s in out.sequences] == pytest.approx(scores[:2], abs=1e-4)


def test_beams_fork_blocks_instead_of_copying(default_model):
    ids = default_model.tokenizer.encode(
        "The history of the printing press begins in the fifteenth century, when movable type "
        "changed how books were made across Europe. In short,")
    block = 4
    with kt.Engine(default_model, num_device_blocks=64, block_token_num=block,
                   enable_prefix_caching=False) as engine:
        out = engine.generate_outputs(ids, _config(4, 4, 1.0, False), use_tqdm=False)[0]
        peak = engine.stats().peak_used_kv_blocks
    assert len(out.sequences) == 4
    per_beam = -(-(len(ids) + MAX_NEW) // block)
    prompt_blocks = len(ids) // block
    # Four private copies would need 4 * per_beam blocks; forks share the prompt's full blocks,
    # each beam holding only its own tail (plus, for a moment, a copy-on-write block).
    assert prompt_blocks >= 5
    assert peak <= prompt_blocks + 4 * (per_beam - prompt_blocks + 1) < 4 * per_beam


def test_beam_search_with_penalties_matches_transformers(default_model, hf_model, prompts):
    config = _config(2, 2, 1.0, False, repetition_penalty=1.3, no_repeat_ngram_size=2)
    expected = _hf_beams(hf_model, prompts[1], config, default_model.eos_token_ids)
    with kt.Engine(default_model, num_device_blocks=64) as engine:
        out, plain = engine.generate_outputs([prompts[1]] * 2, [config, _config(2, 2, 1.0, False)],
                                             use_tqdm=False)
    _assert_same(out, expected, hf_model, prompts[1], config)
    # The processors change the beams (plain beams equal transformers' by the test above).
    assert [s.token_ids for s in plain.sequences] != expected[0]


@pytest.mark.parametrize("stop", [[","], [" and", "."]])
def test_beam_search_with_stop_strings_matches_transformers(default_model, hf_model, prompts, stop):
    """A beam ends on a stop string overlapping its last token, as transformers' stop_strings;
    the text ends before the stop string (unless include_stop_str_in_output)."""
    tok = default_model.tokenizer
    ids = prompts[1]
    pad = len(tok) - 1  # a padding id the model never picks here, so it can be stripped
    with torch.no_grad(), one_thread():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                num_beams=4, num_return_sequences=3, stop_strings=stop,
                                tokenizer=tok, pad_token_id=pad, return_dict_in_generate=True,
                                output_scores=True)
    expected = []
    for row in out.sequences[:, len(ids):].tolist():
        while row and row[-1] == pad:
            row.pop()
        expected.append(row)
    config = _config(4, 3, 1.0, False, stop=stop)
    with kt.Engine(default_model, num_device_blocks=64) as engine:
        ours, kept = engine.generate_outputs(
            [ids, ids], [config, config.replace(include_stop_str_in_output=True)], use_tqdm=False)
    _assert_beams_or_ties(ours, expected, out.sequences_scores.tolist(), hf_model, ids, config)
    stopped = [s for s in ours.sequences if s.finish_reason == "stop"]
    assert stopped, "no beam ended on a stop string: the test would not bite"
    for s, with_stop in zip(ours.sequences, kept.sequences):
        assert s.token_ids == with_stop.token_ids
        if s.finish_reason == "stop":
            assert s.stop_reason in stop and with_stop.text == s.text + s.stop_reason
            assert tok.decode(s.token_ids).startswith(s.text + s.stop_reason)
        else:
            assert len(s.token_ids) == MAX_NEW and s.text == with_stop.text


def test_beam_logprobs_and_abort(default_model, prompts):
    with kt.Engine(default_model, num_device_blocks=64) as engine:
        out = engine.generate_outputs(prompts[0], _config(2, 2, 1.0, False, logprobs=2),
                                      use_tqdm=False)[0]
        for s in out.sequences:
            assert len(s.logprobs) == len(s.token_ids)
            assert [e["token_id"] for e in s.logprobs] == s.token_ids
            assert all(len(e["top_logprobs"]) == 2 for e in s.logprobs)
            # Without processors the beam's summed log-prob is that of its raw token log-probs.
            assert s.cumulative_logprob == pytest.approx(sum(e["logprob"] for e in s.logprobs),
                                                         abs=1e-4)
            assert s.score == pytest.approx(s.cumulative_logprob / len(s.token_ids), abs=1e-5)
        config = _config(4, 2, 1.0, False, ignore_eos=True).replace(max_new_tokens=400)
        handle = engine.submit(kt.Request(prompts[1], config))
        end = time.monotonic() + 30
        while engine.stats().num_running < 4 and time.monotonic() < end:
            time.sleep(0.01)  # the beams have forked
        assert engine.stats().num_running == 4
        engine.abort(handle.id)
        aborted = handle.result(timeout=60)
        assert aborted.finish_reason == "abort" and aborted.finished
        assert stats_once_blocks_free(engine).num_free_kv_blocks == 64


@pytest.mark.parametrize("changes, field", [
    ({"do_sample": True}, "do_sample"),
    ({"top_k": 5}, "top_k"),
    ({"top_p": 0.9}, "top_p"),
    ({"min_p": 0.1}, "min_p"),
    ({"num_return_sequences": 3}, "num_return_sequences"),
    ({"best_of": 2}, "best_of"),
    ({"structured_output": {"kind": "json_object"}}, "structured_output"),
    ({"num_beams": 1, "length_penalty": 2.0}, "length_penalty"),
    ({"num_beams": 1, "early_stopping": True}, "early_stopping"),
    ({"num_beams": 1000}, "num_beams"),
])
def test_invalid_beam_combinations_name_the_field(local_engine, changes, field):
    config = {"num_beams": 2, "num_return_sequences": 2, **changes}
    with pytest.raises(ValueError, match=field):
        local_engine.submit(kt.Request("Hi", config))
    assert local_engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))
