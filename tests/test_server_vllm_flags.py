"""vLLM's serving flags that change what a real server process does:
--default-chat-template-kwargs (chat and /tokenize render with them, under each request's own),
--enable-force-include-usage (every stream ends with usage), --disable-fastapi-docs, and
--speculative-config (ngram drafts run, and greedy tokens stay the Python API's)."""

from __future__ import annotations

import json

import httpx
import pytest

import ksana_llm as kt
from tests.server_process import ServerProcess

# A ChatML template with one argument of its own: `lead`, text the assistant's turn starts with.
TEMPLATE = ("{%- for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + "
            "'<|im_end|>\\n' }}{%- endfor %}{%- if add_generation_prompt %}"
            "{{ '<|im_start|>assistant\\n' }}{%- if lead %}{{ lead }}{%- endif %}{%- endif %}")
LEAD = "Sure! The answer is:"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
# A prompt that repeats itself, so prompt lookup finds drafts.
COPY = "Repeat exactly: the quick brown fox jumps over the lazy dog. " * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(TEMPLATE)
    proc = ServerProcess([
        "--num-gpu-blocks-override", "128", "--chat-template", str(template),
        "--default-chat-template-kwargs", json.dumps({"lead": LEAD}),
        "--enable-force-include-usage", "--disable-fastapi-docs",
        "--speculative-config", '{"method": "ngram", "num_speculative_tokens": 3}',
        "--enable-chunked-prefill", "--disable-uvicorn-access-log", "--metrics-prefix", "vllm"])
    yield proc
    proc.stop()


def _rendered(tokenizer, lead: str) -> str:
    return tokenizer.apply_chat_template(QUESTION, chat_template=TEMPLATE, tokenize=False,
                                         add_generation_prompt=True, lead=lead)


def test_default_chat_template_kwargs_render_every_chat(server, local_engine):
    tokenizer = local_engine.tokenizer
    with_lead = _rendered(tokenizer, LEAD)
    assert LEAD in with_lead and LEAD not in _rendered(tokenizer, "")
    tokens = httpx.post(server.url + "/tokenize", json={"messages": QUESTION}).json()["tokens"]
    assert tokens == tokenizer.encode(with_lead, add_special_tokens=False)
    # A request's own kwargs over the server's, as on chat completions.
    tokens = httpx.post(server.url + "/tokenize", json={
        "messages": QUESTION, "chat_template_kwargs": {"lead": ""}}).json()["tokens"]
    assert tokens == tokenizer.encode(_rendered(tokenizer, ""), add_special_tokens=False)
    greedy = kt.GenerationConfig(max_new_tokens=8)
    for kwargs, prompt in ((None, with_lead), ({"lead": ""}, _rendered(tokenizer, ""))):
        body = {"messages": QUESTION, "max_tokens": 8, "temperature": 0,
                **({"chat_template_kwargs": kwargs} if kwargs else {})}
        answer = httpx.post(server.base_url + "/chat/completions", json=body, timeout=120).json()
        ids = tokenizer.encode(prompt, add_special_tokens=False)
        assert answer["usage"]["prompt_tokens"] == len(ids)
        assert answer["choices"][0]["message"]["content"] == local_engine.generate_outputs(
            ids, greedy, use_tqdm=False)[0].text


def _events(response: httpx.Response) -> list[dict]:
    lines = [line[len("data: "):] for line in response.text.splitlines()
             if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


@pytest.mark.parametrize("path, body", [
    ("/completions", {"prompt": "Once upon a time", "max_tokens": 5, "temperature": 0,
                      "ignore_eos": True}),
    ("/chat/completions", {"messages": QUESTION, "max_tokens": 5, "temperature": 0,
                           "ignore_eos": True}),
])
def test_streams_end_with_usage_without_asking(server, path, body):
    response = httpx.post(server.base_url + path, json={**body, "stream": True}, timeout=120)
    events = _events(response)
    assert events[-1]["choices"] == [] and events[-1]["usage"]["completion_tokens"] == 5
    assert all(event["usage"] is None for event in events[:-1])


def test_no_api_docs(server):
    for path in ("/docs", "/redoc", "/openapi.json"):
        assert httpx.get(server.url + path).status_code == 404, path
    assert httpx.get(server.url + "/health").status_code == 200


def test_speculative_config_drafts_and_keeps_greedy_tokens(server, local_engine):
    before = httpx.get(server.base_url + "/stats").json()
    answer = httpx.post(server.base_url + "/completions", timeout=120, json={
        "prompt": COPY, "max_tokens": 24, "temperature": 0}).json()
    after = httpx.get(server.base_url + "/stats").json()
    assert after["num_draft_tokens"] > before["num_draft_tokens"]
    assert answer["choices"][0]["text"] == local_engine.generate_outputs(
        COPY, kt.GenerationConfig(max_new_tokens=24), use_tqdm=False)[0].text
    assert after["num_kv_blocks"] == 128  # --num-gpu-blocks-override


def test_metrics_prefix_gives_vllms_series_names(server):
    """--metrics-prefix vllm: every series under vLLM's names (what its dashboards, alerts and
    autoscalers query), none under ours."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.post(server.base_url + "/completions", timeout=60,
                   json={"prompt": "Hello", "max_tokens": 2})
    assert r.status_code == 200
    text = httpx.get(server.url + "/metrics", timeout=30).text
    names = {s.name for family in text_string_to_metric_families(text) for s in family.samples}
    assert {"vllm:num_requests_running", "vllm:kv_cache_usage_perc", "vllm:prompt_tokens_total",
            "vllm:generation_tokens_total", "vllm:time_to_first_token_seconds_count",
            "vllm:e2e_request_latency_seconds_count"} <= names
    assert not any(n.startswith("ksana_llm") for n in names)

