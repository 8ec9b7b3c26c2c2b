"""LoRA adapters over HTTP on a real server process (SmolLM2), driven by the official `openai`
client: `--lora-modules` serves each adapter under its name (`model`), /v1/models lists them, and
with `--allow-runtime-lora-updating` adapters load and unload while the server runs. Every
adapter's output equals PEFT's on the same weights and adapter files. The server has one slot
(`--max-loras 1`) for its three adapters, so they take turns in it."""

from __future__ import annotations

import threading
import time

import httpx
import openai
import pytest
import torch

from tests.family_harness import greedy_trace, hf_reference
from tests.lora_adapters import ALL_TARGETS, make_adapter
from tests.server_process import ServerProcess

BASE = "SmolLM2-135M-Instruct"
PROMPT = "The three primary colors are"
NUM_TOKENS = 10
# Small enough that the adapted model still writes text, large enough to change it.
B_STD = 0.02


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, hf_default_model):
    folder = tmp_path_factory.mktemp("adapters")
    return folder, {
        "sql": make_adapter(hf_default_model, folder / "sql", seed=1, targets=ALL_TARGETS,
                            rank=8, b_std=B_STD),
        "tone": make_adapter(hf_default_model, folder / "tone", seed=2,
                             targets=["q_proj", "v_proj"], rank=4, b_std=B_STD * 3),
        "late": make_adapter(hf_default_model, folder / "late", seed=3,
                             targets=["o_proj", "down_proj"], rank=4, b_std=B_STD),
    }


@pytest.fixture(scope="module")
def server(adapters, default_model_dir):
    folder, _ = adapters
    proc = ServerProcess(["--num-device-blocks", "128", "--max-model-len", "256",
                          "--lora-modules", f"sql={folder / 'sql'}", f"tone={folder / 'tone'}",
                          "--max-loras", "1", "--allow-runtime-lora-updating"])
    yield proc
    proc.stop()


def greedy_text(model: torch.nn.Module, tokenizer, ids: list[int]) -> str:
    tokens = greedy_trace(hf_reference(model), ids, NUM_TOKENS)[0][len(ids):]
    return tokenizer.decode(tokens, skip_special_tokens=True)


def test_models_lists_adapters(client, adapters, default_model_dir):
    folder, _ = adapters
    cards = {card.id: card for card in client.models.list().data}
    assert set(cards) == {BASE, "sql", "tone"}
    assert cards["sql"].parent == BASE and cards["sql"].root == str(folder / "sql")
    assert getattr(cards[BASE], "parent", None) is None
    assert cards[BASE].root == str(default_model_dir)  # where the weights came from, as vLLM
    assert client.models.retrieve("sql") == cards["sql"]


def test_each_model_name_gets_its_adapter(client, adapters, hf_default_model, default_model):
    """Completions for the base and both adapters, sent together: each equals its PEFT model's
    greedy text, and each response names the model it was asked for."""
    _, peft_models = adapters
    tokenizer = default_model.tokenizer
    ids = tokenizer.encode(PROMPT)
    references = {BASE: hf_default_model, "sql": peft_models["sql"], "tone": peft_models["tone"]}
    texts = {}
    for name in references:
        response = client.completions.create(model=name, prompt=PROMPT, max_tokens=NUM_TOKENS,
                                             temperature=0)
        assert response.model == name
        texts[name] = response.choices[0].text
    for name, model in references.items():
        assert texts[name] == greedy_text(model, tokenizer, ids), name
    assert len(set(texts.values())) == 3  # the adapters really change the text


def test_streamed_chat_and_embeddings_use_the_adapter(client, adapters, default_model):
    _, peft_models = adapters
    tokenizer = default_model.tokenizer
    messages = [{"role": "user", "content": "Name a fruit."}]
    ids = tokenizer.encode(tokenizer.apply_chat_template(messages, add_generation_prompt=True,
                                                         tokenize=False))
    stream = client.chat.completions.create(model="tone", messages=messages,
                                            max_tokens=NUM_TOKENS, temperature=0, stream=True)
    chunks = list(stream)
    assert {chunk.model for chunk in chunks} == {"tone"}
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == greedy_text(peft_models["tone"], tokenizer, ids)

    response = client.embeddings.create(model="sql", input=PROMPT)
    assert response.model == "sql"
    prompt_ids = tokenizer.encode(PROMPT)
    with torch.no_grad():
        hidden = peft_models["sql"].base_model.model.model(
            torch.tensor([prompt_ids])).last_hidden_state[0, -1]
    torch.testing.assert_close(torch.tensor(response.data[0].embedding),
                               torch.nn.functional.normalize(hidden, dim=0), atol=2e-5, rtol=1e-4)


def test_load_and_unload_over_http(server, client, adapters, default_model):
    folder, peft_models = adapters
    tokenizer = default_model.tokenizer
    load = server.url + "/v1/load_lora_adapter"
    unload = server.url + "/v1/unload_lora_adapter"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    response = httpx.post(load, json={"lora_name": "late", "lora_path": str(folder / "late")})
    assert response.status_code == 200, response.text
    assert "late" in {card.id for card in client.models.list().data}
    text = client.completions.create(model="late", prompt=PROMPT, max_tokens=NUM_TOKENS,
                                     temperature=0).choices[0].text
    assert text == greedy_text(peft_models["late"], tokenizer, tokenizer.encode(PROMPT))

    refusals = [
        (load, {"lora_name": "late", "lora_path": str(folder / "sql")}, "lora_name"),
        (load, {"lora_name": "x", "lora_path": str(folder / "missing")}, "lora_path"),
        (load, {"lora_name": BASE, "lora_path": str(folder / "sql")}, "lora_name"),
        (load, {"lora_name": "x"}, "lora_path"),
    ]
    for url, body, param in refusals:
        response = httpx.post(url, json=body)
        assert response.status_code == 400, (body, response.text)
        assert response.json()["error"]["param"] == param, response.text
    # vLLM's load_inplace: the name serves another adapter.
    response = httpx.post(load, json={"lora_name": "late", "lora_path": str(folder / "sql"),
                                      "load_inplace": True})
    assert response.status_code == 200, response.text
    text = client.completions.create(model="late", prompt=PROMPT, max_tokens=NUM_TOKENS,
                                     temperature=0).choices[0].text
    assert text == greedy_text(peft_models["sql"], tokenizer, tokenizer.encode(PROMPT))
    response = httpx.post(unload, json={"lora_name": "nope"})  # vLLM's answer: 404
    assert response.status_code == 404 and response.json()["error"]["param"] == "lora_name"

    assert httpx.post(unload, json={"lora_name": "late"}).status_code == 200
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="late", prompt=PROMPT, max_tokens=2)
    # Still serving everyone else.
    assert client.completions.create(model="sql", prompt=PROMPT, max_tokens=2).choices[0].text


def test_metrics_name_the_adapters_in_use(server):
    """vLLM's `lora_requests_info` gauge: the slots, and the adapters of running and waiting
    requests. With the one slot held by a running `tone` request, a `sql` request waits, and
    runs once `tone`'s request is gone."""
    from prometheus_client.parser import text_string_to_metric_families

    def info() -> dict[str, str]:
        text = httpx.get(server.url + "/metrics").text
        (family,) = [f for f in text_string_to_metric_families(text)
                     if f.name == "ksana_llm:lora_requests_info"]
        return family.samples[0].labels

    assert (info()["max_lora"], info()["running_lora_adapters"]) == ("1", "")
    body = {"model": "tone", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True,
            "stream": True}
    waiting_sql: list[httpx.Response] = []
    sql = threading.Thread(target=lambda: waiting_sql.append(httpx.post(
        server.base_url + "/completions", json={"model": "sql", "prompt": PROMPT,
                                                "max_tokens": 4}, timeout=120)))
    with httpx.stream("POST", server.base_url + "/completions", json=body, timeout=60) as r:
        lines = r.iter_lines()  # kept: a dropped iterator closes the connection (an abort)
        next(line for line in lines if line.startswith("data:"))  # it runs
        sql.start()
        deadline = time.monotonic() + 30
        while info()["waiting_lora_adapters"] != "sql" and time.monotonic() < deadline:
            time.sleep(0.05)
        running = info()
    assert (running["running_lora_adapters"], running["waiting_lora_adapters"]) == ("tone", "sql")
    sql.join(timeout=120)  # the closed stream aborted `tone`: `sql` takes the slot
    assert waiting_sql and waiting_sql[0].status_code == 200, waiting_sql


def test_router_sends_adapter_requests_to_a_decode_server_whole(server, client):
    """Adapter requests are not disaggregated (their KV does not say which adapter computed
    it): the prefill server's refusal sends the first one straight to a decode server, with no
    failure counted, and later ones skip the prefill server."""
    router = ServerProcess(["--prefill", server.url, "--decode", server.url], command="router")
    try:
        routed = openai.OpenAI(base_url=router.base_url, api_key="unused", max_retries=0,
                               timeout=60)
        for _ in range(2):
            text = routed.completions.create(model="sql", prompt=PROMPT, max_tokens=NUM_TOKENS,
                                             temperature=0).choices[0].text
            assert text == client.completions.create(model="sql", prompt=PROMPT,
                                                     max_tokens=NUM_TOKENS,
                                                     temperature=0).choices[0].text
        health = httpx.get(router.url + "/health").json()
        assert (health["num_direct"], health["num_prefill_failures"]) == (2, 0)
    finally:
        router.stop()
