"""The vLLM / KsanaLLM decoding parameters on a real `ksana-llm serve` process with SmolLM2 (n,
best_of, beam search, logit_bias, prompt logprobs, echo + logprobs, no_repeat_ngram_size) against
the Python API; vLLM's bad_words / allowed_token_ids / truncate_prompt_tokens against
transformers; and the 400s of invalid combinations and of what the server was not started with
(the servers: conftest.py here)."""

from __future__ import annotations

import time

import httpx
import openai
import pytest

import ksana_llm as kt
from tests.server_decoding.harness import (PROMPT, QUESTION, TEMPLATE, TIME_TOOL, TOOLS,
                                           run_r1)
from tests.server_process import openai_error
from tests.tolerances import LOGIT_ATOL


# ---- decoding parameters against the Python API ------------------------------------------------------

def _local(local_engine, prompt, **config):
    return local_engine.generate_outputs(prompt, kt.GenerationConfig(**config), use_tqdm=False)[0]


def test_beam_search_matches_python_api(server, client, model, local_engine):
    expected = _local(local_engine, PROMPT, max_new_tokens=8, num_beams=3, num_return_sequences=2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=0,
                                    extra_body={"use_beam_search": True, "num_beams": 3})
    assert [c.text for c in out.choices] == [s.text for s in expected.sequences]
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "stream": False,
        "sampling_config": {"max_new_tokens": 8, "num_beams": 3, "num_return_sequences": 2}})
    assert r.json()["texts"] == [s.text for s in expected.sequences]
    # do_sample false: topk and temperature are unused (HF's rule), so the same beams.
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "stream": False,
        "sampling_config": {"max_new_tokens": 8, "num_beams": 3, "num_return_sequences": 2,
                            "do_sample": False, "topk": 50, "temperature": 0.7}})
    assert r.json()["texts"] == [s.text for s in expected.sequences]
    # Streamed, the beams arrive whole at the end, same texts.
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=8, n=2, temperature=0,
                                           stream=True, extra_body={"use_beam_search": True, "num_beams": 3}):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [s.text for s in expected.sequences]
    # With stop strings: the beams that end on one say so.
    expected = _local(local_engine, "The three primary colors are", max_new_tokens=12,
                      num_beams=4, num_return_sequences=3, stop=[","])
    assert any(s.stop_reason == "," for s in expected.sequences)
    out = client.completions.create(model=model, prompt="The three primary colors are",
                                    max_tokens=12, n=3, temperature=0, stop=[","],
                                    extra_body={"use_beam_search": True, "num_beams": 4})
    assert [(c.text, c.finish_reason) for c in out.choices] == [
        (s.text, s.finish_reason) for s in expected.sequences]


def test_sampling_params_match_python_api(server, client, model, local_engine):
    tok = local_engine.tokenizer
    # n, seed: one engine request; streamed or not, the same choices as the Python API's.
    expected = _local(local_engine, PROMPT, max_new_tokens=6, do_sample=True, num_return_sequences=3,
                      seed=11, ignore_eos=True)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, seed=11,
                                    extra_body={"ignore_eos": True})
    assert [c.text for c in out.choices] == [s.text for s in expected.sequences]
    streamed = {i: "" for i in range(3)}
    for chunk in client.completions.create(model=model, prompt=PROMPT, max_tokens=6, n=3, seed=11,
                                           stream=True, extra_body={"ignore_eos": True}):
        for c in chunk.choices:
            streamed[c.index] += c.text
    assert list(streamed.values()) == [s.text for s in expected.sequences]
    # best_of
    expected = _local(local_engine, PROMPT, max_new_tokens=6, do_sample=True, best_of=3, seed=5)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=6, best_of=3, seed=5)
    assert out.choices[0].text == expected.text
    # logit_bias, presence/frequency penalties, no_repeat_ngram_size, min_tokens, stop strings
    bias_id = tok.encode(" dog")[0]
    expected = _local(local_engine, PROMPT, max_new_tokens=10, logit_bias={bias_id: 8.0},
                      presence_penalty=0.5, frequency_penalty=0.3, no_repeat_ngram_size=2,
                      min_new_tokens=3)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=10, temperature=0,
                                    logit_bias={str(bias_id): 8.0}, presence_penalty=0.5,
                                    frequency_penalty=0.3,
                                    extra_body={"no_repeat_ngram_size": 2, "min_tokens": 3})
    assert out.choices[0].text == expected.text and " dog" in out.choices[0].text
    r = httpx.post(server.url + "/generate", timeout=60, json={
        "prompt": PROMPT, "stream": False, "sampling_config": {"max_new_tokens": 10, "no_repeat_ngram_size": 2}})
    assert r.json()["output_token_ids"] == [_local(local_engine, PROMPT, max_new_tokens=10,
                                                   no_repeat_ngram_size=2).token_ids]


def test_prompt_logprobs_and_echo(server, client, model, local_engine):
    ids = local_engine.tokenizer.encode(PROMPT)
    expected = _local(local_engine, PROMPT, max_new_tokens=3, prompt_logprobs=2, logprobs=2)
    out = client.completions.create(model=model, prompt=PROMPT, max_tokens=3, temperature=0,
                                    echo=True, logprobs=2)
    lp = out.choices[0].logprobs
    assert out.choices[0].text == PROMPT + expected.text
    assert len(lp.tokens) == len(ids) + 3 and lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert lp.token_logprobs[1:len(ids)] == pytest.approx([e["logprob"] for e in expected.prompt_logprobs[1:]],
                                                    abs=LOGIT_ATOL)
    assert lp.token_logprobs[len(ids):] == pytest.approx([e["logprob"] for e in expected.logprobs],
                                                           abs=LOGIT_ATOL)
    assert "".join(lp.tokens) == out.choices[0].text
    # Each echoed prompt token is among its own alternatives, next to the top 2.
    for token, value, top, ref in zip(lp.tokens[1:len(ids)], lp.token_logprobs[1:],
                                      lp.top_logprobs[1:], expected.prompt_logprobs[1:]):
        assert top[token] == value and len(top) == (2 if ref["rank"] <= 2 else 3)
    # echo with max_tokens 0 scores the prompt: its text and logprobs, nothing generated
    # (OpenAI's legacy rule, how lm-eval style clients score), streamed or not.
    scored = client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True,
                                       logprobs=2, temperature=0)
    assert scored.choices[0].text == PROMPT and scored.choices[0].finish_reason == "length"
    assert scored.usage.completion_tokens == 0
    assert scored.choices[0].logprobs.model_dump() == {
        name: getattr(lp, name)[:len(ids)] for name in ("tokens", "token_logprobs",
                                                        "top_logprobs", "text_offset")}
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=0, echo=True,
                                            logprobs=2, stream=True, temperature=0,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == PROMPT
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].usage.completion_tokens == 0
    with pytest.raises(openai.BadRequestError) as err:  # 0 without echo means nothing
        client.completions.create(model=model, prompt=PROMPT, max_tokens=0)
    assert err.value.body["param"] == "max_tokens"
    # vLLM's prompt_logprobs on chat and completions.
    r = httpx.post(server.base_url + "/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1, "prompt_logprobs": 2, "temperature": 0}).json()
    plp = r["choices"][0]["prompt_logprobs"]
    assert plp[0] is None and len(plp) == len(ids)
    for token, entry, ref in zip(ids[1:], plp[1:], expected.prompt_logprobs[1:]):
        assert entry[str(token)]["logprob"] == pytest.approx(ref["logprob"], abs=LOGIT_ATOL)
        assert entry[str(token)]["rank"] == ref["rank"]  # also outside the top 2
        assert len(entry) == (2 if ref["rank"] <= 2 else 3)
    assert any(ref["rank"] > 2 for ref in expected.prompt_logprobs[1:])
    # With echo and logprobs too, an explicit prompt_logprobs sizes the prompt's alternatives
    # (vLLM's rule), in both places they are reported.
    r = httpx.post(server.base_url + "/completions", timeout=60, json={
        "prompt": PROMPT, "max_tokens": 1, "echo": True, "logprobs": 3, "prompt_logprobs": 1,
        "temperature": 0}).json()
    choice = r["choices"][0]
    for entry, top, ref in zip(choice["prompt_logprobs"][1:], choice["logprobs"]["top_logprobs"][1:],
                               expected.prompt_logprobs[1:]):
        assert len(entry) == len(top) == (1 if ref["rank"] <= 1 else 2)
    assert len(choice["logprobs"]["top_logprobs"][-1]) >= 3  # the generated token: logprobs 3
    chat = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "messages": QUESTION, "max_tokens": 1, "prompt_logprobs": 0}).json()
    assert chat["prompt_logprobs"][0] is None and len(chat["prompt_logprobs"]) == chat["usage"]["prompt_tokens"]


# ---- invalid input ---------------------------------------------------------------------------------

BAD = [
    # (id, route, body, param)
    ("invalid_json_schema", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_schema", "json_schema": {
         "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "wat"}}}}}},
     "response_format.json_schema.schema"),
    ("invalid_regex", "/v1/completions", {"prompt": "x", "guided_regex": "(unclosed"}, "guided_regex"),
    ("invalid_grammar", "/v1/completions", {"prompt": "x", "structured_outputs": {"grammar": "root ::= nope"}},
     "structured_outputs.grammar"),
    ("two_constraints", "/v1/chat/completions",
     {"messages": QUESTION, "response_format": {"type": "json_object"}, "guided_regex": "a+"}, "guided_regex"),
    ("response_format_type", "/v1/chat/completions", {"messages": QUESTION, "response_format": {"type": "xml"}},
     "response_format.type"),
    ("beam_with_temperature", "/v1/completions", {"prompt": "x", "use_beam_search": True, "temperature": 0.8},
     "temperature"),
    ("beam_with_top_p", "/v1/chat/completions", {"messages": QUESTION, "num_beams": 2, "top_p": 0.5}, "top_p"),
    ("beam_n_over_width", "/v1/completions", {"prompt": "x", "num_beams": 2, "n": 3}, "n"),
    ("length_penalty_without_beams", "/v1/completions", {"prompt": "x", "length_penalty": 0.7}, "length_penalty"),
    ("best_of_greedy", "/v1/completions", {"prompt": "x", "best_of": 2, "temperature": 0}, "best_of"),
    ("prompt_logprobs_over_cap", "/v1/completions", {"prompt": "x", "prompt_logprobs": 9}, "prompt_logprobs"),
    ("prompt_logprobs_streamed", "/v1/completions", {"prompt": "x", "prompt_logprobs": 1, "stream": True},
     "prompt_logprobs"),
    ("named_tool_not_in_tools", "/v1/chat/completions",
     {"messages": QUESTION, "tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice"),
    ("required_without_tools", "/v1/chat/completions", {"messages": QUESTION, "tool_choice": "required"},
     "tool_choice"),
    ("duplicate_tool_names", "/v1/chat/completions", {"messages": QUESTION, "tools": [TIME_TOOL, TIME_TOOL]},
     "tools.1.function.name"),
    ("reserved_template_kwarg", "/v1/chat/completions",
     {"messages": QUESTION, "chat_template_kwargs": {"tokenize": True}}, "chat_template_kwargs"),
    ("allowed_token_ids_out_of_vocab", "/v1/completions",
     {"prompt": "x", "allowed_token_ids": [1, 10**7]}, "allowed_token_ids"),
    ("allowed_token_ids_empty", "/v1/completions", {"prompt": "x", "allowed_token_ids": []},
     "allowed_token_ids"),
    ("bad_words_empty_word", "/v1/chat/completions", {"messages": QUESTION, "bad_words": [" "]},
     "bad_words.0"),
    ("truncate_prompt_tokens_zero", "/v1/completions", {"prompt": "x", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("generate_bad_regex", "/generate", {"prompt": "x", "structured_output_regex": "[", "stream": False},
     "structured_output_regex"),
    ("generate_beam_sampling", "/generate",
     {"prompt": "x", "sampling_config": {"num_beams": 2, "topp": 0.5}}, "sampling_config.topp"),
]


@pytest.mark.parametrize("route,body,param", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_400(server, route, body, param):
    r = httpx.post(server.url + route, json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = openai_error(r)
    assert error["type"] == "invalid_request_error" and error["param"] == param, error


def test_token_restrictions_match_transformers(client, model, hf_default_model, default_model):
    """`bad_words` (each word as written and after a space, vLLM's rule), `allowed_token_ids`
    and `truncate_prompt_tokens` give transformers' greedy tokens under its own processors
    (`bad_words_ids`, `suppress_tokens` of every other id) on the truncated prompt."""
    import torch

    tok = default_model.tokenizer
    ids = tok.encode(PROMPT)

    def hf_greedy(prompt_ids: list[int], **kwargs) -> list[int]:
        with torch.no_grad():
            out = hf_default_model.generate(torch.tensor([prompt_ids]), max_new_tokens=8,
                                            do_sample=False, attention_mask=torch.ones(
                                                1, len(prompt_ids), dtype=torch.long), **kwargs)
        return out[0, len(prompt_ids):].tolist()

    plain = hf_greedy(ids)
    word = tok.decode(plain[:1]).strip()  # the name greedy gives the cat
    # vLLM's rule: the word as written, and after a space when that is as many tokens but
    # another first token.
    plain_ids, spaced = (tok.encode(w, add_special_tokens=False) for w in (word, " " + word))
    banned = [plain_ids] + ([spaced] if len(spaced) == len(plain_ids)
                            and spaced[0] != plain_ids[0] else [])
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"bad_words": [word]}).choices[0].text
    assert word not in text
    assert text == tok.decode(hf_greedy(ids, bad_words_ids=banned), skip_special_tokens=True)

    allowed = sorted({*plain[2:], *tok.encode(" Tom and Jerry", add_special_tokens=False)})
    text = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                     extra_body={"allowed_token_ids": allowed}).choices[0].text
    others = [t for t in range(hf_default_model.config.vocab_size) if t not in set(allowed)]
    expected = hf_greedy(ids, suppress_tokens=others)
    assert set(expected) <= set(allowed) and expected != plain
    assert text == tok.decode(expected, skip_special_tokens=True)

    reply = client.completions.create(model=model, prompt=PROMPT, max_tokens=8, temperature=0,
                                      extra_body={"truncate_prompt_tokens": 5})
    assert reply.usage.prompt_tokens == 5
    assert reply.choices[0].text == tok.decode(hf_greedy(ids[-5:]), skip_special_tokens=True)
    whole = client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                      extra_body={"truncate_prompt_tokens": -1})
    assert whole.usage.prompt_tokens == len(ids)  # -1: the context, which holds it all


def test_400_server_settings(server, client, model, r1_app):
    """What the servers' flags refuse: auto tool choice without --enable-auto-tool-choice and a
    parser (the deepseek_r1 app has none), logprobs over --max-logprobs 8."""
    async def check(_aclient, http):
        for body in ({"messages": QUESTION, "tools": TOOLS, "tool_choice": "auto"},
                     {"messages": QUESTION, "tools": TOOLS}):  # auto is the default with tools
            r = await http.post("/chat/completions", json=body)
            assert r.status_code == 400 and openai_error(r)["param"] == "tool_choice"
            assert "--enable-auto-tool-choice" in openai_error(r)["message"]

    run_r1(r1_app, check)
    for route, body, param in (("/chat/completions", {"messages": QUESTION, "logprobs": True,
                                                      "top_logprobs": 9}, "top_logprobs"),
                               ("/completions", {"prompt": "x", "logprobs": 9}, "logprobs")):
        r = httpx.post(server.base_url + route, json=body, timeout=60)
        assert r.status_code == 400 and openai_error(r)["param"] == param and "at most 8" in openai_error(r)["message"]
    # -1 (vLLM's whole vocabulary) counts as the vocabulary's size against the cap.
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={"messages": QUESTION, "logprobs": True, "top_logprobs": -1})
    assert r.status_code == 400 and openai_error(r)["param"] == "top_logprobs"
    assert "whole vocabulary" in openai_error(r)["message"]
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=model, messages=QUESTION, logprobs=True, top_logprobs=9)
    ok = client.chat.completions.create(model=model, messages=QUESTION, logprobs=True, top_logprobs=8,
                                        max_tokens=2)
    assert len(ok.choices[0].logprobs.content[0].top_logprobs) == 8


@pytest.mark.parametrize("flags,message", [
    (["--tool-call-parser", "nope"], ("unknown tool-call parser 'nope'; known: deepseek_v3, deepseek_v31, "
                                      "deepseek_v32, ernie45, glm45, glm47, granite, hermes, hunyuan_a13b, "
                                      "internlm, jamba, kimi_k2, llama3_json, llama4_json, llama4_pythonic, "
                                      "longcat, minimax, minimax_m2, mistral, olmo3, openai, phi4_mini_json, "
                                      "pythonic, qwen3, qwen3_coder, qwen3_xml, seed_oss, step3, xlam")),
    (["--reasoning-parser", "r2"], ("unknown reasoning parser 'r2'; known: deepseek_r1, "
                                    "deepseek_v3, ernie45, glm45, granite, hunyuan_a13b, minimax_m2, "
                                    "minimax_m2_append_think, mistral, olmo3, openai_gptoss, qwen3, "
                                    "seed_oss, step3")),
    (["--enable-auto-tool-choice"], "--enable-auto-tool-choice needs --tool-call-parser"),
    (["--max-logprobs", "-2"], "--max-logprobs must be >= 0, or -1 for no cap, got -2"),
])
def test_bad_parser_flags_fail_at_start(flags, message, capsys):
    """`ksana-llm serve` stops with exit code 2 and the known names, before loading any model."""
    from ksana_llm.cli import main

    assert main(["serve", "--port", "1", "--model", "/nonexistent", *flags]) == 2
    assert message in capsys.readouterr().err


def test_return_token_ids_matches_python_api(server, client, model, local_engine):
    """vLLM's return_token_ids: the prompt's ids and each choice's generated ids, non-streamed
    (on each completion choice; at the top of a chat answer) and streamed (the prompt's on the
    first chunk of each choice, each chunk's own tokens after), equal to the Python API's."""
    prompt_ids = local_engine.tokenizer.encode(PROMPT)
    expected = _local(local_engine, PROMPT, max_new_tokens=6)
    body = {"model": model, "prompt": PROMPT, "max_tokens": 6, "temperature": 0,
            "return_token_ids": True}
    answer = httpx.post(server.base_url + "/completions", json=body, timeout=60).json()
    choice = answer["choices"][0]
    assert choice["prompt_token_ids"] == prompt_ids
    assert choice["token_ids"] == expected.token_ids and choice["text"] == expected.text
    plain = httpx.post(server.base_url + "/completions", timeout=60,
                       json={**body, "return_token_ids": False}).json()["choices"][0]
    assert plain.get("token_ids") is None and plain.get("prompt_token_ids") is None
    # Streamed: the ids arrive with the text they belong to.
    r = httpx.post(server.base_url + "/completions", json={**body, "stream": True}, timeout=60)
    chunks = [c["choices"][0] for c in _stream_events(r) if c["choices"]]
    assert chunks[0]["prompt_token_ids"] == prompt_ids
    assert all("prompt_token_ids" not in c for c in chunks[1:])
    assert [t for c in chunks for t in c.get("token_ids", [])] == expected.token_ids
    assert "".join(c["text"] for c in chunks) == expected.text
    # Chat: the rendered prompt's ids at the top (the server's template), the answer's on the
    # choice.
    rendered = local_engine.tokenizer.apply_chat_template(QUESTION, chat_template=TEMPLATE,
                                                          add_generation_prompt=True,
                                                          tokenize=False)
    chat_ids = local_engine.tokenizer.encode(rendered, add_special_tokens=False)
    expected = _local(local_engine, chat_ids, max_new_tokens=6)
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=6,
                                            temperature=0,
                                            extra_body={"return_token_ids": True})
    assert answer.model_extra["prompt_token_ids"] == chat_ids
    assert answer.choices[0].model_extra["token_ids"] == expected.token_ids
    r = httpx.post(server.base_url + "/chat/completions", timeout=60, json={
        "model": model, "messages": QUESTION, "max_tokens": 6, "temperature": 0,
        "return_token_ids": True, "stream": True})
    events = _stream_events(r)
    assert events[0]["prompt_token_ids"] == chat_ids
    assert all("prompt_token_ids" not in e for e in events[1:])
    streamed = [t for e in events for c in e["choices"] for t in c.get("token_ids", [])]
    assert streamed == expected.token_ids


def test_chat_stop_reason_streamed_and_not(server, client, model):
    """vLLM's stop_reason on chat: the stop string that ended the answer, on the choice and on
    the last streamed chunk of that choice; None when the answer ran to its length."""
    plain = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=12,
                                           temperature=0)
    words = plain.choices[0].message.content.split()
    stop = " " + words[len(words) // 2]  # a word the greedy answer reaches
    body = {"model": model, "messages": QUESTION, "max_tokens": 12, "temperature": 0,
            "stop": [stop]}
    answer = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60).json()
    assert answer["choices"][0]["finish_reason"] == "stop"
    assert answer["choices"][0]["stop_reason"] == stop
    r = httpx.post(server.base_url + "/chat/completions", json={**body, "stream": True},
                   timeout=60)
    choices = [c for e in _stream_events(r) for c in e["choices"]]
    assert choices[-1]["finish_reason"] == "stop" and choices[-1]["stop_reason"] == stop
    assert all(c.get("stop_reason") is None for c in choices[:-1])
    r = httpx.post(server.base_url + "/chat/completions", timeout=60,
                   json={**body, "stop": None, "max_tokens": 3, "stream": True})
    last = [c for e in _stream_events(r) for c in e["choices"]][-1]
    assert last["finish_reason"] == "length" and last.get("stop_reason") is None


def _stream_events(response) -> list[dict]:
    import json

    lines = [line[len("data: "):] for line in response.text.splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def test_request_id_names_the_response(server, client, model):
    """vLLM's request_id: the response's id after its prefix (each streamed chunk's too); one
    that a running request holds is a 400, and free again once that request is gone."""
    answer = client.chat.completions.create(model=model, messages=QUESTION, max_tokens=2,
                                            extra_body={"request_id": "trace-42"})
    assert answer.id == "chatcmpl-trace-42"
    done = client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                     extra_body={"request_id": "trace-42"})
    assert done.id == "cmpl-trace-42"
    chunks = list(client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                            stream=True, extra_body={"request_id": "trace-43"}))
    assert {c.id for c in chunks} == {"cmpl-trace-43"}
    # Long enough to be running still when the clash arrives; the stream is closed early
    # anyway, which aborts it.
    long = {"model": model, "prompt": PROMPT, "max_tokens": 2000, "ignore_eos": True,
            "stream": True, "request_id": "busy"}
    with httpx.stream("POST", server.base_url + "/completions", json=long, timeout=60) as r:
        # The line iterator is kept: one dropped at once closes the connection (httpx closes its
        # stream with the generator), which the server rightly takes as the client gone, and
        # the id would be free again before the clash arrived.
        lines = r.iter_lines()
        first = next(lines)
        assert r.status_code == 200 and first.startswith("data: {"), first  # running now
        clash = httpx.post(server.base_url + "/completions", timeout=60,
                           json={**long, "stream": False, "max_tokens": 2})
        assert clash.status_code == 400
        assert "already in use" in clash.json()["error"]["message"]
    # The stream was closed: its request is aborted, and the id can be used again.
    for _ in range(50):
        again = httpx.post(server.base_url + "/completions", timeout=60,
                           json={**long, "stream": False, "max_tokens": 2})
        if again.status_code == 200:
            break
        time.sleep(0.1)
    assert again.json()["id"] == "cmpl-busy"
    with pytest.raises(openai.BadRequestError, match="request_id"):
        client.completions.create(model=model, prompt=PROMPT, max_tokens=2,
                                  extra_body={"request_id": "has space"})
