"""The OpenAI-compatible server as a real subprocess, driven by the official `openai` client and
`httpx`: completions and chat (sync/async, streamed or not, n > 1, logprobs, usage) (the small
routes, disconnects and metrics: tests/test_server_routes.py; the errors:
tests/test_server_errors.py)."""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

import ksana_llm as kt
from ksana_llm.server.logprobs import TokenTexts
from tests.server_process import ServerProcess, openai_error

KV_ARGS = ["--num-device-blocks", "256"]
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


@pytest.fixture(scope="module")
def server(default_model_dir):
    # default_model_dir: the GGUF is converted (and cached) before the server process needs it.
    proc = ServerProcess(KV_ARGS)
    yield proc
    proc.stop()


# ---- generation --------------------------------------------------------------------------------

def test_chat_greedy_matches_python_api(client, model_name, local_engine):
    rendered = local_engine.tokenizer.apply_chat_template(QUESTION, add_generation_prompt=True,
                                                          tokenize=False)
    expected = local_engine.generate_outputs(rendered, kt.GenerationConfig(max_new_tokens=16),
                                             use_tqdm=False)[0]
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0,
                                           max_tokens=16)
    choice = reply.choices[0]
    assert choice.message.role == "assistant" and choice.message.content == expected.text
    assert "Paris" in choice.message.content
    assert choice.finish_reason == expected.finish_reason
    assert reply.usage.completion_tokens == len(expected.token_ids)
    assert reply.usage.prompt_tokens == len(expected.prompt_token_ids)

    # Streaming: the same text, finish_reason on the last chunk, usage equal to the non-streamed one.
    chunks = list(client.chat.completions.create(
        model=model_name, messages=QUESTION, temperature=0, max_tokens=16, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == expected.text
    with_choices = [c for c in chunks if c.choices]
    assert with_choices[-1].choices[0].finish_reason == expected.finish_reason
    assert all(c.choices[0].finish_reason is None for c in with_choices[:-1])
    assert chunks[-1].choices == []
    # The same prompt again: its full 16-token blocks come from the prefix cache.
    usage = chunks[-1].usage
    assert usage.model_dump(exclude={"prompt_tokens_details"}) == \
        reply.usage.model_dump(exclude={"prompt_tokens_details"})
    assert usage.prompt_tokens_details.cached_tokens == usage.prompt_tokens // 16 * 16 > 0


def test_an_answer_sent_back_as_the_client_dumps_it(client, model_name):
    """`messages.append(reply.choices[0].message.model_dump())` -- refusal, annotations, audio and
    function_call all null -- is a valid next turn, as on OpenAI; a refusal is the turn's text."""
    reply = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=4,
                                           temperature=0)
    dumped = reply.choices[0].message.model_dump()
    assert {"refusal", "annotations", "audio", "function_call"} <= set(dumped)
    follow = [*QUESTION, dumped, {"role": "user", "content": "And of Germany?"}]
    assert client.chat.completions.create(model=model_name, messages=follow,
                                          max_tokens=2).choices[0].message.content

    def prompt_tokens(assistant: dict) -> int:
        return client.chat.completions.create(
            model=model_name, max_tokens=1, messages=[*QUESTION, assistant, QUESTION[0]]
        ).usage.prompt_tokens

    said = prompt_tokens({"role": "assistant", "content": "I cannot say."})
    assert prompt_tokens({"role": "assistant", "content": None, "refusal": "I cannot say."}) == said
    assert prompt_tokens({"role": "assistant", "content": [
        {"type": "refusal", "refusal": "I cannot say."}]}) == said
    with pytest.raises(openai.BadRequestError) as err:  # no audio to replay here
        client.chat.completions.create(model=model_name, max_tokens=1, messages=[
            *QUESTION, {"role": "assistant", "content": None, "audio": {"id": "audio_1"}}])
    assert err.value.body["param"] == "messages.1.audio"
    with pytest.raises(openai.BadRequestError) as err:  # also on a turn that only called tools
        client.chat.completions.create(model=model_name, max_tokens=1, messages=[
            *QUESTION, {"role": "assistant", "content": None, "function_call": {
                "name": "f", "arguments": "{}"}, "tool_calls": [
                    {"id": "call_1", "type": "function",
                     "function": {"name": "f", "arguments": "{}"}}]}])
    assert err.value.body["param"] == "messages.1.function_call"
    for function in ({"name": "f"}, {"name": "f", "arguments": 3}):  # arguments: JSON text
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=model_name, max_tokens=1, messages=[
                *QUESTION, {"role": "assistant", "content": None, "tool_calls": [
                    {"id": "call_1", "type": "function", "function": function}]}])
        assert err.value.body["param"] == "messages.1.tool_calls.0.function.arguments"


def test_null_parameters_mean_their_defaults(server, client, model_name):
    """OpenAI's nullable parameters and vLLM's Optional extras: null is "not given" (the SDK
    sends null for an argument passed as None), never a type error."""
    nulls = {"n": None, "stream": None, "logprobs": None, "ignore_eos": None, "min_tokens": None,
             "skip_special_tokens": None, "priority": None, "length_penalty": None,
             "stream_options": None, "add_generation_prompt": None}
    body = {"model": model_name, "messages": QUESTION, "max_tokens": 6, "temperature": 0}
    plain = httpx.post(server.base_url + "/chat/completions", json=body, timeout=60)
    nulled = httpx.post(server.base_url + "/chat/completions", json={**body, **nulls}, timeout=60)
    assert nulled.status_code == 200, nulled.text
    assert nulled.json()["choices"] == plain.json()["choices"]
    assert nulled.json()["choices"][0]["message"]["refusal"] is None  # present, as OpenAI's
    # vLLM's spaces_between_special_tokens: accepted (vLLM clients send it), the text unchanged.
    spaced = httpx.post(server.base_url + "/chat/completions", timeout=60,
                        json={**body, "spaces_between_special_tokens": False})
    assert spaced.status_code == 200, spaced.text
    assert spaced.json()["choices"] == plain.json()["choices"]
    completion = {"model": model_name, "prompt": PROMPT, "max_tokens": 4, "temperature": 0}
    nulled = httpx.post(server.base_url + "/completions", timeout=60,
                        json={**completion, "echo": None, "n": None, "best_of": None,
                              "stream": True, "stream_options": {"include_usage": None}})
    assert nulled.status_code == 200, nulled.text
    assert "usage" not in nulled.text  # include_usage null: false
    via_sdk = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=6,
                                             temperature=0, n=None, stream=None, logprobs=None)
    assert via_sdk.choices[0].message.content == plain.json()["choices"][0]["message"]["content"]
    refused = httpx.post(server.base_url + "/chat/completions", json={**body, "messages": None})
    assert refused.status_code == 400 and openai_error(refused)["param"] == "messages"


def test_stream_chunks_carry_null_finish_reason_and_logprobs(server, model_name):
    """Every streamed choice has `finish_reason` and `logprobs` keys (null until set), as OpenAI
    and vLLM send them; typed clients index them. With include_usage, every chunk has a `usage`
    key: null until the last."""
    import json

    for route, body in (("/chat/completions", {"messages": QUESTION}),
                        ("/completions", {"prompt": PROMPT})):
        with httpx.stream("POST", server.base_url + route, timeout=60,
                          json={"model": model_name, "max_tokens": 3, "stream": True, **body}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        choices = [c for chunk in chunks for c in chunk["choices"]]
        assert len(choices) >= 3
        assert all("finish_reason" in c and "logprobs" in c for c in choices), choices
        assert [c["finish_reason"] for c in choices][-1] == "length"
        assert all(c["finish_reason"] is None for c in choices[:-1])
        assert all("usage" not in chunk for chunk in chunks)  # include_usage not asked for
        with httpx.stream("POST", server.base_url + route, timeout=60,
                          json={"model": model_name, "max_tokens": 3, "stream": True, **body,
                                "stream_options": {"include_usage": True}}) as r:
            chunks = [json.loads(line[6:]) for line in r.iter_lines()
                      if line.startswith("data: {")]
        # OpenAI: "All other chunks will also include a usage field, but with a null value."
        assert all("usage" in chunk and chunk["usage"] is None for chunk in chunks[:-1]), chunks
        assert all("finish_reason" in c and "logprobs" in c for chunk in chunks[:-1]
                   for c in chunk["choices"])
        assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 3


def test_engine_limits_are_named_by_request_parameters(server):
    r = httpx.post(server.base_url + "/completions",
                   json={"prompt": "x", "max_tokens": 2, "min_tokens": 5}, timeout=60)
    assert r.status_code == 400
    error = openai_error(r)
    assert error["param"] == "min_tokens" and "max_tokens" in error["message"]
    assert "new_tokens" not in error["message"], error


def test_parameters_of_the_clients_own_signature(client, model_name):
    """The official client's chat parameters: the ones that change nothing are accepted (as on
    /v1/responses), `verbosity`, which would change the answer, is refused by name."""
    out = client.chat.completions.create(
        model=model_name, messages=QUESTION, max_tokens=2, prompt_cache_key="k",
        safety_identifier="user-1", prompt_cache_retention="24h", stream=True,
        stream_options={"include_usage": True, "include_obfuscation": False})
    assert list(out)[-1].usage.completion_tokens == 2
    with pytest.raises(openai.BadRequestError) as err:
        client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2,
                                       verbosity="low")
    assert (err.value.body["param"], err.value.body["code"]) == ("verbosity",
                                                                "unsupported_parameter")


def test_cache_salt_isolates_the_prefix_cache(client, model_name):
    """vLLM's `cache_salt`: a request sees cached prompt blocks only of requests with its salt;
    the Responses route takes it too."""
    messages = [{"role": "user", "content": "Salted: " + "tell me about the sea. " * 12}]

    def cached(**extra):
        reply = client.chat.completions.create(model=model_name, messages=messages, max_tokens=1,
                                               extra_body=extra)
        return reply.usage.prompt_tokens_details.cached_tokens, reply.usage.prompt_tokens

    first, prompt_tokens = cached(cache_salt="tenant-a")
    full = prompt_tokens // 16 * 16
    assert (first, cached(cache_salt="tenant-b")[0]) == (0, 0)
    # Unsalted: at most the chat template's opening, which other tests' requests cached.
    assert cached()[0] < full
    assert cached(cache_salt="tenant-a")[0] == full > 0
    assert cached()[0] == full  # unsalted requests share among themselves
    response = client.responses.create(model=model_name, input=messages[0]["content"],
                                       max_output_tokens=1, extra_body={"cache_salt": "tenant-c"})
    assert response.usage.input_tokens_details.cached_tokens == 0


def test_predicted_outputs(client, model_name, default_model):
    """OpenAI's `prediction` never changes the answer (here the server drafts nothing; see
    test_ngram_speculation.py for drafting from it); usage says how many prediction tokens
    the answer used, streamed too."""
    tokenizer = default_model.tokenizer
    kwargs = dict(model=model_name, messages=QUESTION, temperature=0, max_tokens=16)
    plain = client.chat.completions.create(**kwargs).choices[0].message.content
    answer = tokenizer.encode(plain, add_special_tokens=False)
    for prediction, accepted in ((plain, len(answer)), ("Berlin is in Germany.", None),
                                 ([{"type": "text", "text": plain[:10]},
                                   {"type": "text", "text": plain[10:]}], len(answer))):
        reply = client.chat.completions.create(
            **kwargs, prediction={"type": "content", "content": prediction})
        assert reply.choices[0].message.content == plain
        details = reply.usage.completion_tokens_details
        predicted = len(tokenizer.encode(prediction if isinstance(prediction, str) else plain,
                                         add_special_tokens=False))
        assert details.accepted_prediction_tokens + details.rejected_prediction_tokens \
            == predicted
        if accepted is not None:
            assert (details.accepted_prediction_tokens, details.rejected_prediction_tokens) \
                == (accepted, 0)
        else:
            assert details.rejected_prediction_tokens > 0
    chunks = list(client.chat.completions.create(
        **kwargs, prediction={"type": "content", "content": plain}, stream=True,
        stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens_details.accepted_prediction_tokens == len(answer)
    for bad, param in (({"type": "text", "content": "x"}, "prediction"),
                       ({"type": "content", "content": 7}, "prediction.content")):
        with pytest.raises(openai.BadRequestError) as refused:
            client.chat.completions.create(**kwargs, prediction=bad)
        assert refused.value.body["param"] == param


def test_logprob_tokens_as_token_ids(client, model_name, default_model):
    """vLLM's `return_tokens_as_token_ids`: every logprob token (chosen and top, completions and
    chat, streamed too) is "token_id:<id>", with the same log-probs as the plain names; the ids
    decode to the text."""
    tokenizer = default_model.tokenizer

    def ids(tokens: list[str]) -> list[int]:
        assert all(t.startswith("token_id:") for t in tokens), tokens
        return [int(t.split(":", 1)[1]) for t in tokens]

    kwargs = dict(model=model_name, prompt="The capital of France is", max_tokens=6,
                  temperature=0, logprobs=2)
    plain = client.completions.create(**kwargs).choices[0]
    named = client.completions.create(**kwargs, extra_body={
        "return_tokens_as_token_ids": True}).choices[0]
    assert named.text == plain.text and tokenizer.decode(ids(named.logprobs.tokens)) == plain.text
    assert named.logprobs.token_logprobs == plain.logprobs.token_logprobs
    names = TokenTexts(tokenizer)  # how the server names tokens without the flag
    for top_named, top_plain in zip(named.logprobs.top_logprobs, plain.logprobs.top_logprobs):
        assert {names.text(i): lp for i, lp in zip(ids(list(top_named)), top_named.values())} \
            == top_plain
    chat = dict(model=model_name, messages=QUESTION, max_tokens=8, temperature=0, logprobs=True,
                top_logprobs=2, extra_body={"return_tokens_as_token_ids": True})
    reply = client.chat.completions.create(**chat).choices[0]
    entries = reply.logprobs.content
    assert tokenizer.decode(ids([e.token for e in entries]), skip_special_tokens=True) \
        == reply.message.content
    assert all(e.bytes == list(e.token.encode()) for e in entries)
    assert all(ids([t.token for t in e.top_logprobs]) for e in entries)
    streamed = [e for c in client.chat.completions.create(**chat, stream=True)
                if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert [e.token for e in streamed] == [e.token for e in entries]


def test_completions_sync_stream_and_prompt_shapes(client, model_name, local_engine):
    ids = local_engine.tokenizer.encode(PROMPT)
    expected = local_engine.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=8),
                                             use_tqdm=False)[0]
    done = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8)
    assert done.object == "text_completion" and done.choices[0].text == expected.text
    assert done.choices[0].finish_reason == "length"
    assert (done.usage.prompt_tokens, done.usage.completion_tokens) == (len(ids), 8)

    chunks = list(client.completions.create(model=model_name, prompt=PROMPT, temperature=0,
                                            max_tokens=8, stream=True,
                                            stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == expected.text
    assert [c for c in chunks if c.choices][-1].choices[0].finish_reason == "length"
    assert chunks[-1].usage.model_dump(exclude={"prompt_tokens_details"}) == \
        done.usage.model_dump(exclude={"prompt_tokens_details"})
    # No usage chunk unless asked for.
    plain = list(client.completions.create(model=model_name, prompt=PROMPT, temperature=0,
                                           max_tokens=2, stream=True))
    assert all(c.usage is None and c.choices for c in plain)

    # A list of prompts, as strings and as token ids: one choice per prompt, in order.
    hello = local_engine.tokenizer.encode("Hello")
    batch = client.completions.create(model=model_name, prompt=[ids, hello], temperature=0,
                                      max_tokens=8)
    assert [c.index for c in batch.choices] == [0, 1] and batch.choices[0].text == expected.text
    assert batch.usage.prompt_tokens == len(ids) + len(hello)
    texts = client.completions.create(model=model_name, prompt=[PROMPT, "Hello"], temperature=0,
                                      max_tokens=8)
    assert [c.text for c in texts.choices] == [c.text for c in batch.choices]

    echoed = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=8,
                                       echo=True)
    assert echoed.choices[0].text == PROMPT + expected.text

    # No max_tokens: 16, OpenAI's and vLLM's completions default (it ran to the context's end).
    sixteen = local_engine.generate_outputs(PROMPT, kt.GenerationConfig(
        max_new_tokens=16, ignore_eos=True), use_tqdm=False)[0]
    default = client.completions.create(model=model_name, prompt=PROMPT, temperature=0,
                                        extra_body={"ignore_eos": True})
    assert default.usage.completion_tokens == 16 and default.choices[0].text == sixteen.text
    assert default.choices[0].finish_reason == "length"


def test_async_client_n_with_seed(server, model_name):
    async def main() -> None:
        aclient = openai.AsyncOpenAI(base_url=server.base_url, api_key="x", max_retries=0)
        kwargs = dict(model=model_name, prompt=PROMPT, n=3, seed=1234, temperature=1.0,
                      max_tokens=8, extra_body={"ignore_eos": True})
        first, again = await asyncio.gather(aclient.completions.create(**kwargs),
                                            aclient.completions.create(**kwargs))
        assert [c.index for c in first.choices] == [0, 1, 2]
        assert [c.text for c in first.choices] == [c.text for c in again.choices]  # reproducible
        assert len({c.text for c in first.choices}) > 1  # each choice has its own seed
        assert first.usage.completion_tokens == 24

        stream = await aclient.chat.completions.create(
            model=model_name, messages=QUESTION, n=2, seed=7, max_tokens=6, stream=True,
            stream_options={"include_usage": True})
        texts, finished = {0: "", 1: ""}, {}
        usage = None
        async for chunk in stream:
            usage = chunk.usage or usage
            for c in chunk.choices:
                texts[c.index] += c.delta.content or ""
                if c.finish_reason:
                    finished[c.index] = c.finish_reason
        assert set(finished) == {0, 1} and usage.completion_tokens >= 2
        await aclient.close()

    asyncio.run(main())


def test_logprobs_formats(client, model_name):
    done = client.completions.create(model=model_name, prompt=PROMPT, temperature=0, max_tokens=5,
                                     logprobs=2)
    lp = done.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == done.choices[0].text
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(5)]
    for token, value, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert value <= 0 and len(top) == 2 and top[token] == pytest.approx(value)  # greedy: top-1
    # Sampled: the chosen token is always listed, so up to logprobs + 1 entries (just it with 0).
    config = dict(model=model_name, prompt=PROMPT, max_tokens=16, temperature=2.0, seed=5)
    alone = client.completions.create(**config, logprobs=0).choices[0].logprobs
    assert all(top == {token: value} for token, value, top
               in zip(alone.tokens, alone.token_logprobs, alone.top_logprobs))
    one = client.completions.create(**config, logprobs=1).choices[0].logprobs
    assert one.tokens == alone.tokens
    assert all(top[token] == value and len(top) in (1, 2) for token, value, top
               in zip(one.tokens, one.token_logprobs, one.top_logprobs))
    assert any(len(top) == 2 for top in one.top_logprobs)  # a token that was not the most likely

    chat = client.chat.completions.create(model=model_name, messages=QUESTION, temperature=0,
                                          max_tokens=5, logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert b"".join(bytes(e.bytes) for e in content).decode() == chat.choices[0].message.content
    assert all(len(e.top_logprobs) == 3 and e.top_logprobs[0].token == e.token for e in content)

    streamed = list(client.chat.completions.create(model=model_name, messages=QUESTION,
                                                   temperature=0, max_tokens=5, logprobs=True,
                                                   stream=True))
    tokens = [e.token for c in streamed if c.choices and c.choices[0].logprobs
              for e in c.choices[0].logprobs.content]
    assert tokens == [e.token for e in content]



def _assert_offsets_locate_tokens(text: str, tokens: list[str], offsets: list[int]) -> None:
    """Each whole token sits in `text` at its offset; offsets never run backwards or past the end."""
    assert len(offsets) == len(tokens) and offsets[0] == 0
    assert offsets == sorted(offsets) and offsets[-1] <= len(text)
    for token, offset in zip(tokens, offsets):
        if "\ufffd" not in token:
            assert text[offset:offset + len(token)] == token, (token, offset)


def test_text_offset_counts_characters_split_across_tokens(client, model_name):
    # The emoji and the two kanji are each several byte-level tokens whose strings read U+FFFD;
    # the offsets must follow the characters of the text, not the count of those strings.
    prompt = "Sushi \U0001F363 in \u6771\u4eac is"
    config = dict(model=model_name, prompt=prompt, temperature=0, max_tokens=4, echo=True, logprobs=1)
    done = client.completions.create(**config).choices[0]
    assert done.text.startswith(prompt)
    lp = done.logprobs
    assert sum("\ufffd" in t for t in lp.tokens) >= 4  # the prompt really splits characters
    _assert_offsets_locate_tokens(done.text, lp.tokens, lp.text_offset)
    assert lp.text_offset[lp.tokens.index(" in")] == prompt.index(" in")

    text, tokens, offsets = "", [], []
    for chunk in client.completions.create(**config, stream=True):
        for c in chunk.choices:
            text += c.text
            if c.logprobs is not None:
                tokens += c.logprobs.tokens
                offsets += c.logprobs.text_offset
    assert (text, tokens, offsets) == (done.text, lp.tokens, lp.text_offset)


@pytest.mark.parametrize("route", ["chat", "completions"])
def test_continuous_usage_stats(client, model_name, route):
    """vLLM's `stream_options.continuous_usage_stats`: every chunk carries its choice's token
    counts so far, which end at the counts the final usage chunk sums."""
    create, kwargs = ((client.chat.completions.create, {"messages": QUESTION}) if route == "chat"
                      else (client.completions.create, {"prompt": "The sea is"}))
    options = {"include_usage": True, "continuous_usage_stats": True}
    chunks = list(create(model=model_name, max_tokens=12, n=2, temperature=0.8, seed=3,
                         stream=True, stream_options=options, **kwargs))
    final = chunks[-1].usage
    assert chunks[-1].choices == [] and final.completion_tokens > 0
    so_far = {0: 0, 1: 0}
    for c in chunks[:-1]:
        assert c.usage is not None and c.usage.prompt_tokens == final.prompt_tokens
        index = c.choices[0].index
        assert c.usage.completion_tokens >= so_far[index]
        assert c.usage.total_tokens == c.usage.prompt_tokens + c.usage.completion_tokens
        so_far[index] = c.usage.completion_tokens
    assert sum(so_far.values()) == final.completion_tokens
    plain = list(create(model=model_name, max_tokens=4, stream=True,
                        stream_options={"include_usage": True}, **kwargs))
    assert all(c.usage is None for c in plain[:-1]) and plain[-1].usage is not None
    if route == "completions":  # the echoed prompt's chunk has no completion token yet
        echoed = list(create(model=model_name, max_tokens=3, stream=True, echo=True,
                             temperature=0, stream_options=options, **kwargs))
        assert echoed[0].choices[0].text == "The sea is"
        counts = [c.usage.completion_tokens for c in echoed[:-1]]
        assert counts[0] == 0 and counts[-1] == echoed[-1].usage.completion_tokens == 3


def test_max_completion_tokens_wins_over_max_tokens(client, model_name):
    """vLLM's rule: both given, max_completion_tokens (OpenAI's current name) counts."""
    answer = client.chat.completions.create(model=model_name, messages=QUESTION, max_tokens=2,
                                            max_completion_tokens=5, temperature=0)
    assert answer.usage.completion_tokens == 5 and answer.choices[0].finish_reason == "length"
