"""Forward-only requests: `Engine.forward` against transformers (logits, hidden states, gathered
token ids, PPL) through plain, chunked and prefix-cached prefill, mixed with generation; and
KsanaLLM's native `POST /forward` on a real server subprocess (JSON and msgpack) plus its errors."""

from __future__ import annotations

import asyncio
import base64
import math
import time

import httpx
import msgpack
import numpy as np
import pytest
import torch

import ksana_llm as kt
from ksana_llm.api.forward_outputs import ForwardOutput, ForwardTarget
from tests.server_process import server_fixture, openai_error
from tests.tolerances import LOGIT_ATOL
from tests.engine_fixtures import engine_fixture

PROMPT = ("The quick brown fox jumps over the lazy dog. Paris is the capital of France, and "
          "Berlin is the capital of Germany. Once upon a time, in a small village by the sea,")
SLICES = [[0, 2], [10, 12], [-3, -1]]
GATHER_IDS = [5, 100, 2000, 49151]
ATOL = LOGIT_ATOL  # see tests/tolerances.py
# fp32 logits reach |25|: a few ulps of relative error from a different GEMM kernel (oneDNN vs
# MKL) is not a discrepancy, so relative tolerance as well as absolute.
RTOL = 1e-5


engine = engine_fixture(num_device_blocks=256)


@pytest.fixture(scope="module")
def chunked_engine(model):
    """max_batch_size 16 tokens per step: the prompt is prefilled in several chunks."""
    with kt.Engine(model, num_device_blocks=256, max_batch_size=16) as e:
        yield e


@pytest.fixture(scope="module")
def ids(engine):
    ids = engine.tokenizer.encode(PROMPT)
    assert len(ids) > 32
    return ids


@pytest.fixture(scope="module")
def hf(model, ids):
    from transformers import AutoModelForCausalLM

    ref = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32)
    with torch.no_grad():
        out = ref(torch.tensor([ids]), output_hidden_states=True)
    # For Llama, HF's last hidden state is taken after the final norm (what our model returns).
    return out.logits[0], out.hidden_states[-1][0]


def _positions(slices, n):
    out = []
    for a, b in slices:
        a, b = (a + n if a < 0 else a), (b + n if b < 0 else b)
        out.extend(range(a, b + 1))
    return out


def _targets():
    return [ForwardTarget("logits", SLICES),
            ForwardTarget("layernorm", [[0, -1]]),
            ForwardTarget("logits", [[1, 4], [-2, -1]], token_id=GATHER_IDS,
                          token_reduce_mode="GATHER_TOKEN_ID")]


def _check_against_hf(out: ForwardOutput, ids, hf):
    logits, hidden = hf
    n = len(ids)
    assert out.prompt_token_ids == ids
    full, norm, gathered = out.targets
    pos = _positions(SLICES, n)
    assert full.positions == pos and full.tensor.shape == (len(pos), logits.shape[-1])
    assert full.tensor.dtype == torch.float32 and full.tensor.device.type == "cpu"
    torch.testing.assert_close(full.tensor, logits[pos], atol=ATOL, rtol=RTOL)
    assert norm.tensor.shape == hidden.shape
    torch.testing.assert_close(norm.tensor, hidden, atol=ATOL, rtol=RTOL)
    gpos = _positions([[1, 4], [-2, -1]], n)
    torch.testing.assert_close(gathered.tensor, logits[gpos][:, GATHER_IDS], atol=ATOL, rtol=RTOL)


# ---- engine: correctness ------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["engine", "chunked_engine"])
def test_forward_matches_transformers(which, request, ids, hf):
    e = request.getfixturevalue(which)
    _check_against_hf(e.forward(ids, _targets()), ids, hf)
    # A text prompt is tokenized the same way.
    _check_against_hf(e.forward(PROMPT, _targets()), ids, hf)


def test_forward_ignores_cached_prefix_but_publishes_blocks(chunked_engine, ids, hf):
    e = chunked_engine
    bm = e._core.block_manager
    # Cache a prefix of the same prompt (3 full blocks), then forward the whole prompt.
    e.generate(ids[:50], kt.GenerationConfig(max_new_tokens=1), use_tqdm=False)
    hits = bm.prefix_hits
    _check_against_hf(e.forward(ids, _targets()), ids, hf)
    assert bm.prefix_hits == hits, "a forward-only request must not take prefix-cache hits"
    # Its full blocks were published: a generate of the same prompt now hits them.
    out = e.generate_outputs(ids, kt.GenerationConfig(max_new_tokens=1), use_tqdm=False)[0]
    assert out.finished and bm.prefix_hits - hits >= (len(ids) - 1) // 16 * 16
    stats = e._core.stats()
    assert (stats.num_running, stats.num_free_blocks) == (0, stats.num_blocks)  # blocks freed


def test_ppl_and_top_logprobs(engine, ids, hf):
    logits, _ = hf
    n = len(ids)
    out = engine.forward(ids, [ForwardTarget("logits", [[0, n - 2]], token_logprobs=True,
                                             input_top_logprobs_num=3),
                               ForwardTarget("logits", [[-1, -1]], token_logprobs=True)])
    ppl_target, last = out.targets
    ref = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    torch.testing.assert_close(ppl_target.token_logprobs, ref, atol=ATOL, rtol=RTOL)
    ppl = math.exp(-ppl_target.token_logprobs.mean().item())
    hf_ppl = math.exp(torch.nn.functional.cross_entropy(logits[:-1], torch.tensor(ids[1:])).item())
    assert ppl == pytest.approx(hf_ppl, rel=1e-4)
    assert torch.isnan(last.token_logprobs).all()  # the last position has no next token
    values, top_ids = torch.log_softmax(logits[:-1], dim=-1).topk(3, dim=-1)
    assert [[t for t, _ in row] for row in ppl_target.top_logprobs] == top_ids.tolist()
    np.testing.assert_allclose([[lp for _, lp in row] for row in ppl_target.top_logprobs],
                               values.numpy(), atol=ATOL)


def test_gather_token_id_is_the_next_prompt_tokens_probability(engine, ids, hf):
    """KsanaLLM's PPL mode: logits + GATHER_TOKEN_ID, no token_id -> at each position the
    probability of the next prompt token, a 1-D tensor; by default every position but the last."""
    logits, _ = hf
    n = len(ids)
    probs = torch.softmax(logits, dim=-1)
    want = probs[torch.arange(n - 1), torch.tensor(ids[1:])]
    default, sliced = engine.forward(ids, [
        ForwardTarget("logits", token_reduce_mode="GATHER_TOKEN_ID"),
        ForwardTarget("logits", [[1, 3], [-4, -2]], token_reduce_mode="GATHER_TOKEN_ID")]).targets
    assert default.positions == list(range(n - 1)) and default.tensor.shape == (n - 1,)
    torch.testing.assert_close(default.tensor, want, atol=1e-6, rtol=1e-4)
    pos = _positions([[1, 3], [-4, -2]], n)
    assert sliced.positions == pos
    torch.testing.assert_close(sliced.tensor, want[pos], atol=1e-6, rtol=1e-4)


def test_layernorm_rows_by_token_id(engine, ids, hf):
    """KsanaLLM: a layernorm target picks its rows by token id (instead of slice_pos): the
    positions holding one of those ids, in prompt order."""
    _, hidden = hf
    wanted = {ids[3], ids[7]}
    out = engine.forward(ids, [ForwardTarget("layernorm", token_id=sorted(wanted))]).targets[0]
    pos = [p for p, t in enumerate(ids) if t in wanted]
    assert out.positions == pos and len(pos) >= 2
    torch.testing.assert_close(out.tensor, hidden[pos], atol=ATOL, rtol=RTOL)


@pytest.mark.parametrize("run_ahead", [False, True], ids=["sync", "async-scheduling"])
def test_forward_alongside_generation(model, ids, hf, run_ahead):
    """Forward requests and generate requests share steps; each gets its own right answer.
    With async scheduling the captured rows (and prompt log-probs) are read back after the next
    step is launched, with the step's tokens."""
    prompts = ["What is the capital of France?", "Write a haiku about the sea."]
    cfg = kt.GenerationConfig(max_new_tokens=12)
    with kt.Engine(model, num_device_blocks=256, max_batch_size=32,
                   async_scheduling=run_ahead) as e:
        alone = [e.generate_outputs(p, cfg, use_tqdm=False)[0].token_ids for p in prompts]

        async def main():
            return await asyncio.gather(
                *(e.generate_output_async(p, cfg) for p in prompts),
                e.forward_async(ids, _targets()), e.forward_async(ids[:20], [ForwardTarget("logits")]))

        *gens, fwd, short = asyncio.run(main())
        assert [g.token_ids for g in gens] == alone
        _check_against_hf(fwd, ids, hf)
        torch.testing.assert_close(short.targets[0].tensor, hf[0][:20], atol=ATOL, rtol=RTOL)
        stats = e._core.stats()
        assert (stats.num_running, stats.num_waiting, stats.num_free_blocks) == (0, 0, 256)
        assert (e._core.num_steps_ahead > 0) == run_ahead


# ---- engine: validation -------------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,targets,field", [
    ("", [ForwardTarget("logits")], "prompt"),
    ([], [ForwardTarget("logits")], "prompt"),
    ("hi", [], "targets"),
    ("hi there", [ForwardTarget("hidden")], "targets[0].target_name"),
    ("hi there", [ForwardTarget("logits"), ForwardTarget("logits", [[0, 99]])], "targets[1].slice_pos"),
    ("hi there", [ForwardTarget("logits", [[-99, 0]])], "targets[0].slice_pos"),
    ("hi there", [ForwardTarget("logits", [[1, 0]])], "targets[0].slice_pos"),
    ("hi there", [ForwardTarget("logits", [[0]])], "targets[0].slice_pos"),
    ("hi there", [ForwardTarget("logits", token_reduce_mode="MAX")], "targets[0].token_reduce_mode"),
    # GATHER_TOKEN_ID is the next prompt token's probability: the last position has none.
    ("hi there", [ForwardTarget("logits", [[0, -1]], token_reduce_mode="GATHER_TOKEN_ID")],
     "targets[0].slice_pos"),
    ("hi there", [ForwardTarget("layernorm", [[0, 0]], token_id=[1])], "targets[0].token_id"),
    ("hi there", [ForwardTarget("logits", token_id=[1])], "targets[0].token_id"),
    ([5, 6], [ForwardTarget("layernorm", token_id=[9])], "targets[0].token_id"),  # not in it
    ([5], [ForwardTarget("logits", token_reduce_mode="GATHER_TOKEN_ID")],
     "targets[0].token_reduce_mode"),  # no next token to score
    ("hi there", [ForwardTarget("logits", token_id=[1, 10**9], token_reduce_mode="GATHER_TOKEN_ID")],
     "targets[0].token_id"),
    ("hi there", [ForwardTarget("layernorm", token_id=[1], token_reduce_mode="GATHER_TOKEN_ID")],
     "targets[0].token_reduce_mode"),
    ("hi there", [ForwardTarget("logits", input_top_logprobs_num=-1)], "targets[0].input_top_logprobs_num"),
    ("hi there", [{"target_name": "logits", "bogus": 1}], "targets[0]"),
])
def test_bad_input_raises_value_error_naming_the_field(engine, prompt, targets, field):
    with pytest.raises(ValueError, match=r"^" + field.replace("[", r"\[").replace("]", r"\]")):
        engine.forward(prompt, targets)
    assert engine.is_running


def test_priority_needs_a_priority_scheduler(engine):
    """Forward-only requests take `priority` as generation requests do: refused by a FIFO
    engine (it would ignore it), an integer only."""
    for priority, message in ((1, "needs an engine with scheduler='priority'"),
                              (True, "priority must be an integer")):
        with pytest.raises(ValueError, match=message):
            engine.submit_forward("hi there", [ForwardTarget("logits")], priority=priority)
    assert engine.submit_forward("hi there", [ForwardTarget("logits")], priority=0).result()
    assert engine.stats().num_waiting == 0


def test_dict_targets_and_default_positions(engine, ids, hf):
    out = engine.forward(ids[:8], [{"target_name": "logits"}])
    assert out.targets[0].positions == list(range(8))
    torch.testing.assert_close(out.targets[0].tensor, hf[0][:8], atol=ATOL, rtol=RTOL)


# ---- server -------------------------------------------------------------------------------------------

server = server_fixture(["--num-device-blocks", "256"])


def _decode_tensor(t: dict) -> torch.Tensor:
    assert t["dtype"] == "float32"
    data = base64.b64decode(t["data"])
    return torch.from_numpy(np.frombuffer(data, dtype="<f4").copy()).reshape(t["shape"])


def _http_targets():
    return [{"target_name": "logits", "slice_pos": SLICES},
            {"target_name": "layernorm", "slice_pos": [[0, -1]]},
            {"target_name": "logits", "slice_pos": [[1, 4], [-2, -1]], "token_id": GATHER_IDS,
             "token_reduce_mode": "GATHER_TOKEN_ID"},
            {"target_name": "logits", "slice_pos": [[0, -2]], "token_reduce_mode": "GATHER_ALL",
             "input_top_logprobs_num": 2, "token_logprobs": True}]


def _post(server, body, *, use_msgpack=False, timeout=120):
    if use_msgpack:
        r = httpx.post(server.url + "/forward", content=msgpack.packb(body),
                       headers={"Content-Type": "application/x-msgpack"}, timeout=timeout)
        if r.status_code == 200:
            assert r.headers["content-type"].startswith("application/x-msgpack")
        return r, (msgpack.unpackb(r.content) if r.status_code == 200 else None)
    r = httpx.post(server.url + "/forward", json=body, timeout=timeout)
    return r, (r.json() if r.status_code == 200 else None)


@pytest.mark.parametrize("use_msgpack", [False, True], ids=["json", "msgpack"])
def test_server_forward_matches_python_api(server, engine, ids, hf, use_msgpack):
    body = {"requests": [{"input_tokens": ids, "request_target": _http_targets()},
                         {"prompt": PROMPT, "request_target": [{"target_name": "logits",
                                                                "slice_pos": [[-1, -1]]}]}]}
    r, payload = _post(server, body, use_msgpack=use_msgpack)
    assert r.status_code == 200, r.text
    assert payload["code"] == 0 and payload["message"] == ""
    first, second = payload["responses"]
    assert first["input_token_ids"] == ids and second["input_token_ids"] == ids
    local = engine.forward(ids, [ForwardTarget(**t) for t in _http_targets()])
    got = [_decode_tensor(item["tensor"]) for item in first["response"]]
    assert [item["target_name"] for item in first["response"]] == \
        ["logits", "layernorm", "logits", "logits"]
    for g, want in zip(got, local.targets):
        torch.testing.assert_close(g, want.tensor, atol=1e-5, rtol=0)
    _check_against_hf(ForwardOutput("x", ids, [
        type(local.targets[0])(t.target_name, t.positions, g) for t, g in zip(local.targets[:3], got)]),
        ids, hf)
    # token_logprobs (null at the last position is not in this slice) and top logprobs.
    np.testing.assert_allclose(first["response"][3]["token_logprobs"],
                               local.targets[3].token_logprobs.numpy(), atol=1e-5)
    assert first["input_top_logprobs"][:3] == [[], [], []]
    top = first["input_top_logprobs"][3]
    assert len(top) == len(ids) - 1 and all(len(row) == 2 for row in top)
    assert [[i for i, _ in row] for row in top] == [[i for i, _ in row]
                                                    for row in local.targets[3].top_logprobs]
    torch.testing.assert_close(_decode_tensor(second["response"][0]["tensor"]), hf[0][-1:],
                               atol=ATOL, rtol=RTOL)


def test_server_ksana_ppl_request(server, ids, hf):
    """KsanaLLM's own PPL request (msgpack; logits, GATHER_TOKEN_ID over [[0, n-2]]) and its PPL
    2^(-mean log2 p) equal transformers' perplexity of the prompt."""
    n = len(ids)
    r, payload = _post(server, {"requests": [{"input_tokens": ids, "request_target": [
        {"target_name": "logits", "slice_pos": [[0, n - 2]],
         "token_reduce_mode": "GATHER_TOKEN_ID"}]}]}, use_msgpack=True)
    assert r.status_code == 200, r.text
    tensor = payload["responses"][0]["response"][0]["tensor"]
    assert tensor["shape"] == [n - 1]
    probs = _decode_tensor(tensor).double()
    ppl = 2 ** (-torch.log2(probs).mean().item())
    hf_ppl = math.exp(torch.nn.functional.cross_entropy(hf[0][:-1], torch.tensor(ids[1:])).item())
    assert ppl == pytest.approx(hf_ppl, rel=1e-4)


def test_server_ppl_last_position_is_null(server, ids):
    r, payload = _post(server, {"requests": [{"input_tokens": ids[:5], "request_target": [
        {"target_name": "logits", "token_logprobs": True}]}]})
    assert r.status_code == 200, r.text
    lps = payload["responses"][0]["response"][0]["token_logprobs"]
    assert len(lps) == 5 and lps[-1] is None and all(isinstance(v, float) for v in lps[:-1])


@pytest.mark.parametrize("body,param", [
    ({"requests": [{"input_tokens": [1, 2, 3], "request_target": [
        {"target_name": "logits", "slice_pos": [[0, 5]]}]}]}, "requests.0.request_target.0.slice_pos"),
    ({"requests": [{"prompt": "hi", "request_target": [{"target_name": "logits"}]},
                   {"input_tokens": [1, 2], "request_target": [
                       {"target_name": "logits"}, {"target_name": "hidden"}]}]},
     "requests.1.request_target.1.target_name"),
    ({"requests": [{"input_tokens": [1], "request_target": [{"target_name": "transformer"}]}]},
     "requests.0.request_target.0.target_name"),
    ({"requests": [{"input_tokens": [1, 2], "request_target": [
        {"target_name": "logits", "slice_pos": [[0, 1]], "token_reduce_mode": "GATHER_TOKEN_ID"}]}]},
     "requests.0.request_target.0.slice_pos"),
    ({"requests": [{"prompt": "", "request_target": [{"target_name": "logits"}]}]}, "requests.0.prompt"),
    ({"requests": [{"input_tokens": [], "request_target": [{"target_name": "logits"}]}]},
     "requests.0.input_tokens"),
    ({"requests": [{"input_tokens": [10**9], "request_target": [{"target_name": "logits"}]}]},
     "requests.0.input_tokens"),
    ({"requests": [{"input_tokens": [1], "prompt": "x", "request_target": [{"target_name": "logits"}]}]},
     "requests.0.prompt"),
    ({"requests": [{"input_tokens": [1], "request_target": []}]}, "requests.0.request_target"),
    ({"requests": [{"input_tokens": [1], "request_target": [{"target_name": "logits", "x": 1}]}]},
     "requests.0.request_target.0.x"),
    ({"requests": []}, "requests"),
    # 2 x 200 rows of full-vocabulary logits: 19.7M numbers, past MAX_FORWARD_VALUES (16.8M)
    ({"requests": [{"input_tokens": [1] * 200, "request_target": [{"target_name": "logits"}]}] * 2},
     "requests.1.request_target"),
    ({"requests": [{"input_tokens": [1], "request_target": [
        {"target_name": "logits", "input_top_logprobs_num": 21}]}]},  # --max-logprobs 20
     "requests.0.request_target.0.input_top_logprobs_num"),
    ({"requests": [{"prompt": "hi " * 9000, "request_target": [
        {"target_name": "logits", "slice_pos": [[-1, -1]]}]}]}, "requests.0.prompt"),
    ({"requests": [{"input_tokens": [1], "input_refit_embedding": {},
                    "request_target": [{"target_name": "logits"}]}]},
     "requests.0.input_refit_embedding"),
])
@pytest.mark.parametrize("use_msgpack", [False, True], ids=["json", "msgpack"])
def test_server_400(server, body, param, use_msgpack):
    r, _ = _post(server, body, use_msgpack=use_msgpack)
    assert r.status_code == 400, r.text
    if use_msgpack:  # answered in the request's encoding: KsanaLLM's client unpacks every answer
        assert r.headers["content-type"].startswith("application/x-msgpack")
        error = msgpack.unpackb(r.content)["error"]
    else:
        error = openai_error(r)
    assert error["param"] == param and error["type"] == "invalid_request_error", error
    if param == "requests.1.request_target":
        assert error["code"] == "forward_too_large"


def test_server_malformed_bodies(server):
    r = httpx.post(server.url + "/forward", content=b"{nope", timeout=30)
    assert r.status_code == 400 and openai_error(r)["code"] == "invalid_body"
    r = httpx.post(server.url + "/forward", content=b"\xc1\xc1",
                   headers={"Content-Type": "application/x-msgpack"}, timeout=30)
    error = msgpack.unpackb(r.content)["error"]
    assert r.status_code == 400 and error["code"] == "invalid_body"
    assert error["message"] != "Malformed msgpack body: ", error  # (the unpacker says nothing)
    # msgpack without a Content-Type (KsanaLLM's clients' default encoding): read as msgpack.
    body = {"requests": [{"input_tokens": [1, 2], "request_target": [
        {"target_name": "logits", "slice_pos": [[-1, -1]]}]}]}
    r = httpx.post(server.url + "/forward", content=msgpack.packb(body), timeout=60)
    assert r.status_code == 200 and r.headers["content-type"].startswith("application/x-msgpack")
    assert msgpack.unpackb(r.content)["responses"][0]["input_token_ids"] == [1, 2]
    r = httpx.post(server.url + "/forward", json=[1, 2], timeout=30)
    assert r.status_code == 400
    # Without a JSON Content-Type, a body not starting as JSON does is msgpack, its error too.
    for content, kind in ((msgpack.packb([1, 2]), {}), (b"\xc1", {"Content-Type": "a/b"})):
        r = httpx.post(server.url + "/forward", content=content, headers=kind, timeout=30)
        assert r.status_code == 400 and "JSON" not in msgpack.unpackb(r.content)["error"]["message"]
    # Nested past the JSON decoder's recursion limit: a 400, and the connection still serves.
    with httpx.Client(base_url=server.url, timeout=60) as client:
        for _ in range(2):
            r = client.post("/forward", content=b'{"requests": ' + b"[" * 5000 + b"]" * 5000 + b"}")
            assert r.status_code == 400 and openai_error(r)["code"] == "invalid_body"
        r, _ = _post(server, {"requests": [{"input_tokens": [1, 2], "request_target": [
            {"target_name": "logits", "slice_pos": [[-1, -1]]}]}]})
        assert r.status_code == 200


def _aborted_count(server) -> float:
    text = httpx.get(server.url + "/metrics", timeout=30).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("ksana_llm:request_failure_total") and 'reason="aborted"' in line)


def test_server_disconnect_aborts(server):
    long = list(range(100, 4090))  # seconds of prefill on CPU
    before = _aborted_count(server)

    async def impatient() -> None:
        async with httpx.AsyncClient(timeout=0.5) as http:
            with pytest.raises(httpx.ReadTimeout):
                await http.post(server.url + "/forward", json={"requests": [
                    {"input_tokens": long, "request_target": [{"target_name": "logits",
                                                               "slice_pos": [[-1, -1]]}]}]})

    asyncio.run(impatient())
    deadline = time.monotonic() + 20
    while (counts := httpx.get(server.url + "/health").json()) and \
            (counts["num_running"], counts["num_waiting"]) != (0, 0):
        assert time.monotonic() < deadline, f"requests still live: {counts}"
        time.sleep(0.1)
    assert _aborted_count(server) == before + 1


def test_server_429_503_in_process(model):
    from ksana_llm.server.app import build_app

    engine = kt.Engine(model, num_device_blocks=64, max_num_seqs=1, max_queue_size=1)
    app = build_app(engine, served_model_name="m")
    body = {"requests": [{"input_tokens": list(range(1, 200)),
                          "request_target": [{"target_name": "logits", "slice_pos": [[-1, -1]]}]}]}

    async def main() -> None:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t", timeout=120) as http:
            responses = await asyncio.gather(*(http.post("/forward", json=body) for _ in range(6)))
            statuses = [r.status_code for r in responses]
            assert set(statuses) == {200, 429}, statuses
            for r in responses:
                if r.status_code == 429:
                    assert openai_error(r)["code"] == "queue_full" and int(r.headers["Retry-After"]) >= 1
            engine.shutdown()
            r = await http.post("/forward", json=body)
            assert r.status_code == 503 and openai_error(r)["type"] == "service_unavailable"

    try:
        asyncio.run(main())
    finally:
        engine.shutdown()
