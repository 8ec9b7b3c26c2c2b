"""Engine-wide logits processors (`Engine(logits_processors=[...])`, vLLM's
`--logits-processors`) set per request with `GenerationConfig.extra_args`: against
`transformers.generate` with the equivalent processor (greedy, beam search, with and without
async scheduling), only the rows they apply to reach them (greedy rows skip argmax-invariant
ones, beams do not), the per-request adapter, refusals, a failing processor (or one row's
callable) fails only its requests, structured output wins over them, and speculative decoding
leaves them exact."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor as HFLogitsProcessor
from transformers import LogitsProcessorList

import ksana_llm as kt
from ksana_llm.logits_processor import LogitsProcessorError
from tests.engine_logits_processors import (BanTokens, Boost, Exploding, ForgetfulRelease, Fussy,
                                            NoRepeats, TopOne)
from tests.family_harness import one_thread

PROMPTS = ["The quick brown fox", "My favourite food is"]
MAX_NEW = 8


def _hf_tokens(hf_model, ids: list[int], **kwargs) -> list[int]:
    with torch.no_grad(), one_thread():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


class HFNoRepeats(HFLogitsProcessor):
    """tests.engine_logits_processors.no_repeats as transformers' batch processor."""

    def __init__(self, prompt_len: int) -> None:
        self.prompt_len = prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        for row, ids in zip(scores, input_ids.tolist()):
            row[ids[self.prompt_len:]] = float("-inf")
        return scores


def _processor(engine: kt.Engine, cls: type) -> kt.LogitsProcessor:
    return next(p for p in engine._core.sampler.logits_processors if isinstance(p, cls))


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_greedy_tokens_match_transformers(default_model, hf_default_model, async_scheduling):
    """A batch mixing requests with and without the processors: those with them answer as
    transformers with the same processor, the others as without; the processors see only their
    rows, with every token known (none pending), and release each when it ends."""
    tok = default_model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    plain_config = kt.GenerationConfig(max_new_tokens=MAX_NEW)
    with kt.Engine(default_model, num_device_blocks=128, async_scheduling=async_scheduling,
                   logits_processors=[BanTokens, NoRepeats]) as engine:
        plain = [o.token_ids for o in engine.generate_outputs(prompts, plain_config,
                                                              use_tqdm=False)]
        # Ban what greedy picks first: the answer must change.
        bans = [out[:2] for out in plain]
        jobs = [(ids, plain_config.replace(extra_args={"ban": ban}))
                for ids, ban in zip(prompts, bans)]
        jobs += [(ids, plain_config.replace(extra_args={"no_repeats": True})) for ids in prompts]
        jobs += [(ids, plain_config) for ids in prompts]
        outs = engine.generate_outputs([ids for ids, _ in jobs], [c for _, c in jobs],
                                       use_tqdm=False)
        assert (engine._core.num_steps_ahead > 0) == async_scheduling
        ban_processor, adapter = _processor(engine, BanTokens), _processor(engine, NoRepeats)
    tokens = [o.token_ids for o in outs]
    for k, (ids, ban) in enumerate(zip(prompts, bans)):
        assert tokens[k] == _hf_tokens(hf_default_model, ids, suppress_tokens=ban)
        assert tokens[k] != plain[k]
        assert tokens[2 + k] == _hf_tokens(
            hf_default_model, ids, logits_processor=LogitsProcessorList([HFNoRepeats(len(ids))]))
    assert any(tokens[2 + k] != plain[k] for k in range(2))  # no_repeats bites somewhere
    assert tokens[4:] == plain
    # Only the banning requests reached BanTokens, once per token, with the tokens so far.
    ban_ids = {o.request_id: k for k, o in enumerate(outs[:2])}
    assert sorted(ban_ids) == sorted({rid for rid, _, _ in ban_processor.seen})
    for rid, index, so_far in ban_processor.seen:
        assert index == 0 and so_far == tokens[ban_ids[rid]][:len(so_far)]
    assert len(ban_processor.seen) == len(tokens[0]) + len(tokens[1])
    assert sorted(ban_processor.released) == sorted((rid, 0) for rid in ban_ids)
    assert adapter.made == 2 and adapter._callables == {}  # one callable per request, released


def test_a_batch_of_processed_rows_only(default_model, hf_default_model):
    """Every row carries the processor: it gets the whole batch, as a tensor it may view."""
    tok = default_model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    config = kt.GenerationConfig(max_new_tokens=MAX_NEW)
    with kt.Engine(default_model, num_device_blocks=128, logits_processors=[BanTokens]) as engine:
        bans = [o.token_ids[:1] for o in engine.generate_outputs(prompts, config, use_tqdm=False)]
        outs = engine.generate_outputs(prompts, [config.replace(extra_args={"ban": b})
                                                 for b in bans], use_tqdm=False)
        assert engine.stats().num_running == 0
    for out, ids, ban in zip(outs, prompts, bans):
        assert out.token_ids == _hf_tokens(hf_default_model, ids, suppress_tokens=ban)


def test_argmax_invariant_processors_skip_greedy_rows(default_model, hf_default_model):
    """TopOne keeps only the best token: sampled requests with it answer greedily (as
    transformers' greedy search), greedy requests with it never reach it, and beam search
    (which ranks more than the best token) does."""
    tok = default_model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    sampled = kt.GenerationConfig(max_new_tokens=MAX_NEW, do_sample=True, temperature=1.5,
                                  seed=7, extra_args={"top_one": True})
    greedy = kt.GenerationConfig(max_new_tokens=MAX_NEW, extra_args={"top_one": True})
    with kt.Engine(default_model, num_device_blocks=128, logits_processors=[TopOne]) as engine:
        outs = engine.generate_outputs(prompts + prompts, [sampled, sampled, greedy, greedy],
                                       use_tqdm=False)
        unprocessed = engine.generate_outputs(prompts, sampled.replace(extra_args={}),
                                              use_tqdm=False)
        top_one = _processor(engine, TopOne)
        seen_before_beams = {rid for rid, _, _ in top_one.seen}
        beams = engine.generate_outputs(prompts[0], greedy.replace(num_beams=2),
                                        use_tqdm=False)[0]
    for out, ids in zip(outs, prompts + prompts):
        assert out.token_ids == _hf_tokens(hf_default_model, ids)
    assert [o.token_ids for o in unprocessed] != [o.token_ids for o in outs[:2]]
    assert seen_before_beams == {o.request_id for o in outs[:2]}
    assert {rid for rid, _, _ in top_one.seen} - seen_before_beams == {beams.request_id}


def test_beam_search_matches_transformers(default_model, hf_default_model):
    """Beam search runs them on log_softmax(logits), as transformers runs its processors."""
    ids = default_model.tokenizer.encode(PROMPTS[1])
    with kt.Engine(default_model, num_device_blocks=128, logits_processors=[BanTokens]) as engine:
        first = engine.generate_outputs(ids, kt.GenerationConfig(max_new_tokens=MAX_NEW),
                                        use_tqdm=False)[0].token_ids[:1]
        config = kt.GenerationConfig(max_new_tokens=MAX_NEW, num_beams=3, num_return_sequences=2,
                                     extra_args={"ban": first})
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
        seen_indexes = {index for _, index, _ in _processor(engine, BanTokens).seen}
    with torch.no_grad(), one_thread():
        expected = hf_default_model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_NEW, num_beams=3, num_return_sequences=2,
            do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
            suppress_tokens=first)
    eos = default_model.eos_token_ids
    sequences = []
    for row in expected.sequences[:, len(ids):].tolist():
        sequences.append(row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])
    assert [s.token_ids for s in out.sequences] == sequences
    assert all(s.token_ids[0] not in first for s in out.sequences)
    assert [s.score for s in out.sequences] == pytest.approx(expected.sequences_scores.tolist(),
                                                             abs=2e-4)
    assert len(seen_indexes) > 1  # every beam reached it, each under its own index


def test_refusals_name_what_is_wrong(default_model):
    with kt.Engine(default_model, num_device_blocks=32,
                   logits_processors=["tests.engine_logits_processors:BanTokens",
                                      "tests.engine_logits_processors.BadCheck"]) as engine:
        for ban in ("7", [1, -2], [True]):
            with pytest.raises(ValueError, match="extra_args.ban must be a list of token ids"):
                engine.submit(kt.Request("Hi", kt.GenerationConfig(extra_args={"ban": ban,
                                                                               "missing": 1})))
        with pytest.raises(ValueError, match="logits processor BadCheck could not check the "
                                             "request: KeyError"):
            engine.submit(kt.Request("Hi", kt.GenerationConfig(max_new_tokens=2)))
        assert engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2,
                                                         extra_args={"missing": 1}))
    with pytest.raises(ValueError, match="extra_args"):
        kt.GenerationConfig(extra_args={1: "a"})
    with pytest.raises(ValueError, match="extra_args"):
        kt.GenerationConfig(extra_args=["ban"])
    for spec, message in (("no_such_module:Nope", "cannot import 'no_such_module'"),
                          ("tests.engine_logits_processors:Nope", "has no 'Nope'"),
                          ("tests.engine_logits_processors:no_repeats", "not a ksana_llm"),
                          (kt.PerRequestLogitsProcessor, "abstract: it must implement "
                                                         "new_request_processor"),
                          (int, "not a ksana_llm.LogitsProcessor")):
        with pytest.raises(ValueError, match=r"logits_processors\[0\]: .*" + message):
            kt.EngineConfig(logits_processors=[spec])
    with pytest.raises(ValueError, match=r"logits_processors\[1\]: Unbuildable\(context\) "
                                         "failed: RuntimeError: no GPU here"):
        kt.Engine(default_model, num_device_blocks=32,
                  logits_processors=[BanTokens, "tests.engine_logits_processors:Unbuildable"])
    with pytest.raises(ValueError, match=r"logits_processors\[0\]: Undecided.is_argmax_invariant"
                                         r"\(\) failed: NotImplementedError: ask me later"):
        kt.Engine(default_model, num_device_blocks=32,
                  logits_processors=["tests.engine_logits_processors:Undecided"])


@pytest.mark.parametrize("settings", [{}, {"async_scheduling": True}],
                         ids=["plain", "async-scheduling"])
def test_a_failing_processor_fails_only_its_requests(default_model, settings):
    with kt.Engine(default_model, num_device_blocks=128, logits_processors=[Exploding],
                   **settings) as engine:
        config = kt.GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
        reference = engine.generate_outputs(PROMPTS[1], config, use_tqdm=False)[0].token_ids
        failing = engine.submit(kt.Request(PROMPTS[0], config.replace(
            extra_args={"explode_at": 2})))
        other = engine.submit(kt.Request(PROMPTS[1], config))
        with pytest.raises(kt.RequestError, match="logits processor Exploding failed: "
                                                  "RuntimeError: out of ideas") as caught:
            failing.result(timeout=120)
        assert isinstance(caught.value.__cause__, LogitsProcessorError)
        assert other.result(timeout=120).token_ids == reference
        # Parallel samples fail together: the stream ends with the error, no sample having
        # been told it finished ("abort") first.
        samples = engine.submit(kt.Request(PROMPTS[0], config.replace(
            num_return_sequences=3, do_sample=True, extra_args={"explode_at": 2})))
        finishes = []
        with pytest.raises(kt.RequestError, match="out of ideas"):
            finishes.extend(d.finish_reason for d in samples.deltas() if d.finish_reason)
        assert finishes == []
        assert engine.stats().num_free_kv_blocks == 128
        assert engine.is_running and engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))


def test_one_rows_callable_fails_only_its_request(default_model):
    """The per-request adapter runs every row's callable: one that raises, or returns a tensor
    of the wrong shape, fails its own request; the others in the same call go on."""
    config = kt.GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True)
    with kt.Engine(default_model, num_device_blocks=128, logits_processors=[Fussy]) as engine:
        reference = engine.generate_outputs(PROMPTS[1], config, use_tqdm=False)[0].token_ids
        raising = engine.submit(kt.Request(PROMPTS[0], config.replace(extra_args={"fail_at": 2})))
        short = engine.submit(kt.Request(PROMPTS[0], config.replace(extra_args={"short_at": 3})))
        fine = engine.submit(kt.Request(PROMPTS[1], config))
        with pytest.raises(kt.RequestError, match="logits processor Fussy failed: KeyError: "
                                                  "'lost track'"):
            raising.result(timeout=120)
        with pytest.raises(kt.RequestError, match=r"logits processor Fussy failed: ValueError: "
                                                  r"the request's processor must return a dense "
                                                  r"floating-point tensor of shape \(\d+,\)"):
            short.result(timeout=120)
        assert fine.result(timeout=120).token_ids == reference
        assert _processor(engine, Fussy)._callables == {}
        assert engine.stats().num_free_kv_blocks == 128


def test_structured_output_wins_over_them(default_model):
    """A processor (the engine's, or the request's own) that raises a token the grammar refuses
    cannot make the answer leave the grammar; without a grammar, the boost wins."""
    boosted = default_model.tokenizer.encode("maybe")[0]

    def boost(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
        logits[boosted] = 1e4
        return logits

    yes_or_no = kt.GenerationConfig(max_new_tokens=4, structured_output={"kind": "regex",
                                                                         "value": "(yes|no)"})
    configs = [yes_or_no.replace(extra_args={"boost": boosted}),
               yes_or_no.replace(logits_processors=[boost]),
               kt.GenerationConfig(max_new_tokens=1, extra_args={"boost": boosted})]
    with kt.Engine(default_model, num_device_blocks=64, logits_processors=[Boost]) as engine:
        outs = engine.generate_outputs([PROMPTS[0]] * 3, configs, use_tqdm=False)
    assert [o.text for o in outs[:2]] == [outs[0].text] * 2 and outs[0].text in ("yes", "no")
    assert outs[2].token_ids == [boosted]


def test_a_failing_release_is_only_logged(default_model, caplog):
    config = kt.GenerationConfig(max_new_tokens=3)
    with kt.Engine(default_model, num_device_blocks=64,
                   logits_processors=[ForgetfulRelease]) as engine:
        first = engine.generate_outputs(PROMPTS, config, use_tqdm=False)
        again = engine.generate_outputs(PROMPTS, config, use_tqdm=False)
        assert engine.is_running
    assert [o.token_ids for o in again] == [o.token_ids for o in first]
    assert "logits processor ForgetfulRelease failed to release request" in caplog.text


def test_speculative_decoding_leaves_them_exact(default_model):
    """A request a processor applies to is not drafted for; the others are."""
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Copy the list: apples, bananas, cherries, dates, "
                                     "elderberries, figs, grapes."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    configs = [kt.GenerationConfig(max_new_tokens=24, extra_args={"no_repeats": True}),
               kt.GenerationConfig(max_new_tokens=24)]
    with kt.Engine(default_model, num_device_blocks=128, logits_processors=[NoRepeats]) as engine:
        expected = engine.generate_outputs([prompt, prompt], configs, use_tqdm=False)
    with kt.Engine(default_model, num_device_blocks=128, speculative_method="ngram",
                   num_speculative_tokens=3, logits_processors=[NoRepeats]) as engine:
        outs = engine.generate_outputs([prompt, prompt], configs, use_tqdm=False)
        assert engine.stats().num_accepted_draft_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert outs[0].token_ids != outs[1].token_ids
