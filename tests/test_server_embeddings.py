"""`POST /v1/embeddings` on a real server process, driven by the official `openai` client: each
vector is transformers' last-token hidden state (after the final norm), L2-normalised, on the
same weights (of the last tokens only, with `truncate_prompt_tokens`); base64 and float encodings
agree; every bad input is a 400 naming the parameter and the server keeps serving."""

from __future__ import annotations

import base64

import httpx
import openai
import pytest
import torch

from ksana_llm.server.embedding_protocol import MAX_EMBEDDING_INPUTS
from tests.hf_references import hf_embedding, hf_last_token_state
from tests.server_process import server_fixture
from tests.tolerances import EMBEDDING_ATOL

TEXTS = ["The capital of France is Paris.", "def add(a, b):\n    return a + b\n",
         "人工智能正在改变世界。", "A"]


server = server_fixture(["--num-device-blocks", "128", "--max-model-len", "256"])


def test_vectors_equal_transformers_last_token_state(client, hf_default_model, default_model):
    tokenizer = default_model.tokenizer
    # The openai client asks for base64 and decodes it itself.
    response = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)
    assert [d.index for d in response.data] == list(range(len(TEXTS)))
    ids = [tokenizer.encode(t) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(map(len, ids))
    for item, prompt in zip(response.data, ids):
        vector = torch.tensor(item.embedding)
        assert vector.shape == (default_model.hf_config.hidden_size,)
        torch.testing.assert_close(vector, hf_embedding(hf_default_model, prompt), atol=2e-5,
                                   rtol=1e-4)
    # Different texts, different directions.
    a, b = (torch.tensor(response.data[i].embedding) for i in (0, 1))
    assert float(a @ b) < 0.99


def test_truncate_prompt_tokens_embeds_the_last_tokens(client, hf_default_model, default_model):
    """vLLM's truncate_prompt_tokens: the vector of the input's last k tokens, counted as k."""
    text = "Some preamble that will be cut away. " * 3 + TEXTS[0]
    kept = default_model.tokenizer.encode(text)[-6:]
    response = client.embeddings.create(model="SmolLM2-135M-Instruct", input=[text, TEXTS[3]],
                                        extra_body={"truncate_prompt_tokens": 6})
    assert response.usage.prompt_tokens == 6 + len(default_model.tokenizer.encode(TEXTS[3]))
    torch.testing.assert_close(torch.tensor(response.data[0].embedding),
                               hf_embedding(hf_default_model, kept), atol=2e-5, rtol=1e-4)


def test_float_encoding_and_token_inputs_agree(client, default_model):
    ids = default_model.tokenizer.encode(TEXTS[0])
    as_text = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS[0],
                                       encoding_format="float")
    assert isinstance(as_text.data[0].embedding[0], float)
    for tokens in (ids, [ids, ids]):
        response = client.embeddings.create(model="SmolLM2-135M-Instruct", input=tokens)
        for item in response.data:
            torch.testing.assert_close(torch.tensor(item.embedding),
                                       torch.tensor(as_text.data[0].embedding), atol=1e-6, rtol=0)
    full = client.embeddings.create(model="SmolLM2-135M-Instruct", input="Hi",
                                    dimensions=default_model.hf_config.hidden_size)
    assert len(full.data[0].embedding) == default_model.hf_config.hidden_size


def test_chat_messages_embed_their_rendered_template(server, hf_default_model, default_model):
    """vLLM's chat form: `messages` rendered by the chat template (no generation prompt unless
    asked, no special tokens on top of the template's) and embedded as one input."""
    tokenizer = default_model.tokenizer
    messages = [{"role": "system", "content": "You sort fruit."},
                {"role": "user", "content": "Where do lemons go?"}]
    for extra, generation_prompt in (({}, False), ({"add_generation_prompt": True}, True)):
        response = httpx.post(server.base_url + "/embeddings", timeout=60,
                              json={"messages": messages, **extra})
        assert response.status_code == 200, response.text
        ids = tokenizer.encode(tokenizer.apply_chat_template(
            messages, add_generation_prompt=generation_prompt, tokenize=False),
            add_special_tokens=False)
        body = response.json()
        assert body["usage"]["prompt_tokens"] == len(ids)
        torch.testing.assert_close(torch.tensor(body["data"][0]["embedding"]),
                                   hf_embedding(hf_default_model, ids), atol=2e-5, rtol=1e-4)
    # `add_special_tokens` is accepted on both forms (vLLM's field; SmolLM2 adds none).
    plain = httpx.post(server.base_url + "/embeddings", timeout=60,
                       json={"input": TEXTS[0], "add_special_tokens": False}).json()
    assert plain["usage"]["prompt_tokens"] == len(tokenizer.encode(TEXTS[0],
                                                                   add_special_tokens=False))


@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": "Hi", "messages": [{"role": "user", "content": "Hi"}]}, "input"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "robot", "content": "Hi"}]}, "messages.0.role"),
    ({"input": ""}, "input"),
    ({"input": []}, "input"),
    ({"input": [[]]}, "input"),
    ({"input": [10**9]}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x " * 400}, "input"),  # longer than --max-model-len 256
    ({"input": "Hi", "dimensions": 17}, "dimensions"),
    ({"input": "Hi", "encoding_format": "int8"}, "encoding_format"),
    ({"input": "Hi", "temperature": 1}, "temperature"),
    ({"input": "Hi", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ({"input": "Hi", "priority": 1}, "priority"),  # a FIFO server: vLLM's rule
])
def test_bad_input_is_a_400_naming_the_parameter(server, body, param):
    response = httpx.post(server.base_url + "/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert error["message"]
    if "x " * 400 in str(body.get("input")):  # OpenAI's code for it, as completions and chat
        assert error["code"] == "context_length_exceeded", error


def test_the_most_inputs_fit_a_default_server(server):
    """2,048 inputs, more than the engine takes at once by default (max_num_seqs 256 +
    max_queue_size 1000): they are queued as room frees, never refused with a 429."""
    texts = [f"item {i}" for i in range(MAX_EMBEDDING_INPUTS)]
    response = httpx.post(server.base_url + "/embeddings", timeout=600,
                          json={"input": texts, "encoding_format": "base64"})
    assert response.status_code == 200, response.text
    data = response.json()["data"]
    assert [d["index"] for d in data] == list(range(MAX_EMBEDDING_INPUTS))
    assert len({d["embedding"] for d in data[:8]}) == 8  # base64 strings: distinct vectors


def test_pooling_api_gives_a_language_model_its_embeddings(server, hf_default_model,
                                                          default_model):
    """vLLM's `/pooling`: a language model's pooled output is its embedding (`task` "embed",
    the default here), floats or base64; "classify" is a 400 naming `task`'s model, and an
    unknown task one naming `task`."""
    url = server.url + "/pooling"
    body = httpx.post(url, json={"input": TEXTS[:2]}, timeout=60).json()
    assert body["object"] == "list" and body["id"].startswith("pool-")
    ids = [default_model.tokenizer.encode(t) for t in TEXTS[:2]]
    assert body["usage"]["prompt_tokens"] == sum(map(len, ids))
    for item, index, prompt in zip(body["data"], range(2), ids):
        assert item["object"] == "pooling" and item["index"] == index
        torch.testing.assert_close(torch.tensor(item["data"]),
                                   hf_embedding(hf_default_model, prompt), atol=2e-5, rtol=1e-4)
    packed = httpx.post(url, json={"input": TEXTS[0], "task": "embed",
                                   "encoding_format": "base64"}, timeout=60).json()
    vector = torch.frombuffer(bytearray(base64.b64decode(packed["data"][0]["data"])),
                              dtype=torch.float32)
    torch.testing.assert_close(vector, torch.tensor(body["data"][0]["data"]), atol=1e-6,
                               rtol=0)
    for request, param in (({"input": "Hi", "task": "classify"}, "model"),
                           ({"input": "Hi", "task": "token_classify"}, "model"),
                           ({"input": "Hi", "task": "tokens"}, "task"),
                           ({"input": ""}, "input")):
        response = httpx.post(url, json=request, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_pooling_token_embed_gives_every_position(server, hf_default_model, default_model):
    """vLLM's `token_embed`: one row per prompt token, transformers' final-norm state at that
    position, each row unit length (`normalize: false`: the states as they are); base64 sends
    the rows one after the other."""
    url = server.url + "/pooling"
    prompts = [default_model.tokenizer.encode(t) for t in TEXTS[:2]]
    body = httpx.post(url, json={"input": TEXTS[:2], "task": "token_embed"}, timeout=60).json()
    assert body["usage"]["prompt_tokens"] == sum(map(len, prompts))
    for item, prompt in zip(body["data"], prompts):
        with torch.no_grad():
            states = hf_default_model.model(torch.tensor([prompt])).last_hidden_state[0]
        rows = torch.tensor(item["data"])
        assert rows.shape == (len(prompt), default_model.hf_config.hidden_size)
        torch.testing.assert_close(rows, torch.nn.functional.normalize(states, dim=-1),
                                   atol=2e-5, rtol=1e-4)
    raw = httpx.post(url, json={"input": TEXTS[0], "task": "token_embed", "normalize": False},
                     timeout=60).json()["data"][0]["data"]
    with torch.no_grad():
        states = hf_default_model.model(torch.tensor([prompts[0]])).last_hidden_state[0]
    torch.testing.assert_close(torch.tensor(raw), states, atol=1e-4, rtol=1e-4)
    packed = httpx.post(url, json={"input": TEXTS[0], "task": "token_embed",
                                   "encoding_format": "base64"}, timeout=60).json()
    flat = torch.frombuffer(bytearray(base64.b64decode(packed["data"][0]["data"])),
                            dtype=torch.float32)
    torch.testing.assert_close(flat, torch.tensor(body["data"][0]["data"]).flatten(), atol=1e-6,
                               rtol=0)
    response = httpx.post(url, json={"input": "Hi", "task": "token_embed", "dimensions": 7},
                          timeout=60)
    assert response.status_code == 400 and response.json()["error"]["param"] == "dimensions"


def test_normalize_false_gives_the_state_itself(server, client, hf_default_model,
                                                default_model):
    """vLLM's `normalize: false`, on /v1/embeddings and /pooling: transformers' last-token state
    as it is (its length far from 1); `dimensions` equal to the hidden size is served on both,
    any other a 400 naming it on /pooling too."""
    prompt = default_model.tokenizer.encode(TEXTS[0])
    expected = hf_last_token_state(hf_default_model, prompt)
    assert abs(float(expected.norm()) - 1) > 0.5
    hidden = default_model.hf_config.hidden_size
    response = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS[0],
                                        dimensions=hidden, extra_body={"normalize": False})
    torch.testing.assert_close(torch.tensor(response.data[0].embedding), expected, atol=1e-4,
                               rtol=1e-4)
    body = httpx.post(server.url + "/pooling", timeout=60,
                      json={"input": TEXTS[0], "normalize": False, "dimensions": hidden}).json()
    torch.testing.assert_close(torch.tensor(body["data"][0]["data"]), expected, atol=1e-4,
                               rtol=1e-4)
    for request, param in (({"input": "Hi", "dimensions": 17}, "dimensions"),
                           ({"input": "Hi", "normalize": "maybe"}, "normalize")):
        response = httpx.post(server.url + "/pooling", json=request, timeout=60)
        assert response.status_code == 400 and response.json()["error"]["param"] == param


def test_unknown_model_is_404_and_the_server_keeps_serving(client, server):
    response = httpx.post(server.base_url + "/embeddings",
                          json={"input": "Hi", "model": "no-such-model"}, timeout=60)
    assert response.status_code == 404
    with pytest.raises(openai.BadRequestError):
        client.embeddings.create(model="SmolLM2-135M-Instruct", input="")
    assert len(client.embeddings.create(model="SmolLM2-135M-Instruct", input="ok").data) == 1


def test_engine_embed_equals_the_server(client, local_engine, hf_default_model):
    """The Python API's `Engine.embed` gives the server's vectors (one definition), in order,
    also past a full queue; a bad prompt raises ValueError and the engine keeps serving."""
    vectors = local_engine.embed(TEXTS)
    assert vectors.shape == (len(TEXTS), local_engine.model.hf_config.hidden_size)
    served = client.embeddings.create(model="SmolLM2-135M-Instruct", input=TEXTS)
    for vector, item in zip(vectors, served.data):
        torch.testing.assert_close(vector, torch.tensor(item.embedding), atol=EMBEDDING_ATOL,
                                   rtol=0)
    ids = local_engine.tokenizer.encode(TEXTS[0])
    torch.testing.assert_close(local_engine.embed(ids)[0], hf_embedding(hf_default_model, ids),
                               atol=2e-5, rtol=1e-4)
    with pytest.raises(ValueError, match="prompt"):
        local_engine.embed(["fine", ""])
    assert local_engine.embed("still serving").shape[0] == 1
    import ksana_llm as kt

    # One running, one waiting: submitting four makes embed wait for room (QueueFullError).
    with kt.Engine(local_engine.model, num_device_blocks=64, max_queue_size=1,
                   max_num_seqs=1) as small:
        # Alone, a text of one or two tokens may take F.linear where batched it took the
        # prepacked weights (see layers.linear.prepacked_wins_few_rows): last-bit differences.
        torch.testing.assert_close(small.embed(TEXTS), vectors, atol=1e-5, rtol=0)
