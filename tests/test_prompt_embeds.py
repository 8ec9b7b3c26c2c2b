"""Prompts given as embeddings (vLLM's `prompt_embeds`): the default model generates what
transformers' `generate(inputs_embeds=...)` generates from the same embeddings (greedy tokens,
and with a repetition penalty, which then sees only the output), alone, batched with token
prompts, and through preemption; bad embeddings are a ValueError naming the field. Over HTTP (a real
server with --enable-prompt-embeds and the official `openai` client), completions take them as
vLLM's clients send them, and refuse bad ones with a 400."""

from __future__ import annotations

import asyncio
import base64
import io

import httpx
import pytest
import torch

import ksana_llm as kt
from ksana_llm.server.app import build_app
from tests.server_process import server_fixture, openai_error

MAX_NEW = 16
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


@pytest.fixture(scope="module")
def prompt_ids(default_model) -> list[int]:
    tok = default_model.tokenizer
    return tok.encode(tok.apply_chat_template(QUESTION, add_generation_prompt=True,
                                              tokenize=False), add_special_tokens=False)


@pytest.fixture(scope="module")
def soft_prompt(hf_default_model, prompt_ids) -> torch.Tensor:
    """The prompt's token embeddings, nudged off every token's (a soft prompt no ids give)."""
    with torch.no_grad():
        rows = hf_default_model.get_input_embeddings()(torch.tensor(prompt_ids))
    generator = torch.Generator().manual_seed(0)
    return rows + 0.02 * torch.randn(rows.shape, generator=generator)


def hf_tokens(hf_model, embeds: torch.Tensor, **settings) -> list[int]:
    """transformers' greedy tokens from `embeds` alone."""
    with torch.no_grad():
        out = hf_model.generate(inputs_embeds=embeds[None], attention_mask=torch.ones(
            1, len(embeds), dtype=torch.long), max_new_tokens=MAX_NEW, do_sample=False,
            **settings)
    return out[0].tolist()  # only the new tokens: there were no input ids


def test_embeddings_generate_what_transformers_generates(default_model, hf_default_model,
                                                          soft_prompt, prompt_ids):
    greedy = kt.GenerationConfig(max_new_tokens=MAX_NEW, temperature=0)
    penalised = greedy.replace(repetition_penalty=1.5)
    with kt.Engine(default_model, num_device_blocks=64) as engine:
        out = engine.generate_outputs({"prompt_embeds": soft_prompt}, greedy, use_tqdm=False)[0]
        assert out.token_ids == hf_tokens(hf_default_model, soft_prompt)
        assert out.text == default_model.tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert out.prompt_token_ids == [0] * len(soft_prompt)
        # Penalties see the output only, as transformers does from embeddings.
        rep = engine.submit(kt.Request(prompt_embeds=soft_prompt, generation_config=penalised))
        assert rep.result(timeout=120).token_ids == hf_tokens(hf_default_model, soft_prompt,
                                                              repetition_penalty=1.5)
        # Batched with a token prompt: each as alone. Never from the prefix cache.
        exact = hf_default_model.get_input_embeddings()(torch.tensor(prompt_ids)).detach()
        both = engine.generate_outputs([prompt_ids, {"prompt_embeds": exact[None]},
                                        {"prompt_embeds": soft_prompt}], greedy, use_tqdm=False)
        assert both[0].token_ids == both[1].token_ids == hf_tokens(hf_default_model, exact)
        assert both[2].token_ids == out.token_ids
        assert both[2].num_cached_tokens == 0
        assert engine.generate({"prompt_embeds": soft_prompt}, greedy) == out.text
        assert "".join(engine.generate({"prompt_embeds": soft_prompt}, greedy, stream=True)) \
            == out.text


def test_embeddings_survive_preemption(default_model, hf_default_model, soft_prompt):
    """Recomputed after preemption, the prompt is its embeddings again, not the placeholders."""
    config = kt.GenerationConfig(max_new_tokens=MAX_NEW, temperature=0)
    with kt.Engine(default_model, num_device_blocks=8, block_token_num=8, preempt_mode=1,
                   max_batch_size=8) as engine:
        outs = engine.generate_outputs([{"prompt_embeds": soft_prompt}] * 3, config,
                                       use_tqdm=False)
        assert engine.stats().num_preemptions > 0
    assert [o.token_ids for o in outs] == [hf_tokens(hf_default_model, soft_prompt)] * 3


def test_no_drafts_from_placeholder_ids(default_model, hf_default_model, soft_prompt):
    """The drafters read a prompt as token ids: for embeddings those are placeholders, whose
    drafts would all be refused. Such a sequence drafts nothing; its tokens are unchanged."""
    config = kt.GenerationConfig(max_new_tokens=MAX_NEW, temperature=0)
    with kt.Engine(default_model, num_device_blocks=32, speculative_method="ngram",
                   num_speculative_tokens=3) as engine:
        out = engine.generate_outputs({"prompt_embeds": soft_prompt}, config, use_tqdm=False)
        assert engine.stats().num_draft_tokens == 0
    assert out[0].token_ids == hf_tokens(hf_default_model, soft_prompt)


def test_bad_prompt_embeds_are_value_errors(default_model, soft_prompt):
    hidden = default_model.hf_config.hidden_size
    with kt.Engine(default_model, num_device_blocks=16) as engine:
        for bad, match in ((torch.zeros(4, hidden + 1), "prompt_embeds"),
                           (torch.zeros(4, hidden, dtype=torch.long), "float32, float16"),
                           (torch.zeros(4, hidden).to(torch.float8_e4m3fn), "float8"),
                           (torch.zeros(4, hidden).to_sparse(), "sparse"),
                           (torch.zeros(4, hidden, device="meta"), "meta"),
                           (torch.zeros(0, hidden), "prompt_embeds"),
                           (torch.full((2, hidden), float("nan")), "finite"),
                           ([[0.0] * hidden], "prompt_embeds")):
            with pytest.raises(ValueError, match=match):
                engine.submit(kt.Request(prompt_embeds=bad))
        with pytest.raises(ValueError, match="without prompt"):
            engine.submit(kt.Request("hi", prompt_embeds=soft_prompt))
        with pytest.raises(ValueError, match="prompt_logprobs"):
            engine.submit(kt.Request(prompt_embeds=soft_prompt, generation_config=kt.
                                     GenerationConfig(prompt_logprobs=1)))
        with pytest.raises(ValueError, match="export_kv"):
            engine.submit(kt.Request(prompt_embeds=soft_prompt, export_kv=True))
        with pytest.raises(ValueError, match="exactly one of"):
            engine.generate({"prompt": "hi", "prompt_embeds": soft_prompt})
        assert engine.generate({"prompt_token_ids": [1, 2, 3]},
                               kt.GenerationConfig(max_new_tokens=2))  # vLLM's TokensPrompt
        assert engine.is_running


# ---- the completions route (vLLM's `prompt_embeds`, behind --enable-prompt-embeds) ------------

def _encoded(tensor: torch.Tensor) -> str:
    """As vLLM's docs have clients send them: torch.save, then base64."""
    buffer = io.BytesIO()
    torch.save(tensor, buffer)
    return base64.b64encode(buffer.getvalue()).decode()


server = server_fixture(["--num-device-blocks", "128", "--enable-prompt-embeds"])


def test_completions_take_prompt_embeds(client, model_name, local_engine, soft_prompt):
    greedy = kt.GenerationConfig(max_new_tokens=MAX_NEW, temperature=0)
    want = local_engine.generate({"prompt_embeds": soft_prompt}, greedy)
    reply = client.completions.create(model=model_name, prompt=None, max_tokens=MAX_NEW,
                                      temperature=0,
                                      extra_body={"prompt_embeds": _encoded(soft_prompt)})
    assert reply.choices[0].text == want
    assert reply.usage.prompt_tokens == len(soft_prompt)
    # Several prompts (a batch of one is a prompt too), streamed.
    stream = client.completions.create(
        model=model_name, prompt=None, max_tokens=MAX_NEW, temperature=0, stream=True,
        extra_body={"prompt_embeds": [_encoded(soft_prompt[None]), _encoded(soft_prompt[-5:])]})
    texts = ["", ""]
    for chunk in stream:
        for choice in chunk.choices:
            texts[choice.index] += choice.text
    assert texts == [want, local_engine.generate({"prompt_embeds": soft_prompt[-5:]}, greedy)]
    truncated = client.completions.create(
        model=model_name, prompt=None, max_tokens=MAX_NEW, temperature=0,
        extra_body={"prompt_embeds": _encoded(soft_prompt), "truncate_prompt_tokens": 5})
    assert truncated.choices[0].text == texts[1]


def test_bad_prompt_embeds_are_400s(server, soft_prompt, default_model):
    url = server.base_url + "/completions"
    hidden = default_model.hf_config.hidden_size
    for body, param in (({"prompt_embeds": "not base64!"}, "prompt_embeds"),
                        ({"prompt_embeds": base64.b64encode(b"junk").decode()}, "prompt_embeds"),
                        ({"prompt_embeds": _encoded({"a": torch.zeros(2)})}, "prompt_embeds"),
                        ({"prompt_embeds": _encoded(torch.zeros(3, hidden - 1))}, "prompt_embeds"),
                        ({"prompt_embeds": _encoded(torch.zeros(3, hidden, dtype=torch.long))},
                         "prompt_embeds"),
                        # float8 codes, and (after a good prompt) a sparse tensor: a malformed
                        # one's densifying would write out of bounds (vLLM's CVE-2025-62164)
                        ({"prompt_embeds": [_encoded(soft_prompt), _encoded(
                            torch.zeros(3, hidden).to(torch.float8_e4m3fn))]}, "prompt_embeds"),
                        ({"prompt_embeds": [_encoded(soft_prompt), _encoded(_bad_sparse(hidden))]},
                         "prompt_embeds"),
                        ({"prompt_embeds": _encoded(torch.zeros(3, hidden).to_sparse())},
                         "prompt_embeds"),
                        ({"prompt_embeds": []}, "prompt_embeds"),
                        ({"prompt_embeds": _encoded(soft_prompt), "prompt": "hi"}, "prompt_embeds"),
                        ({"prompt_embeds": _encoded(soft_prompt), "echo": True}, "echo"),
                        ({"prompt_embeds": _encoded(soft_prompt), "prompt_logprobs": 1},
                         "prompt_logprobs")):
        r = httpx.post(url, json={"max_tokens": 2, **body}, timeout=60)
        assert r.status_code == 400 and openai_error(r)["param"] == param, (body, r.text)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["num_running"] == 0  # nothing left over


def _bad_sparse(hidden: int) -> torch.Tensor:
    """A COO tensor whose index lies far outside its declared size."""
    return torch.sparse_coo_tensor(torch.tensor([[10**6], [0]]), torch.ones(1), (3, hidden),
                                   check_invariants=False)


def test_a_server_without_the_flag_refuses_prompt_embeds(default_model, soft_prompt):
    """vLLM's default: the payloads are unpickled, so a server takes them only when told to."""
    engine = kt.Engine(default_model, num_device_blocks=16)
    app = build_app(engine, served_model_name="m")

    async def post() -> httpx.Response:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=60) as http:
            return await http.post("/v1/completions", json={
                "prompt_embeds": _encoded(soft_prompt), "max_tokens": 2})

    try:
        response = asyncio.run(post())
    finally:
        engine.shutdown()
    assert response.status_code == 400 and openai_error(response)["param"] == "prompt_embeds"
    assert "--enable-prompt-embeds" in openai_error(response)["message"]
