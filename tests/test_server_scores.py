"""vLLM's score API (`/score`, `/v1/score`) and the rerank API (`/rerank`, `/v1/rerank`,
`/v2/rerank`) on a real server process, and `Engine.score`: each score is the cosine of
transformers' embeddings of the two texts (last-token state after the final norm, normalised)
on the same weights; pairs are formed 1:1, 1:N and N:N as vLLM forms them; rerank orders by that
score; every bad input is a 400 naming its field and the server keeps serving."""

from __future__ import annotations

import httpx
import pytest
import torch

from tests.hf_references import hf_embedding
from tests.server_process import ServerProcess, server_fixture

QUERY = "What is the capital of France?"
DOCUMENTS = ["The capital of Brazil is Brasilia.", "Paris is the capital of France.",
             "def add(a, b):\n    return a + b\n", "人工智能正在改变世界。"]


server = server_fixture(["--num-device-blocks", "128", "--max-model-len", "256"])


def _cosine(hf_model, tokenizer, a: str | list[int], b: str | list[int]) -> float:
    ids = [t if isinstance(t, list) else tokenizer.encode(t) for t in (a, b)]
    return float(hf_embedding(hf_model, ids[0]) @ hf_embedding(hf_model, ids[1]))


def _post(server: ServerProcess, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.base_url.removesuffix("/v1") + path, json=body, timeout=120)


@pytest.mark.parametrize("path", ["/score", "/v1/score"])
@pytest.mark.parametrize("text_1, text_2, pairs", [
    (QUERY, DOCUMENTS[1], [(QUERY, DOCUMENTS[1])]),
    (QUERY, DOCUMENTS, [(QUERY, d) for d in DOCUMENTS]),
    ([QUERY], DOCUMENTS[:2], [(QUERY, d) for d in DOCUMENTS[:2]]),
    (DOCUMENTS[:3], [QUERY, DOCUMENTS[0], DOCUMENTS[3]],
     [(DOCUMENTS[0], QUERY), (DOCUMENTS[1], DOCUMENTS[0]), (DOCUMENTS[2], DOCUMENTS[3])]),
])
def test_scores_are_transformers_cosines(server, hf_default_model, default_model, path, text_1,
                                         text_2, pairs):
    response = _post(server, path, {"model": "SmolLM2-135M-Instruct", "text_1": text_1,
                                    "text_2": text_2})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "list" and body["id"].startswith("score-")
    assert body["model"] == "SmolLM2-135M-Instruct"
    assert [d["index"] for d in body["data"]] == list(range(len(pairs)))
    assert all(d["object"] == "score" for d in body["data"])
    tokenizer = default_model.tokenizer
    expected = [_cosine(hf_default_model, tokenizer, a, b) for a, b in pairs]
    torch.testing.assert_close(torch.tensor([d["score"] for d in body["data"]]),
                               torch.tensor(expected), atol=1e-4, rtol=0)
    texts = [text_1] if isinstance(text_1, str) else list(text_1)
    texts += [text_2] if isinstance(text_2, str) else list(text_2)
    tokens = sum(len(tokenizer.encode(t)) for t in texts)
    # Each text is counted once, as it is embedded once.
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                             "completion_tokens": 0}


def test_a_text_scored_against_itself_is_one_and_token_ids_equal_text(server, default_model):
    ids = default_model.tokenizer.encode(QUERY)
    response = _post(server, "/score", {"text_1": ids, "text_2": [QUERY, QUERY]})
    scores = [d["score"] for d in response.json()["data"]]
    assert scores == pytest.approx([1.0, 1.0], abs=1e-5)


def test_truncate_prompt_tokens_scores_the_last_tokens(server, hf_default_model, default_model):
    tokenizer = default_model.tokenizer
    long_text = "Some preamble that will be cut away. " * 3 + DOCUMENTS[1]
    kept = tokenizer.encode(long_text)[-5:]
    response = _post(server, "/v1/score", {"text_1": QUERY, "text_2": long_text,
                                           "truncate_prompt_tokens": 5})
    assert response.status_code == 200, response.text
    query_ids = tokenizer.encode(QUERY)[-5:]
    assert response.json()["data"][0]["score"] == pytest.approx(
        _cosine(hf_default_model, tokenizer, query_ids, kept), abs=1e-4)


@pytest.mark.parametrize("path", ["/rerank", "/v1/rerank", "/v2/rerank"])
def test_rerank_orders_documents_by_their_score(server, default_model, path):
    default_tokenizer = default_model.tokenizer
    scored = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()["data"]
    expected = sorted(range(len(DOCUMENTS)), key=lambda i: scored[i]["score"], reverse=True)
    response = _post(server, path, {"model": "SmolLM2-135M-Instruct", "query": QUERY,
                                    "documents": DOCUMENTS, "top_n": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["id"].startswith("rerank-") and body["model"] == "SmolLM2-135M-Instruct"
    results = body["results"]
    assert [r["index"] for r in results] == expected[:3]
    for result in results:
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
        assert result["relevance_score"] == pytest.approx(scored[result["index"]]["score"],
                                                          abs=1e-5)
    tokens = len(default_tokenizer.encode(QUERY)) + sum(len(default_tokenizer.encode(d))
                                                        for d in DOCUMENTS)
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens}
    # No top_n (0 or less, as vLLM): every document; return_documents false leaves the text out.
    for extra in ({}, {"top_n": 0}, {"top_n": -1}):
        every = _post(server, path, {"query": QUERY, "documents": DOCUMENTS, **extra}).json()
        assert [r["index"] for r in every["results"]] == expected
    bare = _post(server, path, {"query": QUERY, "documents": DOCUMENTS,
                                "return_documents": False}).json()
    assert all("document" not in r for r in bare["results"])


@pytest.mark.parametrize("path, body, param", [
    ("/score", {"text_2": "x"}, "text_1"),
    ("/score", {"text_1": "x"}, "text_2"),
    ("/score", {"text_1": "", "text_2": "x"}, "text_1"),
    ("/score", {"text_1": "x", "text_2": []}, "text_2"),
    ("/score", {"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "text_2"),
    ("/score", {"text_1": "x", "text_2": "y", "truncate_prompt_tokens": 0},
     "truncate_prompt_tokens"),
    ("/score", {"text_1": "x", "text_2": "x " * 400}, "text_2"),  # past --max-model-len 256
    ("/score", {"text_1": "x " * 400, "text_2": "x"}, "text_1"),
    ("/rerank", {"query": "x " * 400, "documents": ["x"]}, "query"),
    ("/rerank", {"query": "x", "documents": ["x", "x " * 400]}, "documents"),
    ("/score", {"text_1": "x", "text_2": "y", "temperature": 1}, "temperature"),
    ("/rerank", {"documents": ["a"]}, "query"),
    ("/rerank", {"query": "q"}, "documents"),
    ("/rerank", {"query": "q", "documents": []}, "documents"),
    ("/rerank", {"query": "q", "documents": [1, 2]}, "documents.0"),
    ("/rerank", {"query": "q", "documents": ["a"], "top_n": 1.5}, "top_n"),
    # A FIFO server (vLLM's rule: a priority it would ignore is refused).
    ("/score", {"text_1": "x", "text_2": "y", "priority": 2}, "priority"),
    ("/rerank", {"query": "q", "documents": ["a"], "priority": -1}, "priority"),
])
def test_bad_input_is_a_400_naming_the_field(server, path, body, param):
    response = _post(server, path, body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and error["type"] == "invalid_request_error"
    assert _post(server, "/score", {"text_1": "a", "text_2": "b"}).status_code == 200


def test_unknown_model_is_404(server):
    response = _post(server, "/v1/score", {"model": "nope", "text_1": "a", "text_2": "b"})
    assert response.status_code == 404


def test_engine_score_equals_the_server(server, local_engine):
    """`Engine.score` (the Python API) gives the server's scores; bad input is a ValueError
    naming the field."""
    served = _post(server, "/score", {"text_1": QUERY, "text_2": DOCUMENTS}).json()["data"]
    scores = local_engine.score(QUERY, DOCUMENTS)
    assert scores == pytest.approx([d["score"] for d in served], abs=1e-5)
    assert local_engine.score(DOCUMENTS[:2], DOCUMENTS[2:]) == pytest.approx(
        [d["score"] for d in _post(server, "/score", {"text_1": DOCUMENTS[:2],
                                                      "text_2": DOCUMENTS[2:]}).json()["data"]],
        abs=1e-5)
    for args, field in [(([], "x"), "text_1"), (("x", []), "text_2"),
                        ((["a", "b"], ["a", "b", "c"]), "text_2"),
                        (("a", [{"prompt": "b"}]), "text_2")]:
        with pytest.raises(ValueError, match=field):
            local_engine.score(*args)


def test_classify_on_a_language_model_is_a_400(server, local_engine):
    """A language model has no classes: /classify (and /v1/classify) say so, as vLLM answers a
    model that does not classify; `Engine.classify` raises ValueError."""
    for path in ("/classify", "/v1/classify"):
        response = _post(server, path, {"input": "a"})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == "model" and error["code"] == "model_not_supported"
    with pytest.raises(ValueError, match="needs a sequence-classification model"):
        local_engine.classify("a")
