"""Sequence-classification models (transformers' `*ForSequenceClassification`: classifiers,
reward models, cross-encoder rerankers) against transformers on the same tiny random weights:
`Engine.classify`'s logits, probabilities and labels; a one-label model's `Engine.score` as a
cross-encoder; and over HTTP on a real server process, `/classify`, `/score` and `/rerank`
with the refusals (generation, LM logits, scoring with several labels, classifying with a
language model) as 400s naming the field."""

from __future__ import annotations

import asyncio
import subprocess
import sys

import httpx
import pytest
import torch
from transformers import (AutoTokenizer, Gemma2Config, Gemma2ForSequenceClassification,
                          Gemma3TextConfig, Gemma3TextForSequenceClassification,
                          GemmaConfig, GemmaForSequenceClassification, LlamaConfig,
                          LlamaForSequenceClassification, Qwen2Config,
                          Qwen2ForSequenceClassification, Qwen3Config, Qwen3ForCausalLM,
                          Qwen3ForSequenceClassification)

import ksana_llm as kt
from ksana_llm.server.model_tasks import check_model_task
from tests.server_process import ServerProcess, openai_error
from tests.tiny_models import perturb_biases_and_norms

TEXTS = ["I love this movie, it was wonderful.", "terrible", "The capital of France is Paris.",
         "def add(a, b):\n    return a + b\n"]
QUERY = "What is the capital of France?"
DOCUMENTS = ["Paris is the capital of France.", "Bananas are yellow.", "Berlin",
             "France's capital city is Paris, on the Seine."]
SHAPE = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=512)


def _save(folder, hf_model, tokenizer) -> None:
    perturb_biases_and_norms(hf_model)
    hf_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)


@pytest.fixture(scope="module")
def tokenizer(default_model_dir):
    return AutoTokenizer.from_pretrained(default_model_dir)


def _classifier(kind: str, tokenizer, num_labels: int, **extra):
    torch.manual_seed(len(kind) + num_labels)
    common = dict(SHAPE, vocab_size=len(tokenizer), num_labels=num_labels,
                  pad_token_id=tokenizer.pad_token_id or 0, **extra)
    if kind == "llama":
        return LlamaForSequenceClassification(LlamaConfig(**common)).eval()
    if kind == "qwen2":
        return Qwen2ForSequenceClassification(Qwen2Config(**common)).eval()
    if kind == "gemma":
        return GemmaForSequenceClassification(GemmaConfig(**common, head_dim=16)).eval()
    if kind == "gemma2":  # a 4-token window on the first layer; logits capped at 50
        return Gemma2ForSequenceClassification(Gemma2Config(
            **common, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"])).eval()
    if kind == "gemma3":  # a 4-token window on the first layer: the test texts outrun it
        return Gemma3TextForSequenceClassification(Gemma3TextConfig(
            **common, head_dim=16, sliding_window=4, query_pre_attn_scalar=16,
            layer_types=["sliding_attention", "full_attention"])).eval()
    return Qwen3ForSequenceClassification(Qwen3Config(**common, head_dim=32)).eval()


@pytest.fixture(scope="module")
def reranker(tmp_path_factory, tokenizer):
    """A one-label Llama classifier (a cross-encoder's shape) and its folder."""
    folder = tmp_path_factory.mktemp("reranker")
    hf = _classifier("llama", tokenizer, 1)
    _save(folder, hf, tokenizer)
    return hf, folder


def _hf_logits(hf, tokenizer, *texts) -> torch.Tensor:
    with torch.no_grad():
        return hf(**tokenizer(*texts, return_tensors="pt")).logits[0].float()


@pytest.mark.parametrize("kind,labels,extra", [
    ("llama", 3, dict(id2label={0: "negative", 1: "neutral", 2: "positive"},
                      label2id={"negative": 0, "neutral": 1, "positive": 2},
                      tie_word_embeddings=False)),
    ("qwen2", 2, dict(tie_word_embeddings=True)),
    ("qwen3", 4, dict(problem_type="multi_label_classification", tie_word_embeddings=False)),
    ("gemma", 2, dict()),
    ("gemma2", 2, dict()),
    ("gemma3", 3, dict()),
])
def test_classify_equals_transformers(tmp_path, tokenizer, kind, labels, extra):
    hf = _classifier(kind, tokenizer, labels, **extra)
    _save(tmp_path, hf, tokenizer)
    # Read back as the engine reads it: transformers picks the tokenizer class by the
    # config's model type (a Qwen2 folder's pre-tokenizes "\n    " otherwise).
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    model = kt.Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)
    assert model.classifier is not None and model.classifier.num_labels == labels
    assert model.module._lm_head_packed is None  # the stand-in LM head gets no second copy
    engine = kt.Engine(model, max_num_seqs=4, max_queue_size=1)  # 4 prompts wait for room
    outputs = engine.classify(TEXTS)
    assert len(outputs) == len(TEXTS)
    # (Batched as the engine's steps fell: equal to rounding.)
    for out, again in zip(outputs, asyncio.run(engine.classify_async(TEXTS))):
        assert again.logits == pytest.approx(out.logits, abs=1e-5) and again.label == out.label
    names = [hf.config.id2label[i] for i in range(labels)]
    for text, out in zip(TEXTS, outputs):
        reference = _hf_logits(hf, tokenizer, text)
        torch.testing.assert_close(torch.tensor(out.logits), reference, atol=2e-5, rtol=1e-4)
        expected = (torch.sigmoid(reference) if kind == "qwen3"
                    else torch.softmax(reference, dim=-1))
        torch.testing.assert_close(torch.tensor(out.probs), expected, atol=2e-5, rtol=1e-4)
        assert out.num_classes == labels
        assert out.label == names[int(reference.argmax())]
        assert out.num_prompt_tokens == len(tokenizer.encode(text))
    # The last 3 tokens only: transformers on those tokens.
    kept = tokenizer.encode(TEXTS[0])[-3:]
    cut = engine.classify(TEXTS[0], truncate_prompt_tokens=3)[0]
    with torch.no_grad():
        torch.testing.assert_close(torch.tensor(cut.logits), hf(torch.tensor([kept])).logits[0],
                                   atol=2e-5, rtol=1e-4)
    # A classifier does not generate, and has no language-model logits to give.
    with pytest.raises(ValueError, match="^model: a sequence-classification model does not"):
        engine.generate("Hello")
    with pytest.raises(ValueError, match=r"^targets\[0\]: .* no language-model logits"):
        engine.forward("Hello", [{"target_name": "logits"}])
    with pytest.raises(ValueError, match=f"has {labels} labels; scoring pairs needs a one-label"):
        engine.score("a", "b")
    assert model.classifier.labels == tuple(names)


def test_reranker_scores_pairs_read_together(reranker, tokenizer):
    hf, folder = reranker
    model = kt.Model.from_pretrained(folder, device="cpu", dtype="float32", progress=False)
    engine = kt.Engine(model, max_num_seqs=4)
    scores = engine.score(QUERY, DOCUMENTS)
    expected = [float(torch.sigmoid(_hf_logits(hf, tokenizer, QUERY, d))[0]) for d in DOCUMENTS]
    assert scores == pytest.approx(expected, abs=2e-5)
    assert asyncio.run(engine.score_async(QUERY, DOCUMENTS)) == pytest.approx(scores, abs=1e-6)
    # N:N by position, and token ids joined as given.
    ids = [tokenizer.encode(QUERY), tokenizer.encode(DOCUMENTS[1])]
    pair = engine.score([ids[0], QUERY], [ids[1], DOCUMENTS[0]])
    with torch.no_grad():
        joined = torch.sigmoid(hf(torch.tensor([ids[0] + ids[1]])).logits[0, 0])
    assert pair == pytest.approx([float(joined), expected[0]], abs=2e-5)


@pytest.mark.parametrize("tied", [False, True])
def test_original_qwen3_reranker_converted_by_hf_overrides(tmp_path, tokenizer, tied):
    """vLLM's recipe for Qwen3-Reranker (a causal LM answering "yes" / "no"): hf_overrides
    routing it to Qwen3ForSequenceClassification with classifier_from_token ["no", "yes"] and
    is_original_qwen3_reranker. A pair's score must be transformers' softmax over the two
    tokens' next-token logits, the yes share, as the model card computes it."""
    torch.manual_seed(5)
    hf = Qwen3ForCausalLM(Qwen3Config(**SHAPE, vocab_size=len(tokenizer), head_dim=32,
                                      tie_word_embeddings=tied)).eval()
    _save(tmp_path, hf, tokenizer)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    no, yes = tokenizer.convert_tokens_to_ids(["no", "yes"])
    overrides = {"architectures": ["Qwen3ForSequenceClassification"],
                 "classifier_from_token": ["no", "yes"], "is_original_qwen3_reranker": True}
    model = kt.Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                     hf_overrides=overrides)
    assert model.classifier.num_labels == 1 and model.classifier.activation == "sigmoid"
    scores = kt.Engine(model).score(QUERY, DOCUMENTS)
    expected = []
    with torch.no_grad():
        for document in DOCUMENTS:
            logits = hf(**tokenizer(QUERY, document, return_tensors="pt")).logits[0, -1]
            expected.append(float(torch.softmax(logits[[no, yes]], dim=-1)[1]))
    assert scores == pytest.approx(expected, abs=2e-5)
    # One token, no post-processing: that token's logit, one label.
    single = kt.Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                      hf_overrides={**overrides, "classifier_from_token": ["yes"],
                                                    "is_original_qwen3_reranker": False})
    with torch.no_grad():
        logit = hf(**tokenizer(TEXTS[0], return_tensors="pt")).logits[0, -1, yes]
    assert kt.Engine(single).classify(TEXTS[0])[0].logits == pytest.approx([float(logit)],
                                                                           abs=2e-5)
    # A weights-only folder and the tokenizer given apart: the tokens are looked up in that one.
    weights_only = tmp_path / "weights-only"
    weights_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        (weights_only / name).write_bytes((tmp_path / name).read_bytes())
    apart = kt.Model.from_pretrained(weights_only, device="cpu", dtype="float32",
                                     progress=False, tokenizer=tmp_path, hf_overrides=overrides)
    assert kt.Engine(apart).score(QUERY, DOCUMENTS) == pytest.approx(expected, abs=2e-5)
    for bad, message in ((["no", "yes", "maybe"], "takes two tokens"),
                         (["no", "zzqqxx-not-a-token"], "'zzqqxx-not-a-token' is not a token")):
        with pytest.raises(ValueError, match=message):
            kt.Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                     hf_overrides={**overrides, "classifier_from_token": bad})


def test_dummy_weights_make_a_head(tmp_path, tokenizer):
    """--load-format dummy: the architecture's tensors made up, the score head among them."""
    hf = _classifier("llama", tokenizer, 2, tie_word_embeddings=False)
    _save(tmp_path, hf, tokenizer)
    (tmp_path / "model.safetensors").unlink()  # the config alone
    model = kt.Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False,
                                     load_format="dummy")
    assert model.classifier.weight.shape == (2, SHAPE["hidden_size"])
    assert model.classifier.weight.abs().sum() > 0


def test_checkpoint_without_score_head_is_refused(tmp_path, tokenizer):
    from safetensors.torch import load_file, save_file

    hf = _classifier("llama", tokenizer, 2)
    _save(tmp_path, hf, tokenizer)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["score.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ValueError, match="checkpoint has no score.weight"):
        kt.Model.from_pretrained(tmp_path, device="cpu", dtype="float32", progress=False)


@pytest.fixture(scope="module")
def reranker_server(reranker):
    proc = ServerProcess(["--model", str(reranker[1]), "--num-device-blocks", "64"])
    yield proc
    proc.stop()


def test_server_classify_score_and_rerank(reranker_server, reranker, tokenizer):
    hf, _ = reranker
    url = reranker_server.url
    body = httpx.post(f"{url}/classify", json={"input": TEXTS[:2]}, timeout=60).json()
    assert body["object"] == "list" and body["id"].startswith("classify-")
    assert [d["index"] for d in body["data"]] == [0, 1]
    for item, text in zip(body["data"], TEXTS):
        expected = torch.sigmoid(_hf_logits(hf, tokenizer, text))
        assert item["probs"] == pytest.approx(expected.tolist(), abs=2e-5)
        assert item["num_classes"] == 1 and item["label"] == "LABEL_0"
    tokens = sum(len(tokenizer.encode(t)) for t in TEXTS[:2])
    assert body["usage"] == {"prompt_tokens": tokens, "total_tokens": tokens,
                             "completion_tokens": 0, "prompt_tokens_details": None}
    # SGLang's path, and the chat form (rendered by the template, as on /v1/embeddings).
    messages = [{"role": "user", "content": TEXTS[0]}]
    chat = httpx.post(f"{url}/v1/classify", json={"messages": messages}, timeout=60).json()
    rendered = tokenizer.apply_chat_template(messages, tokenize=False)
    assert chat["data"][0]["probs"] == pytest.approx(
        torch.sigmoid(hf(torch.tensor([tokenizer.encode(rendered, add_special_tokens=False)])
                          ).logits[0]).tolist(), abs=2e-5)

    expected = [float(torch.sigmoid(_hf_logits(hf, tokenizer, QUERY, d))[0]) for d in DOCUMENTS]
    scores = httpx.post(f"{url}/score", json={"text_1": QUERY, "text_2": DOCUMENTS},
                        timeout=60).json()
    assert [d["score"] for d in scores["data"]] == pytest.approx(expected, abs=2e-5)
    pair_tokens = sum(len(tokenizer(QUERY, d)["input_ids"]) for d in DOCUMENTS)
    assert scores["usage"]["prompt_tokens"] == pair_tokens
    ranked = httpx.post(f"{url}/rerank", json={"query": QUERY, "documents": DOCUMENTS,
                                               "top_n": 2}, timeout=60).json()
    order = sorted(range(len(DOCUMENTS)), key=lambda i: expected[i], reverse=True)[:2]
    assert [r["index"] for r in ranked["results"]] == order
    assert [r["relevance_score"] for r in ranked["results"]] == pytest.approx(
        [expected[i] for i in order], abs=2e-5)
    assert ranked["results"][0]["document"]["text"] == DOCUMENTS[order[0]]

    # Refusals: generation, LM logits, a shape error; the server keeps serving.
    for path, request in (("/v1/completions", {"prompt": "Hi", "max_tokens": 4}),
                          ("/v1/chat/completions", {"messages": messages, "max_tokens": 4})):
        response = httpx.post(url + path, json=request, timeout=60)
        assert response.status_code == 400
        assert openai_error(response)["param"] == "model"
    response = httpx.post(f"{url}/score", json={"text_1": [QUERY, QUERY], "text_2": DOCUMENTS},
                          timeout=60)
    assert response.status_code == 400 and openai_error(response)["param"] == "text_2"
    # Each text fits the 512-token context, the pair read together does not: said so.
    long = " ".join(["hello"] * 300)
    response = httpx.post(f"{url}/score", json={"text_1": long, "text_2": long}, timeout=60)
    error = openai_error(response)
    assert response.status_code == 400 and error["code"] == "context_length_exceeded"
    assert error["param"] == "text_2" and "pair of text_1 and text_2" in error["message"], error
    response = httpx.post(f"{url}/classify", json={"input": ""}, timeout=60)
    assert response.status_code == 400 and openai_error(response)["param"] == "input"
    again = httpx.post(f"{url}/classify", json={"input": TEXTS[0]}, timeout=60).json()
    assert again["data"][0]["probs"] == body["data"][0]["probs"]
    # vLLM's /pooling: a classifier's own task is classification; "embed" gives its
    # embedding (as /v1/embeddings).
    pooled = httpx.post(f"{url}/pooling", json={"input": TEXTS[:2]}, timeout=60).json()
    assert [d["data"] for d in pooled["data"]] == [d["probs"] for d in body["data"]]
    assert pooled["usage"]["prompt_tokens"] == tokens
    embedded = httpx.post(f"{url}/pooling", json={"input": TEXTS[0], "task": "embed"},
                          timeout=60).json()["data"][0]["data"]
    assert embedded == httpx.post(f"{url}/v1/embeddings", json={"input": TEXTS[0]},
                                  timeout=60).json()["data"][0]["embedding"]
    # vLLM's token_classify: the head and its activation at every position (transformers'
    # classifier scores every position before it pools the last).
    per_token = httpx.post(f"{url}/pooling", json={"input": TEXTS[0], "task": "token_classify"},
                           timeout=60).json()["data"][0]["data"]
    ids = tokenizer.encode(TEXTS[0])
    with torch.no_grad():
        expected_rows = torch.sigmoid(hf.score(hf.model(torch.tensor([ids])).last_hidden_state))
    assert torch.tensor(per_token).shape == (len(ids), 1)
    torch.testing.assert_close(torch.tensor(per_token), expected_rows[0], atol=2e-5, rtol=1e-4)
    assert per_token[-1] == pytest.approx(body["data"][0]["probs"], abs=1e-6)
    # The embedding's options are no classification's.
    for extra in ({"normalize": False}, {"dimensions": 8}, {"task": "token_classify",
                                                             "normalize": True}):
        response = httpx.post(f"{url}/pooling", json={"input": TEXTS[0], **extra}, timeout=60)
        assert response.status_code == 400
        assert openai_error(response)["param"] == next(k for k in extra if k != "task")
    # SageMaker's route sends `input` to the API the model serves: classification.
    sagemaker = httpx.post(f"{url}/invocations", json={"input": TEXTS[0]}, timeout=60).json()
    assert sagemaker["object"] == "list" and sagemaker["data"][0]["probs"] == again["data"][0]["probs"]


def test_vllm_task_flags_check_the_model(reranker, default_model, tmp_path):
    """--runner / --convert / --task switch nothing here (every API a model has is served):
    they refuse, naming the flag, a model that cannot do what they ask for."""
    classifier = kt.Model.from_pretrained(reranker[1], device="cpu", dtype="float32",
                                          progress=False)
    for model, ok in ((classifier, [dict(runner="pooling"), dict(convert="classify"),
                                    dict(task="score"), dict(task="classify")]),
                      (default_model, [dict(runner="generate"), dict(runner="pooling"),
                                       dict(task="embed"), dict(task="score")])):
        for flags in ok:
            check_model_task(model, **flags)
    with pytest.raises(ValueError, match="^--runner generate: LlamaForSequenceClassification "
                                         "is a sequence-classification model"):
        check_model_task(classifier, runner="generate")
    with pytest.raises(ValueError, match="^--task generate"):
        check_model_task(classifier, task="generate")
    for flags, flag in ((dict(convert="classify"), "--convert"), (dict(task="classify"), "--task")):
        with pytest.raises(ValueError, match=f"^{flag} classify: .* no classification head"):
            check_model_task(default_model, **flags)
    # On the command line: run-batch (as serve) stops with the message before reading a line.
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/score", '
                      '"body": {"text_1": "a", "text_2": "b"}}\n')
    done = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "run-batch", "-i", str(source),
                           "-o", str(out), "--model", str(reranker[1]), "--device", "cpu",
                           "--task", "generate"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 2
    assert "ksana-llm: error: --task generate: LlamaForSequenceClassification" in done.stderr
    assert out.read_text() == ""
