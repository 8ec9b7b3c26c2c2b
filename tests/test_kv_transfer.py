"""Prefill/decode disaggregation in the Python API: one engine exports a prompt's KV
(`Request(export_kv=True)`), another decodes from it (`Request(imported_kv=...)`). The decoded
tokens must equal transformers' greedy tokens on the same weights, whatever the two engines'
block sizes, and the imported KV must really be what the decode engine attends to."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt
from ksana_llm.runner.kv_transfer import TransferredKv
from tests.tolerances import LOGIT_ATOL

PROMPT = "The quick brown fox jumps over the lazy dog. Then it ran to the river and"
GREEDY = kt.GenerationConfig(max_new_tokens=16, temperature=0)


@pytest.fixture(scope="module")
def prefill_engine(default_model):
    with kt.Engine(default_model, num_device_blocks=64, block_token_num=16) as engine:
        yield engine


@pytest.fixture(scope="module")
def decode_engine(default_model):
    # Another block size: the transfer is per token, not per block.
    with kt.Engine(default_model, num_device_blocks=96, block_token_num=8) as engine:
        yield engine


def _hf_greedy(hf_model, prompt_ids: list[int], max_new_tokens: int) -> list[int]:
    with torch.no_grad():
        out = hf_model.generate(torch.tensor([prompt_ids]), max_new_tokens=max_new_tokens,
                                do_sample=False, pad_token_id=0)
    return out[0, len(prompt_ids):].tolist()


def _export(engine: kt.Engine, prompt: kt.Prompt) -> TransferredKv:
    out = engine.submit(kt.Request(prompt, generation_config=GREEDY.replace(max_new_tokens=1),
                                   export_kv=True)).result()
    assert out.exported_kv is not None
    return out.exported_kv


def test_decode_from_imported_kv_equals_transformers(prefill_engine, decode_engine, hf_default_model):
    ids = prefill_engine.tokenizer.encode(PROMPT)
    kv = _export(prefill_engine, ids)
    assert kv.token_ids == tuple(ids)
    # K and V for every layer, one row per prompt token.
    assert len(kv.tensors) == 2 * decode_engine.model.module.num_layers
    assert all(t.shape[0] == len(ids) and t.device.type == "cpu" for t in kv.tensors)
    before = decode_engine.stats()
    out = decode_engine.submit(kt.Request(ids, generation_config=GREEDY,
                                          imported_kv=TransferredKv.from_bytes(kv.to_bytes()))).result()
    assert out.token_ids == _hf_greedy(hf_default_model, ids, 16)
    after = decode_engine.stats()
    # Every prompt token but the last (whose logits the decode engine computes) was imported.
    assert after.num_imported_kv_tokens - before.num_imported_kv_tokens == len(ids) - 1
    assert prefill_engine.stats().num_exported_kv_tokens >= len(ids)


def test_imported_kv_is_what_the_decode_engine_attends_to(prefill_engine, decode_engine):
    ids = prefill_engine.tokenizer.encode(PROMPT)
    kv = _export(prefill_engine, ids)
    # (Computed on the prefill engine: the decode engine must not hold this prompt in its
    # prefix cache yet, or it would take the cached blocks over the import.)
    want = prefill_engine.submit(kt.Request(ids, generation_config=GREEDY)).result().token_ids
    noise = TransferredKv(kv.token_ids, tuple(torch.randn_like(t) * 4 for t in kv.tensors))
    got = decode_engine.submit(kt.Request(ids, generation_config=GREEDY,
                                          imported_kv=noise)).result().token_ids
    assert got != want
    # A bad import reaches nobody else: its blocks are not published in the prefix cache.
    again = decode_engine.submit(kt.Request(ids, generation_config=GREEDY)).result().token_ids
    assert again == want


def test_common_prefix_only_is_used(prefill_engine, decode_engine, hf_default_model):
    tok = prefill_engine.tokenizer
    first = tok.encode(PROMPT)
    kv = _export(prefill_engine, first)
    other = first[:11] + tok.encode(" a completely different ending, about cats")
    before = decode_engine.stats().num_imported_kv_tokens
    out = decode_engine.submit(kt.Request(other, generation_config=GREEDY, imported_kv=kv)).result()
    assert out.token_ids == _hf_greedy(hf_default_model, other, 16)
    assert decode_engine.stats().num_imported_kv_tokens - before == 11


def test_seeded_samples_from_imported_kv_equal_a_local_prefill(prefill_engine, decode_engine):
    ids = prefill_engine.tokenizer.encode(PROMPT)
    kv = _export(prefill_engine, ids)
    config = kt.GenerationConfig(max_new_tokens=12, temperature=0.8, top_p=0.9, seed=7,
                                 num_return_sequences=2, logprobs=2)
    local = prefill_engine.submit(kt.Request(ids, generation_config=config)).result()
    remote = decode_engine.submit(kt.Request(ids, generation_config=config, imported_kv=kv)).result()
    assert [s.token_ids for s in remote.sequences] == [s.token_ids for s in local.sequences]
    for a, b in zip(remote.logprobs, local.logprobs):
        assert a["token_id"] == b["token_id"] and a["logprob"] == pytest.approx(b["logprob"],
                                                                             abs=LOGIT_ATOL)


def test_kv_transfer_errors(prefill_engine, decode_engine):
    ids = prefill_engine.tokenizer.encode(PROMPT)
    with pytest.raises(ValueError, match="export_kv needs a single sequence"):
        prefill_engine.submit(kt.Request(ids, generation_config=GREEDY.replace(
            num_return_sequences=2, temperature=1.0), export_kv=True))
    kv = _export(prefill_engine, ids)
    with pytest.raises(ValueError, match="imported_kv must be a TransferredKv"):
        decode_engine.submit(kt.Request(ids, imported_kv={"token_ids": ids}))
    with pytest.raises(ValueError, match="prompt_logprobs"):
        decode_engine.submit(kt.Request(ids, generation_config=GREEDY.replace(prompt_logprobs=1),
                                        imported_kv=kv))
    fewer_heads = TransferredKv(kv.token_ids, tuple(t[:, :1] for t in kv.tensors))
    with pytest.raises(ValueError, match="imported_kv: its cache tensors"):
        decode_engine.submit(kt.Request(ids, imported_kv=fewer_heads))
    halves = TransferredKv(kv.token_ids, tuple(t.half() for t in kv.tensors))
    with pytest.raises(ValueError, match="dtype"):
        decode_engine.submit(kt.Request(ids, imported_kv=halves))
    with pytest.raises(ValueError, match="not a KV transfer payload"):
        TransferredKv.from_bytes(b"definitely not safetensors")
    # The engines still serve.
    assert decode_engine.submit(kt.Request(ids, generation_config=GREEDY, imported_kv=kv)).result().token_ids


def test_payload_round_trip(prefill_engine):
    kv = _export(prefill_engine, prefill_engine.tokenizer.encode(PROMPT))
    back = TransferredKv.from_bytes(kv.to_bytes())
    assert back.token_ids == kv.token_ids
    assert all(torch.equal(a, b) for a, b in zip(back.tensors, kv.tensors))
    assert back.weights_fingerprint == kv.weights_fingerprint != ""
    cut = kv.truncated(5)
    assert cut.num_tokens == 5 and all(t.shape[0] == 5 for t in cut.tensors)
    assert kv.usable_prefix(list(kv.token_ids)) == kv.num_tokens - 1
    assert kv.usable_prefix([kv.token_ids[0], -1, *kv.token_ids[2:]]) == 1


def test_kv_of_a_model_with_other_weights_is_refused(tmp_path):
    """Same shapes, other weights (a fine-tune, another revision): the layout matches, the
    weights fingerprint does not. The same checkpoint in engines of other block sizes agrees."""
    from tests.tiny_models import build_tiny_model

    for seed in (0, 1):
        build_tiny_model("llama2", tmp_path / str(seed), seed=seed)
    prompt = list(range(10, 40))
    settings = {"device": "cpu", "dtype": "float32", "num_device_blocks": 32}
    with kt.Engine(tmp_path / "0", block_token_num=16, **settings) as a, \
            kt.Engine(tmp_path / "0", block_token_num=8, **settings) as same, \
            kt.Engine(tmp_path / "1", block_token_num=16, **settings) as other:
        kv = _export(a, prompt)
        with pytest.raises(ValueError, match="imported_kv: it comes from a model with other weights"):
            other.submit(kt.Request(prompt, generation_config=GREEDY, imported_kv=kv))
        assert same.submit(kt.Request(prompt, generation_config=GREEDY, imported_kv=kv)
                           ).result().token_ids == a.generate_outputs(
            [prompt], GREEDY, use_tqdm=False)[0].token_ids
        assert same.stats().num_imported_kv_tokens == len(prompt) - 1



def test_the_fingerprint_follows_update_weights(tmp_path):
    """An RL weight sync reaching one server of a prefill/decode pair before the other: KV the
    old weights made is refused by the updated engine (it took it, and decoded noise), and
    once both hold the new weights they agree again, with the tokens of the new weights."""
    from safetensors.torch import load_file

    from ksana_llm.server.app import build_app
    from tests.tiny_models import build_tiny_model

    for seed in (0, 1):
        build_tiny_model("llama2", tmp_path / str(seed), seed=seed)
    new_weights = load_file(tmp_path / "1" / "model.safetensors")
    prompt = list(range(10, 40))
    settings = {"device": "cpu", "dtype": "float32", "num_device_blocks": 32,
                "skip_tokenizer_init": True}
    with kt.Engine(tmp_path / "0", block_token_num=16, **settings) as prefill, \
            kt.Engine(tmp_path / "0", block_token_num=8, **settings) as decode, \
            kt.Engine(tmp_path / "1", block_token_num=8, **settings) as reference:
        old_kv = _export(prefill, prompt)
        # A decode server checks the KV it fetches against its engine's layout as it is then.
        server = build_app(decode, served_model_name="m", kv_role="decode").state.server
        server.kv_transfer.layout().check(old_kv)
        decode.update_weights(new_weights)
        for check in (server.kv_transfer.layout().check, lambda kv: decode.submit(
                kt.Request(prompt, generation_config=GREEDY, imported_kv=kv))):
            with pytest.raises(ValueError, match="imported_kv: it comes from a model with "
                                                 "other weights"):
                check(old_kv)
        prefill.update_weights(new_weights)
        new_kv = _export(prefill, prompt)
        assert new_kv.weights_fingerprint == reference.kv_layout.weights_fingerprint
        with pytest.raises(ValueError, match="imported_kv: it comes from a model with other weights"):
            reference.submit(kt.Request(prompt, generation_config=GREEDY, imported_kv=old_kv))
        tokens = decode.submit(kt.Request(prompt, generation_config=GREEDY, imported_kv=new_kv)
                               ).result().token_ids
        assert tokens == reference.generate_outputs([prompt], GREEDY, use_tqdm=False)[0].token_ids
        assert decode.stats().num_imported_kv_tokens == len(prompt) - 1

@pytest.mark.parametrize("preempt_mode", [0, 1])
def test_export_preempted_while_its_token_is_in_flight(default_model, preempt_mode):
    """Async scheduling: a one-token export request is preempted (swapped out, or dropped for
    recompute) while its token is on its way back, then finishes. Its KV is no longer in device
    blocks: nothing is exported (a decode server computes the prompt) and the engine goes on."""
    from ksana_llm.api.core_builder import build_core
    from ksana_llm.api.request_builder import RequestBuilder

    config = kt.EngineConfig(num_device_blocks=4, block_token_num=4, async_scheduling=True,
                             enable_prefix_caching=False, preempt_mode=preempt_mode)
    core = build_core(default_model, config, None, print)
    builder = RequestBuilder(default_model, None, max_model_len=core.max_model_len, max_num_seqs=8,
                             kv_layout=core.runner.kv_layout)
    greedy = kt.GenerationConfig(max_new_tokens=50, temperature=0, ignore_eos=True)
    decoding, _ = builder.sequence(kt.Request(list(range(10, 14)), generation_config=greedy), greedy)
    core.add(decoding)
    for _ in range(4):
        core.step()
    one = greedy.replace(max_new_tokens=1)
    # A prompt filling every free block: the decoding request's next block must come from it.
    free = core.block_manager.num_free_blocks * 4
    exporting, _ = builder.sequence(kt.Request(list(range(20, 20 + free)), generation_config=one,
                                               export_kv=True), one)
    core.add(exporting)
    outputs = []
    while core.has_work():
        outputs += core.step()
    assert exporting.num_preemptions == 1  # the case under test happened
    final = [o for o in outputs if o.request_id == exporting.request_id and o.finished]
    assert len(final) == 1 and final[0].exported_kv is None
    assert decoding.is_finished and decoding.num_tokens == core.max_model_len  # (16: the pool)
    assert core.block_manager.num_free_blocks == 4


def test_transfer_with_the_cuda_step_loop(default_model, prefill_engine, hf_default_model):
    """Both halves with async scheduling and overlapped outputs (the CUDA defaults), on CPU:
    the export equals a synchronous engine's, and decoding from it gives transformers' tokens."""
    ids = prefill_engine.tokenizer.encode(PROMPT)
    want_kv = _export(prefill_engine, ids)
    cuda_loop = dict(num_device_blocks=64, async_scheduling=True, overlap_output_processing=True)
    with kt.Engine(default_model, **cuda_loop) as prefill, \
            kt.Engine(default_model, block_token_num=8, **cuda_loop) as decode:
        kv = _export(prefill, ids)
        for mine, theirs in zip(kv.tensors, want_kv.tensors):
            torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-5)
        out = decode.submit(kt.Request(ids, generation_config=GREEDY, imported_kv=kv)).result()
        assert decode.stats().num_imported_kv_tokens == len(ids) - 1
    assert out.token_ids == _hf_greedy(hf_default_model, ids, 16)
