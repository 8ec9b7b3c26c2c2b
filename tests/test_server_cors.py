"""Server-wide flags on a real server process: CORS for browser clients (vLLM's
--allowed-origins / --allowed-methods / --allowed-headers, answered before the API key is
checked, since a browser's preflight never carries it), --return-tokens-as-token-ids,
several --served-model-name aliases, and the x-request-id header on every answer."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_process import ServerProcess, server_fixture

APP = "https://app.example"
KEY = "secret-key"


server = server_fixture(["--num-device-blocks", "64", "--max-model-len", "256",
                         "--api-key", KEY, "--allowed-origins", f'["{APP}"]',
                         "--allowed-methods", '["GET", "POST"]',
                         "--return-tokens-as-token-ids",
                         "--served-model-name", "smol", "smol-latest"])


def _preflight(server: ServerProcess, origin: str) -> httpx.Response:
    return httpx.options(server.base_url + "/chat/completions", headers={
        "Origin": origin, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization, content-type"})


def test_browsers_of_allowed_origins_may_call(server):
    allowed = _preflight(server, APP)
    assert allowed.status_code == 200  # no key needed for the preflight
    assert allowed.headers["access-control-allow-origin"] == APP
    assert "POST" in allowed.headers["access-control-allow-methods"]
    refused = _preflight(server, "https://elsewhere.example")
    assert refused.status_code == 400 and "access-control-allow-origin" not in refused.headers
    call = httpx.get(server.base_url + "/models", headers={
        "Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert call.status_code == 200 and call.headers["access-control-allow-origin"] == APP
    # The key is still required of the call itself.
    assert httpx.get(server.base_url + "/models", headers={"Origin": APP}).status_code == 401


def test_every_logprob_token_is_named_by_id(server):
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    model = client.models.list().data[0].id
    choice = client.completions.create(model=model, prompt="The capital of France is",
                                       max_tokens=4, temperature=0, logprobs=1).choices[0]
    assert all(t.startswith("token_id:") for t in choice.logprobs.tokens)
    assert all(k.startswith("token_id:") for top in choice.logprobs.top_logprobs for k in top)


def test_every_served_name_is_the_model(server):
    # The start-up line names the first, once the server listens.
    assert f"ksana-llm: serving 'smol' (OpenAI API under /v1) on http://127.0.0.1:{server.port}" \
        in server.log()
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    assert [m.id for m in client.models.list().data] == ["smol", "smol-latest"]
    answers = [client.completions.create(model=name, prompt="The capital of France is",
                                         max_tokens=4, temperature=0) for name in
               ("smol", "smol-latest")]
    assert answers[0].choices[0].text == answers[1].choices[0].text
    assert [a.model for a in answers] == ["smol", "smol-latest"]
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="other", prompt="x", max_tokens=1)


def test_every_response_carries_a_request_id(server):
    """`x-request-id` on every answer, as OpenAI's (the SDK's `_request_id`): the client's own
    X-Request-Id when usable (a trace id through proxies), else a fresh one per request; on
    refusals before routing (401) and streams too; browsers' scripts may read it."""
    client = openai.OpenAI(base_url=server.base_url, api_key=KEY, max_retries=0, timeout=60)
    kwargs = dict(model="smol", prompt="The capital of France is", max_tokens=2)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first._request_id and second._request_id and first._request_id != second._request_id
    traced = client.completions.with_raw_response.create(
        **kwargs, extra_headers={"X-Request-Id": "trace-42"})
    assert traced.headers["x-request-id"] == "trace-42"
    with client.completions.with_streaming_response.create(
            **kwargs, stream=True, extra_headers={"X-Request-Id": "trace-43"}) as streamed:
        assert streamed.headers["x-request-id"] == "trace-43" and list(streamed.iter_lines())
    # Not a usable trace id (a space, over 256 characters): replaced, never echoed.
    for bad in ("has space", "x" * 257):
        answer = httpx.post(server.base_url + "/completions", json=kwargs, headers={
            "Authorization": f"Bearer {KEY}", "X-Request-Id": bad})
        assert answer.status_code == 200 and answer.headers["x-request-id"] not in ("", bad)
    refused = httpx.get(server.base_url + "/models", headers={"X-Request-Id": "trace-44"})
    assert refused.status_code == 401 and refused.headers["x-request-id"] == "trace-44"
    from_browser = httpx.get(server.base_url + "/models", headers={
        "Origin": APP, "Authorization": f"Bearer {KEY}"})
    assert "x-request-id" in from_browser.headers["access-control-expose-headers"].lower()
    assert _preflight(server, APP).headers["x-request-id"]  # preflights too
