"""OpenAI's Responses API in the background (`background: true`) and its store, on a real server
process (SmolLM2) driven by the official `openai` client: polled and cancelled responses,
resumable streams, running responses pushed out of the store or deleted, and the store's limit
(the rest of the API: tests/test_server_responses.py)."""

from __future__ import annotations

import httpx
import openai
import pytest

from tests.server_process import openai_error, server_fixture

QUESTION = "What is the capital of France?"


server = server_fixture(["--num-device-blocks", "256", "--max-model-len", "2048",
                         "--max-stored-responses", "4"])


def _poll(client, response_id: str, timeout: float = 60):
    import time

    deadline = time.monotonic() + timeout
    while True:
        response = client.responses.retrieve(response_id)
        if response.status not in ("queued", "in_progress") or time.monotonic() > deadline:
            return response
        time.sleep(0.1)


def test_background_responses_are_polled_and_cancelled(client, server, model_name):
    """`background: true` answers at once (in progress) and runs on; GET polls it to the same
    answer as a plain request; POST /cancel stops a running one (stored as cancelled, its
    sequence freed); refused: not stored, or continued while running."""
    plain = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                    max_output_tokens=16)
    started = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                      max_output_tokens=16, background=True)
    assert started.status == "in_progress" and started.background and not started.output
    done = _poll(client, started.id)
    assert (done.status, done.output_text) == (plain.status, plain.output_text)
    assert done.usage.output_tokens == plain.usage.output_tokens

    long = client.responses.create(model=model_name, input="Count from one to one thousand.",
                                   max_output_tokens=1500, background=True)
    with pytest.raises(openai.BadRequestError) as running:
        client.responses.create(model=model_name, input="x", previous_response_id=long.id)
    assert running.value.body["param"] == "previous_response_id"
    cancelled = client.responses.cancel(long.id)
    assert cancelled.status == "cancelled"
    assert client.responses.retrieve(long.id).status == "cancelled"
    assert cancelled.usage.output_tokens < 1500
    assert _running(httpx.get(server.url + "/metrics").text) == 0
    # OpenAI: cancelling again, or once it ended, returns the final response; a response that
    # never ran in the background cannot be cancelled.
    assert client.responses.cancel(long.id).model_dump() == cancelled.model_dump()
    assert client.responses.cancel(done.id).status == "completed"
    with pytest.raises(openai.BadRequestError):
        client.responses.cancel(plain.id)
    response = httpx.post(server.base_url + "/responses",
                          json={"input": "x", "background": True, "store": False})
    assert response.status_code == 400 and response.json()["error"]["param"] == "background"


def test_background_streams_resume_and_outlive_their_reader(client, server, model_name):
    """`background: true, stream: true` (OpenAI's resumable streaming): the events of a plain
    stream, ending in a plain request's answer; `GET ?stream=true&starting_after=N` gives the
    events after N, live while the response runs and replayed once it has ended; a reader that
    goes away does not stop it, POST /cancel does; a response created without `stream` cannot
    be streamed."""
    plain = client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                    max_output_tokens=40)
    events = list(client.responses.create(model=model_name, input=QUESTION, temperature=0,
                                          max_output_tokens=40, background=True, stream=True))
    assert events[0].type == "response.created" and events[0].response.background
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].type == "response.completed"
    assert events[-1].response.output_text == plain.output_text
    response_id = events[0].response.id
    assert client.responses.retrieve(response_id).output_text == plain.output_text
    replayed = list(client.responses.retrieve(response_id, stream=True, starting_after=5))
    assert [e.model_dump() for e in replayed] == [e.model_dump() for e in events[6:]]
    with pytest.raises(openai.BadRequestError) as not_streamed:
        list(client.responses.retrieve(plain.id, stream=True))
    assert not_streamed.value.body["param"] == "stream"

    question = "Count from one to fifty, one number a line."
    reference = client.responses.create(model=model_name, input=question, temperature=0,
                                        max_output_tokens=120)
    stream = client.responses.create(model=model_name, input=question, temperature=0,
                                     max_output_tokens=120, background=True, stream=True)
    reader = iter(stream)
    first = [next(reader) for _ in range(3)]
    stream.close()  # the reader goes away; the response runs on
    rest = list(client.responses.retrieve(first[0].response.id, stream=True, starting_after=2))
    assert [e.sequence_number for e in first + rest] == list(range(3 + len(rest)))
    assert rest[-1].response.output_text == reference.output_text
    assert rest[-1].response.status == reference.status

    long = _long_background_stream(client, model_name)
    started = next(iter(long))
    cancelled = client.responses.cancel(started.response.id)
    assert cancelled.status == "cancelled" and cancelled.usage.output_tokens < 1500
    tail = list(long)  # the POST's own stream ends too, with the cancelled response
    assert tail[-1].type == "response.incomplete" and tail[-1].response.status == "cancelled"
    assert _running(httpx.get(server.url + "/metrics").text) == 0


def test_running_background_responses_outlive_the_store_and_stop_when_deleted(
        client, server, model_name):
    """A running background response pushed out of the store (--max-stored-responses 4) is
    still there to GET and to stream until it ends; DELETE stops a running one for good (it is
    not stored when it ends)."""
    long = _long_background_stream(client, model_name)
    response_id = next(iter(long)).response.id
    for i in range(4):
        client.responses.create(model=model_name, input=f"Say {i}.", max_output_tokens=2)
    assert client.responses.retrieve(response_id).status == "in_progress"
    resumed = client.responses.retrieve(response_id, stream=True, starting_after=0)
    assert next(iter(resumed)).sequence_number == 1
    resumed.close()
    assert httpx.delete(f"{server.base_url}/responses/{response_id}").json()["deleted"]
    list(long)  # its stream ends
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(response_id)
    assert _running(httpx.get(server.url + "/metrics").text) == 0


def test_a_dropped_running_response_streams_only_if_it_was_streamed_and_deleted_is_gone(
        client, server, model_name):
    """A running background response made without `stream`, pushed out of the store: `GET
    ?stream=true` is the 400 naming `stream` it is while stored (was a 500); once deleted,
    cancelling it is a 404 as GET and DELETE are (was a 200 "cancelled" while it stopped)."""
    response_id = _long_background_stream(client, model_name, stream=False).id
    for i in range(4):
        client.responses.create(model=model_name, input=f"Say {i}.", max_output_tokens=2)
    assert client.responses.retrieve(response_id).status == "in_progress"
    streamed = httpx.get(f"{server.base_url}/responses/{response_id}", params={"stream": "true"})
    assert streamed.status_code == 400 and openai_error(streamed)["param"] == "stream"
    assert httpx.delete(f"{server.base_url}/responses/{response_id}").json()["deleted"]
    cancelled = httpx.post(f"{server.base_url}/responses/{response_id}/cancel")
    assert cancelled.status_code == 404, cancelled.text
    assert openai_error(cancelled)["code"] == "response_not_found"


def _running(metrics: str) -> float:
    import re

    return float(re.search(r"^ksana_llm:num_requests_running\S* (\S+)$", metrics, re.M)[1])


def test_the_store_keeps_the_most_recent(client, model_name):
    """--max-stored-responses 4: the fifth answer pushes out the least recently used."""
    ids = [client.responses.create(model=model_name, input=f"Count to {i}.",
                                   max_output_tokens=2).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(ids[0])
    assert [client.responses.retrieve(i).id for i in ids[1:]] == ids[1:]


def _long_background_stream(client, model_name, stream: bool = True):
    """A streamed background response that runs for hundreds of tokens: a JSON schema of 300
    numbers at least keeps EOS out until then (a sampled "count to a thousand" may stop after
    a dozen tokens)."""
    numbers = {"type": "object", "required": ["n"], "additionalProperties": False,
               "properties": {"n": {"type": "array", "items": {"type": "integer"},
                                    "minItems": 300}}}
    return client.responses.create(
        model=model_name, input="List three hundred numbers.", max_output_tokens=1500,
        background=True, stream=stream,
        text={"format": {"type": "json_schema", "name": "numbers", "schema": numbers}})


def test_a_server_that_stores_nothing_runs_nothing_in_the_background(default_model):
    """--max-stored-responses 0: a background response could never be polled: a 400 naming
    `background` (vLLM refuses it too), not an answer that is lost."""
    import asyncio

    import ksana_llm as kt
    from ksana_llm.server.app import build_app

    engine = kt.Engine(default_model, num_device_blocks=64)
    app = build_app(engine, served_model_name="m", max_stored_responses=0)

    async def main() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            return await http.post("/v1/responses", json={"input": "x", "background": True})

    try:
        response = asyncio.run(main())
    finally:
        engine.shutdown()
    assert response.status_code == 400 and response.json()["error"]["param"] == "background"
