"""Request priority over HTTP (vLLM's `priority` field with `--scheduling-policy priority`), on a
real server process driven by the official `openai` client: requests queued behind a running
one start lowest `priority` first, whatever order they arrived in, on the completions, chat and
Responses routes alike, embeddings (forward-only requests) among them. (A FIFO server refusing
`priority` is in test_server_openai.py, test_server_responses.py, test_server_embeddings.py and
test_server_scores.py.)"""

from __future__ import annotations

import re
import threading
import time

import httpx
import pytest

from tests.server_process import ServerProcess


@pytest.fixture(scope="module")
def server(default_model_dir):
    # One sequence at a time: whoever the scheduler admits next runs (and finishes) next.
    proc = ServerProcess(["--num-device-blocks", "128", "--max-model-len", "512",
                          "--max-num-seqs", "1", "--scheduling-policy", "priority"])
    yield proc
    proc.stop()


def _num_waiting(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^ksana_llm:num_requests_waiting\S* (\S+)$", text, re.M)[1])


def test_queued_requests_start_lowest_priority_first(client, server, model_name):
    # Each route answers once first: a route's first answer builds things it keeps, which
    # took longer than a whole 2-token request, and would reorder the finishes below.
    client.completions.create(model=model_name, prompt="Hello", max_tokens=1)
    client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=1)
    client.responses.create(model=model_name, input="Hi", max_output_tokens=1)
    client.embeddings.create(model=model_name, input="Hi")
    # The most urgent of all, so none of the queued requests preempts it.
    blocker = client.completions.create(model=model_name, prompt="Count from one:",
                                        max_tokens=400, stream=True,
                                        extra_body={"ignore_eos": True, "priority": -10})
    next(iter(blocker))  # it runs: the next requests queue behind it
    finished: list[str] = []
    calls = {
        "completion, priority 5": lambda: client.completions.create(
            model=model_name, prompt="Hello", max_tokens=2, extra_body={"priority": 5}),
        "chat, priority 0": lambda: client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2),
        "responses, priority -5": lambda: client.responses.create(
            model=model_name, input="Hi", max_output_tokens=2, extra_body={"priority": -5}),
        "chat, priority -1": lambda: client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hey"}], max_tokens=2,
            extra_body={"priority": -1}),
        "embeddings, priority -3": lambda: client.embeddings.create(
            model=model_name, input="Hi", extra_body={"priority": -3}),
    }

    def run(name: str) -> None:
        calls[name]()
        finished.append(name)

    threads = []
    for name in calls:  # arrival order: the dict's
        threads.append(threading.Thread(target=run, args=(name,)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while _num_waiting(server) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert _num_waiting(server) == len(calls)  # all queued while the blocker still runs
    blocker.close()  # the client leaves: the blocker is aborted and the queue drains
    for thread in threads:
        thread.join(timeout=60)
    assert finished == ["responses, priority -5", "embeddings, priority -3", "chat, priority -1",
                        "chat, priority 0", "completion, priority 5"]


def _num_preemptions(server: ServerProcess) -> float:
    text = httpx.get(server.url + "/metrics", timeout=10).text
    return float(re.search(r"^ksana_llm:num_preemptions_total\S* (\S+)$", text, re.M)[1])


def test_an_urgent_request_preempts_a_less_urgent_running_one(client, server, model_name):
    """vLLM's priority preemption: with the one sequence slot held by a long priority-5
    request, a priority-0 one preempts it rather than waiting for its 300 tokens; the
    preempted request then finishes with all its tokens."""
    before = _num_preemptions(server)
    long_stream = client.completions.create(model=model_name, prompt="Count from one:",
                                            max_tokens=300, stream=True,
                                            extra_body={"ignore_eos": True, "priority": 5,
                                                        "stream_options": {
                                                            "include_usage": True}})
    chunks = iter(long_stream)
    next(chunks)  # it runs
    urgent = client.completions.create(model=model_name, prompt="Hello", max_tokens=2,
                                       extra_body={"priority": 0})
    assert urgent.usage.completion_tokens == 2
    assert _num_preemptions(server) > before  # it did not wait for the long one to finish
    rest = list(chunks)
    assert rest[-1].usage.completion_tokens == 300
    assert [c.choices[0].finish_reason for c in rest if c.choices][-1] == "length"


@pytest.fixture(scope="module")
def sjf_server(default_model_dir):
    # A policy of one's own, by import path (tests/scheduling_policies.py, shortest prompt first).
    proc = ServerProcess(["--num-device-blocks", "128", "--max-model-len", "512",
                          "--max-num-seqs", "1", "--scheduling-policy",
                          "tests.scheduling_policies:ShortestPromptFirst"])
    yield proc
    proc.stop()


def test_a_policy_named_by_import_path_orders_the_queue(sjf_server, model_name):
    import openai

    client = openai.OpenAI(base_url=sjf_server.base_url, api_key="unused")
    client.completions.create(model=model_name, prompt="Hello", max_tokens=1)
    client.chat.completions.create(model=model_name, messages=[{"role": "user", "content": "Hi"}],
                                   max_tokens=1)
    blocker = client.completions.create(model=model_name, prompt="Count from one:",
                                        max_tokens=400, stream=True, extra_body={"ignore_eos": True})
    next(iter(blocker))
    finished: list[str] = []
    calls = {  # arrival order: longest prompt first (the chat template's system turn is long)
        "long": lambda: client.chat.completions.create(
            model=model_name, messages=[{"role": "user", "content": "Hi"}], max_tokens=2),
        "mid": lambda: client.completions.create(
            model=model_name, prompt="Name three colours of the rainbow:", max_tokens=2),
        "short": lambda: client.completions.create(model=model_name, prompt="Hi", max_tokens=2),
    }

    def run(name: str) -> None:
        calls[name]()
        finished.append(name)

    threads = []
    for name in calls:
        threads.append(threading.Thread(target=run, args=(name,)))
        threads[-1].start()
        deadline = time.monotonic() + 30
        while _num_waiting(sjf_server) < len(threads) and time.monotonic() < deadline:
            time.sleep(0.02)
    assert _num_waiting(sjf_server) == len(calls)
    blocker.close()
    for thread in threads:
        thread.join(timeout=60)
    assert finished == ["short", "mid", "long"]
    # This policy does not rank by priority: a priority would be ignored, so it is refused.
    with pytest.raises(openai.BadRequestError) as err:
        client.completions.create(model=model_name, prompt="Hi", max_tokens=1,
                                  extra_body={"priority": 3})
    assert err.value.body["param"] == "priority"
