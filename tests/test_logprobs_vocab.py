"""vLLM's whole-vocabulary log-probs and its cap: `logprobs=-1` / `prompt_logprobs=-1` return
every token's log-prob (checked against transformers' log_softmax on the same weights) when the
engine's `max_logprobs` is -1, and `max_logprobs` (EngineConfig, serve's `--max-logprobs`)
bounds what a request may ask for, in Python and over HTTP (chat `top_logprobs=-1`); answers with
many alternatives are formatted once and off the event loop (/generate's cumulative chunks too)."""

from __future__ import annotations

import json

import httpx
import pytest
import torch

import ksana_llm as kt
from ksana_llm.server.app import build_app
from tests.family_harness import one_thread
from tests.server_decoding.harness import run_r1

PROMPT = "The quick brown fox"


def _hf_log_softmax(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' log-probs [len(ids), V] after each position."""
    with torch.no_grad(), one_thread():
        return torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), dim=-1)


def _check_whole_rows(entries, expected_rows: torch.Tensor) -> None:
    """Each entry lists every token of the vocabulary, with transformers' log-prob."""
    assert len(entries) == len(expected_rows)
    for entry, row in zip(entries, expected_rows):
        top = entry["top_logprobs"]
        assert sorted(top) == list(range(row.shape[0]))
        got = torch.tensor([top[t] for t in range(row.shape[0])])
        torch.testing.assert_close(got, row, atol=2e-3, rtol=0)


@pytest.fixture(scope="module")
def uncapped(default_model):
    with kt.Engine(default_model, num_device_blocks=64, max_logprobs=-1) as engine:
        yield engine


def test_whole_vocabulary_for_outputs_and_prompt(default_model, hf_default_model, uncapped):
    ids = default_model.tokenizer.encode(PROMPT)
    config = kt.GenerationConfig(max_new_tokens=3, logprobs=-1, prompt_logprobs=-1)
    out = uncapped.generate_outputs(ids, config, use_tqdm=False)[0]
    expected = _hf_log_softmax(hf_default_model, ids + out.token_ids)
    _check_whole_rows(out.logprobs, expected[len(ids) - 1:-1])
    _check_whole_rows(out.prompt_logprobs[1:], expected[:len(ids) - 1])
    assert out.prompt_logprobs[0] is None
    # Greedy: the chosen token is the most likely one of each whole row.
    assert out.token_ids == expected[len(ids) - 1:-1].argmax(dim=-1).tolist()


def test_whole_vocabulary_under_speculative_drafts(default_model, hf_default_model):
    """n-gram drafts verified several positions a step: each position's row is still the
    model's whole distribution there."""
    prompt = "one two three four one two three four one two three"
    ids = default_model.tokenizer.encode(prompt)
    with kt.Engine(default_model, num_device_blocks=64, max_logprobs=-1,
                   speculative_method="ngram", num_speculative_tokens=3) as engine:
        out = engine.generate_outputs(ids, kt.GenerationConfig(max_new_tokens=8, logprobs=-1),
                                      use_tqdm=False)[0]
    expected = _hf_log_softmax(hf_default_model, ids + out.token_ids)
    _check_whole_rows(out.logprobs, expected[len(ids) - 1:-1])


@pytest.mark.parametrize("speculative", [False, True])
def test_each_request_of_a_mixed_batch_gets_its_own_count(default_model, speculative):
    """One step's columns are as many as its largest ask (the whole vocabulary here): a request
    beside it that asked for 2 or 3 gets its own count, with the same log-probs, ranks and
    alternatives as when it runs alone."""
    vocab = default_model.vocab_size
    prompts = ["one two three four one two three four one two", PROMPT]
    configs = [kt.GenerationConfig(max_new_tokens=6, logprobs=-1, prompt_logprobs=-1),
               kt.GenerationConfig(max_new_tokens=6, logprobs=3, prompt_logprobs=2)]
    extra = {"speculative_method": "ngram", "num_speculative_tokens": 3} if speculative else {}
    with kt.Engine(default_model, num_device_blocks=64, max_logprobs=-1, **extra) as engine:
        wide, narrow = engine.generate_outputs(prompts, configs, use_tqdm=False)
        alone = engine.generate_outputs(prompts[1], configs[1], use_tqdm=False)[0]
    assert all(len(e["top_logprobs"]) == vocab for e in wide.logprobs + wide.prompt_logprobs[1:])
    assert all(len(e["top_logprobs"]) == 3 for e in narrow.logprobs)
    assert all(len(e["top_logprobs"]) == 2 for e in narrow.prompt_logprobs[1:])
    assert narrow.token_ids == alone.token_ids
    for got, ref in zip(narrow.logprobs + narrow.prompt_logprobs[1:],
                        alone.logprobs + alone.prompt_logprobs[1:], strict=True):
        assert got["rank"] == ref["rank"] and list(got["top_logprobs"]) == list(ref["top_logprobs"])
        assert got["logprob"] == pytest.approx(ref["logprob"], abs=1e-4)
        assert list(got["top_logprobs"].values()) == pytest.approx(
            list(ref["top_logprobs"].values()), abs=1e-4)


def test_beam_search_with_whole_vocabulary(default_model, uncapped):
    config = kt.GenerationConfig(max_new_tokens=2, num_beams=2, logprobs=-1)
    out = uncapped.generate_outputs(PROMPT, config, use_tqdm=False)[0]
    vocab = default_model.vocab_size
    assert all(len(entry["top_logprobs"]) == vocab for entry in out.logprobs)


def test_the_cap_and_bad_counts(default_model, uncapped):
    vocab = default_model.vocab_size
    with pytest.raises(ValueError, match=rf"logprobs must be at most the vocabulary size \({vocab}\)"):
        uncapped.generate(PROMPT, kt.GenerationConfig(max_new_tokens=1, logprobs=vocab + 1))
    with pytest.raises(ValueError, match="logprobs"):
        kt.GenerationConfig(logprobs=-2).validate()
    with pytest.raises(ValueError, match="prompt_logprobs"):
        kt.GenerationConfig(prompt_logprobs=-5).validate()
    with kt.Engine(default_model, num_device_blocks=32) as capped:  # vLLM's default cap, 20
        for config, field in (({"logprobs": -1}, "logprobs"), ({"logprobs": 21}, "logprobs"),
                              ({"prompt_logprobs": -1}, "prompt_logprobs")):
            with pytest.raises(ValueError, match=rf"{field}: .*max_logprobs \(20\)"):
                capped.generate(PROMPT, kt.GenerationConfig(max_new_tokens=1, **config))
        # The engine keeps serving, and 20 is allowed.
        out = capped.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=1, logprobs=20),
                                      use_tqdm=False)[0]
        assert len(out.logprobs[0]["top_logprobs"]) == 20
    with kt.Engine(default_model, num_device_blocks=32, max_logprobs=50) as wider:
        out = wider.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=1, logprobs=30),
                                     use_tqdm=False)[0]
        assert len(out.logprobs[0]["top_logprobs"]) == 30
    with pytest.raises(ValueError, match="max_logprobs"):
        kt.EngineConfig(model="x", max_logprobs=-2)


def test_chat_top_logprobs_minus_one_over_http(uncapped):
    """A server whose engine allows the vocabulary: chat `top_logprobs: -1` lists every token,
    `prompt_logprobs: -1` every token after each prompt position; -2 is a 400."""
    app = build_app(uncapped, served_model_name="m")
    vocab = uncapped.model.vocab_size

    async def check(_aclient, http: httpx.AsyncClient):
        r = await http.post("/chat/completions", json={
            "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "logprobs": True, "top_logprobs": -1, "prompt_logprobs": -1})
        assert r.status_code == 200, r.text
        body = r.json()
        content = body["choices"][0]["logprobs"]["content"]
        assert len(content) == 2 and all(len(c["top_logprobs"]) == vocab for c in content)
        assert all(entry is None or len(entry) >= vocab for entry in body["prompt_logprobs"])
        for bad in ({"top_logprobs": -2, "logprobs": True}, {"prompt_logprobs": -2},
                    {"top_logprobs": -1}):  # -1 needs logprobs: true, as any count
            r = await http.post("/chat/completions", json={
                "model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1,
                **bad})
            assert r.status_code == 400 and r.json()["error"]["param"] == next(iter(bad)), r.text
        # Completions' logprobs takes no -1 (vLLM's rule).
        r = await http.post("/completions", json={"model": "m", "prompt": "x", "logprobs": -1})
        assert r.status_code == 400 and r.json()["error"]["param"] == "logprobs"

    run_r1(app, check)


def test_vocabulary_wide_answers_are_built_off_the_event_loop(uncapped, monkeypatch):
    """Formatting 49,152 alternatives per token takes long enough to stall every other client
    if done on the event loop: such answers (streamed or not) are formatted in a worker
    thread, while small ones stay on the loop."""
    import threading

    from ksana_llm.server import openai_routes

    threads: list[tuple[str, bool]] = []
    for name in ("chat_logprobs", "completion_logprobs"):
        real = getattr(openai_routes, name)

        def watched(*args, _real=real, _name=name, **kwargs):
            threads.append((_name, threading.current_thread() is threading.main_thread()))
            return _real(*args, **kwargs)

        monkeypatch.setattr(openai_routes, name, watched)
    app = build_app(uncapped, served_model_name="m")
    chat = {"model": "m", "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2,
            "logprobs": True}

    async def check(_aclient, http: httpx.AsyncClient):
        for body in ({**chat, "top_logprobs": -1}, {**chat, "top_logprobs": -1, "stream": True},
                     {"model": "m", "prompt": "Hi", "max_tokens": 2, "logprobs": 200},
                     {**chat, "top_logprobs": 2}):
            r = await http.post("/chat/completions" if "messages" in body else "/completions",
                                json=body)
            assert r.status_code == 200, r.text

    run_r1(app, check)  # (the event loop runs on the main thread)
    heavy = [on_loop for _, on_loop in threads[:-1]]
    assert heavy and not any(heavy)  # every heavy formatting off the loop
    assert threads[-1] == ("chat_logprobs", True)  # top_logprobs 2: on the loop


def test_native_generate_with_many_alternatives_is_formatted_off_the_event_loop(uncapped,
                                                                                 monkeypatch):
    """KsanaLLM's /generate too: its chunks with 200 alternatives a step are made in a worker
    thread, each step formatted once however many cumulative chunks repeat it; its answers
    equal the Python API's log-probs, streamed or not."""
    import threading

    from ksana_llm.server import native

    calls: list[tuple[int, bool]] = []
    real = native._logprob_steps

    def watched(entries, n):
        calls.append((len(entries), threading.current_thread() is threading.main_thread()))
        return real(entries, n)

    monkeypatch.setattr(native, "_logprob_steps", watched)
    app = build_app(uncapped, served_model_name="m")
    sampling = {"max_new_tokens": 4, "ignore_eos": True}
    expected = uncapped.generate_outputs(
        [PROMPT], kt.GenerationConfig(max_new_tokens=4, ignore_eos=True, logprobs=200),
        use_tqdm=False)[0]

    async def check(_aclient, http: httpx.AsyncClient):
        answers = {}
        for stream in (False, True):
            calls.clear()
            r = await http.post("http://r1/generate", json={
                "prompt": PROMPT, "stream": stream,
                "sampling_config": {**sampling, "logprobs": 200}})
            assert r.status_code == 200, r.text
            answers[stream] = json.loads(r.content.rstrip(b"\0").split(b"\0")[-1])
            assert calls and not any(on_loop for _, on_loop in calls)
            assert sum(n for n, _ in calls) == 4  # each of the 4 steps formatted once
        assert answers[True] == answers[False]
        (steps,) = answers[False]["logprobs"]
        for entry, step in zip(expected.logprobs, steps, strict=True):
            assert len(step) == 200
            assert step == [[t, pytest.approx(lp)] for t, lp in sorted(
                entry["top_logprobs"].items(), key=lambda kv: kv[1], reverse=True)]
        calls.clear()
        r = await http.post("http://r1/generate", json={
            "prompt": PROMPT, "stream": False, "sampling_config": {**sampling, "logprobs": 2}})
        assert r.status_code == 200 and calls and all(on_loop for _, on_loop in calls)

    run_r1(app, check)


def test_logprob_steps_are_formatted_once_unless_an_output_is_replaced():
    """The stream's cache of formatted steps: appended entries are formatted once; an output
    whose entries were replaced (a beam's) is formatted again, not spliced onto stale steps."""
    from ksana_llm.server.generation import ChoiceResult
    from ksana_llm.server.native import LogprobSteps

    def entry(token: int) -> dict:
        return {"token_id": token, "logprob": -1.0, "top_logprobs": {token: -1.0, 99: -2.0}}

    def result(entries: list[dict]) -> ChoiceResult:
        return ChoiceResult("", [e["token_id"] for e in entries], entries, None)

    steps = LogprobSteps(1)
    first = [entry(1), entry(2)]
    assert steps.of([result(first)]) == [[[[1, -1.0]], [[2, -1.0]]]]
    assert steps.of([result(first + [entry(3)])]) == [[[[1, -1.0]], [[2, -1.0]], [[3, -1.0]]]]
    assert steps.of([result([entry(7), entry(8)])]) == [[[[7, -1.0]], [[8, -1.0]]]]
    assert steps.of([result([entry(7)]), result([entry(5)])]) == [[[[7, -1.0]]], [[[5, -1.0]]]]
    assert LogprobSteps(0).of([result(first)]) == [[]]
