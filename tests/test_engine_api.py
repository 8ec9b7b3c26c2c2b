"""The Python API on the real default model: streaming, async, per-request settings, stop rules,
bad input, the prefix cache and prompt logprobs (callbacks, abort, the bounded queue, timeouts
and shutdown: test_engine_lifecycle.py; stats and memory sizing: test_engine_stats.py)."""

from __future__ import annotations

import asyncio

import pytest

import ksana_llm as kt
from tests.tolerances import LOGIT_ATOL
from tests.engine_fixtures import engine_fixture

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


engine = engine_fixture(generation_config=kt.GenerationConfig(max_new_tokens=16),
                        num_device_blocks=256)


def test_stream_joined_equals_text(engine):
    config = kt.GenerationConfig(max_new_tokens=40)
    deltas = list(engine.generate("你好！请用中文介绍一下你自己，再加一个表情符号。", config, stream=True))
    text = engine.generate("你好！请用中文介绍一下你自己，再加一个表情符号。", config)
    assert "".join(deltas) == text and len(deltas) > 1
    assert all("\ufffd" not in d for d in deltas)


def test_list_of_prompts_and_token_ids(engine):
    ids = engine.tokenizer.encode(PROMPT)
    texts = engine.generate([PROMPT, ids], use_tqdm=False)
    assert isinstance(texts, list) and texts[0] == texts[1] != ""
    out = engine.generate_outputs(ids, use_tqdm=False)[0]
    assert out.prompt_token_ids == ids and out.finish_reason in ("stop", "length")
    assert out.text == engine.tokenizer.decode(out.token_ids, skip_special_tokens=True)
    assert out.metrics.ttft is not None and out.metrics.latency >= out.metrics.ttft


def test_per_request_config_and_stop_tokens(engine):
    short, longer = kt.GenerationConfig(max_new_tokens=3), kt.GenerationConfig(max_new_tokens=9,
                                                                               ignore_eos=True)
    outs = engine.generate_outputs([PROMPT, PROMPT], [short, longer], use_tqdm=False)
    assert [len(o.token_ids) for o in outs] == [3, 9]
    assert [o.finish_reason for o in outs] == ["length", "length"]
    assert outs[1].token_ids[:3] == outs[0].token_ids
    stop_id = outs[1].token_ids[4]
    out = engine.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=9, stop_token_ids=[stop_id]),
                                  use_tqdm=False)[0]
    first = outs[1].token_ids.index(stop_id)
    assert out.token_ids == outs[1].token_ids[:first + 1] and out.finish_reason == "stop"
    assert out.stop_reason == stop_id


def test_requests_run_with_their_own_settings_in_every_call(engine):
    """generate / generate_outputs take Requests as the async calls do (alone, in a list beside
    prompts, streamed); a config or adapter given beside a Request that has its own is refused,
    not dropped; one without takes it."""
    short = kt.GenerationConfig(max_new_tokens=3)
    expected = engine.generate(PROMPT, short)
    assert engine.generate(kt.Request(PROMPT, generation_config=short)) == expected
    assert "".join(engine.generate(kt.Request(PROMPT, generation_config=short),
                                   stream=True)) == expected
    outs = engine.generate_outputs([kt.Request(PROMPT, generation_config=short), PROMPT],
                                   use_tqdm=False)
    assert outs[0].text == expected and len(outs[1].token_ids) == 16  # the engine's default
    with pytest.raises(ValueError, match="generation_config: a Request carries its own"):
        engine.generate(kt.Request(PROMPT, generation_config=short), short)
    with pytest.raises(ValueError, match="lora: a Request names its own"):
        engine.generate_outputs([kt.Request(PROMPT, lora="other")], lora="sql")
    with pytest.raises(ValueError, match="generation_config: a Request carries its own"):
        asyncio.run(engine.generate_async(kt.Request(PROMPT, generation_config=short), short))
    assert engine.generate(PROMPT, short) == expected  # nothing was queued by the refusals
    # A Request without a config of its own takes the call's (as a plain prompt does).
    assert engine.generate(kt.Request(PROMPT), short) == expected
    assert asyncio.run(engine.generate_async(kt.Request(PROMPT), short)) == expected


def test_stop_string_truncates(engine):
    full = engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=30, ignore_eos=True))
    stop = full.split()[3]
    cut = engine.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=30, stop=[stop]),
                                  use_tqdm=False)[0]
    assert cut.text == full[:full.index(stop)] and cut.finish_reason == "stop"
    assert cut.stop_reason == stop


def test_stop_strings_wait_for_min_new_tokens(engine):
    """vLLM's min_tokens: a stop string that ends within the first min_new_tokens tokens' text
    does not stop the output; the first one ending after it does."""
    full = engine.generate_outputs(PROMPT, kt.GenerationConfig(max_new_tokens=30, ignore_eos=True),
                                   use_tqdm=False)[0]
    min_tokens, stop = 8, " "
    before = engine.tokenizer.decode(full.token_ids[:min_tokens])
    assert full.text.startswith(before) and stop in before.lstrip()  # would stop there otherwise
    expected = full.text[:full.text.index(stop, len(before))]
    cut = engine.generate_outputs(PROMPT, kt.GenerationConfig(
        max_new_tokens=30, ignore_eos=True, min_new_tokens=min_tokens, stop=[stop]),
        use_tqdm=False)[0]
    assert (cut.text, cut.finish_reason, cut.stop_reason) == (expected, "stop", stop)
    assert len(cut.token_ids) > min_tokens


def test_min_new_tokens_suppresses_eos(engine, model):
    # An answer this model ends quickly; min_new_tokens forbids EOS until then.
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                 add_generation_prompt=True, tokenize=False)
    free = engine.generate_outputs(prompt, kt.GenerationConfig(max_new_tokens=64), use_tqdm=False)[0]
    assert free.finish_reason == "stop" and free.token_ids[-1] in model.eos_token_ids
    assert free.stop_reason is None  # the model's own end, as in vLLM
    forced = engine.generate_outputs(
        prompt, kt.GenerationConfig(max_new_tokens=64, min_new_tokens=len(free.token_ids) + 5),
        use_tqdm=False)[0]
    assert len(forced.token_ids) >= len(free.token_ids) + 5
    assert not set(forced.token_ids[:len(free.token_ids) + 4]) & set(model.eos_token_ids)


def test_seeded_sampling_is_reproducible(engine):
    config = kt.GenerationConfig(max_new_tokens=20, do_sample=True, temperature=1.0, top_p=0.9,
                                 seed=1234, ignore_eos=True)
    a = engine.generate(PROMPT, config)
    b = engine.generate([PROMPT, "Another prompt to share the batch.", PROMPT],
                        [config, kt.GenerationConfig(do_sample=True), config], use_tqdm=False)
    assert a == b[0] == b[2]


def test_async_generate_and_stream(engine):
    async def main():
        texts = await asyncio.gather(*(engine.generate_async(p) for p in (PROMPT, "Hello!")))
        deltas = [d async for d in engine.stream_async(PROMPT)]
        return texts, deltas

    texts, deltas = asyncio.run(main())
    assert texts[0] == engine.generate(PROMPT) and "".join(deltas) == texts[0]


@pytest.mark.parametrize("prompt, config, field", [
    ("", {}, "prompt"),
    ([], {}, "prompt"),
    ([10**9], {}, "prompt"),
    (PROMPT, {"max_new_tokens": 0}, "max_new_tokens"),
    (PROMPT, {"temperature": -0.5}, "temperature"),
    (PROMPT, {"top_p": 0.0}, "top_p"),
    (PROMPT, {"top_p": 1.5}, "top_p"),
    (PROMPT, {"top_k": -3}, "top_k"),
    (PROMPT, {"repetition_penalty": 0}, "repetition_penalty"),
    (PROMPT, {"no_such_field": 1}, "no_such_field"),
    (PROMPT, {"logit_bias": {10**7: 1.0}}, "logit_bias"),  # beyond the vocabulary
    (PROMPT, {"stop_token_ids": [2, 10**7]}, "stop_token_ids"),  # never sampled: a wrong id
    (PROMPT, {"logit_bias": {5: 101}}, "logit_bias"),
    (PROMPT, {"num_return_sequences": 3, "best_of": 2}, "best_of"),
    (PROMPT, {"num_return_sequences": 1000}, "num_return_sequences"),  # > max_num_seqs
    (PROMPT, {"prompt_logprobs": 21}, "prompt_logprobs"),
    (PROMPT, {"structured_output": {"kind": "xml"}}, "structured_output"),
    (PROMPT, {"early_stopping": "sometimes", "num_beams": 2}, "early_stopping"),
    (PROMPT, {"detokenize": 0}, "detokenize"),
    (PROMPT, {"detokenize": False, "stop": ["."]}, "stop"),  # stop strings need the text
    (PROMPT, {"seed": 2**64}, "seed"),  # past the generator's 64 bits: it would draw as 0
])
def test_bad_input_names_the_field_and_engine_keeps_serving(engine, prompt, config, field):
    with pytest.raises(ValueError, match=field):
        engine.generate(prompt, config)
    assert engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))


def test_prompt_longer_than_context(engine, model):
    too_long = [100] * model.max_context
    with pytest.raises(ValueError, match="max_model_len"):
        engine.generate(too_long)
    assert engine.is_running


@pytest.mark.parametrize("max_model_len, blocks, message", [
    (10**6, 64, r"max_model_len=1000000 is more than the model's context \(8192 tokens\)"),
    (2048, 64, r"max_model_len=2048 is more than the KV cache holds \(64 blocks x 16 tokens"),
])
def test_max_model_len_past_the_context_or_the_pool_is_refused(model, max_model_len, blocks,
                                                                message):
    """vLLM's rule: an explicit cap the engine cannot serve is an error, not silently lowered."""
    with pytest.raises(ValueError, match=message):
        kt.Engine(model, num_device_blocks=blocks, max_model_len=max_model_len)
    with kt.Engine(model, num_device_blocks=blocks, max_model_len=1024) as fits:
        assert fits.max_model_len == 1024
    with kt.Engine(model, num_device_blocks=blocks) as default:
        assert default.max_model_len == blocks * 16  # the pool, below the model's context


def test_yaml_max_token_len_past_the_context_is_lowered_to_it(model):
    """KsanaLLM's rule for its YAML's max_token_len: lowered to the model's context (with
    --max-model-len given on top, vLLM's rule above holds)."""
    from ksana_llm.yaml_config import parse_engine_config

    yaml = {"setting": {"batch_scheduler": {"max_token_len": 10**6}}}
    config, _ = parse_engine_config(yaml, {"num_device_blocks": 520})  # 8320 tokens
    assert config.clamp_max_model_len
    with kt.Engine(model, config=config) as engine:
        assert engine.max_model_len == model.max_context == 8192
    flagged, _ = parse_engine_config(yaml, {"max_model_len": 10**6, "num_device_blocks": 520},
                                     override_names={"max_model_len": "--max-model-len"})
    assert not flagged.clamp_max_model_len
    with pytest.raises(ValueError, match="is more than the model's context"):
        kt.Engine(model, config=flagged)


def test_outputs_count_the_prompt_tokens_the_prefix_cache_served(model):
    """A second request with the first one's prompt (and more) reuses its full 16-token blocks;
    beam search (ranked outputs) reports it too."""
    ids = model.tokenizer.encode(PROMPT * 3)
    with kt.Engine(model, num_device_blocks=64) as engine:
        first = engine.generate_outputs([ids], kt.GenerationConfig(max_new_tokens=2),
                                        use_tqdm=False)[0]
        again = engine.generate_outputs([ids + [42]], kt.GenerationConfig(max_new_tokens=2),
                                        use_tqdm=False)[0]
        beams = engine.generate_outputs([ids], kt.GenerationConfig(
            max_new_tokens=2, num_beams=2, num_return_sequences=2), use_tqdm=False)[0]
    assert first.num_cached_tokens == 0
    assert again.num_cached_tokens == len(ids) // 16 * 16 > 0
    assert beams.num_cached_tokens > 0


def test_cache_salt_keeps_prefix_cache_entries_apart(model):
    """Only requests with the same `cache_salt` share cached blocks (unsalted ones share among
    themselves); the salt changes nothing else."""
    ids = model.tokenizer.encode(PROMPT * 3)
    full = len(ids) // 16 * 16
    config = kt.GenerationConfig(max_new_tokens=3)
    with kt.Engine(model, num_device_blocks=64) as engine:
        def run(salt):
            output = engine.submit(kt.Request(ids, config, cache_salt=salt)).result(timeout=60)
            return output.num_cached_tokens, output.token_ids

        runs = [run(salt) for salt in ("tenant-a", None, "tenant-b", "tenant-a", None)]
        assert [cached for cached, _ in runs] == [0, 0, 0, full, full]
        assert all(tokens == runs[0][1] for _, tokens in runs)
        for bad in ("", 7):
            with pytest.raises(ValueError, match="cache_salt"):
                engine.submit(kt.Request(ids, config, cache_salt=bad))
        assert engine.generate_outputs([ids], config, use_tqdm=False)[0].token_ids == runs[0][1]


def test_stop_string_kept_and_special_tokens_shown(engine, model):
    full = engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=30, ignore_eos=True))
    stop = full.split()[3]
    kept = engine.generate_outputs(PROMPT, kt.GenerationConfig(
        max_new_tokens=30, stop=[stop], include_stop_str_in_output=True), use_tqdm=False)[0]
    assert kept.text == full[:full.index(stop) + len(stop)] and kept.stop_reason == stop
    prompt = model.tokenizer.apply_chat_template([{"role": "user", "content": "Say hi."}],
                                                 add_generation_prompt=True, tokenize=False)
    special = kt.GenerationConfig(max_new_tokens=64, skip_special_tokens=False)
    shown, unshown, hidden = engine.generate_outputs(
        [prompt] * 3, [special.replace(include_stop_str_in_output=True), special,
                       kt.GenerationConfig(max_new_tokens=64)], use_tqdm=False)
    assert shown.token_ids == hidden.token_ids == unshown.token_ids
    assert shown.token_ids[-1] in model.eos_token_ids and shown.finish_reason == "stop"
    # vLLM's rule: the EOS that ends the answer is text only with include_stop_str_in_output.
    assert shown.text == hidden.text + "<|im_end|>" and unshown.text == hidden.text


def test_detokenize_off_gives_the_same_tokens_without_text(engine):
    """vLLM's detokenize=False: the tokens of the decoded request, no text (streamed: no
    deltas), beside a request that is decoded in the same batch; n samples and beams too."""
    config = kt.GenerationConfig(max_new_tokens=10, ignore_eos=True)
    decoded, bare = engine.generate_outputs([PROMPT, PROMPT], [config, config.replace(
        detokenize=False)], use_tqdm=False)
    assert bare.token_ids == decoded.token_ids and decoded.text and bare.text == ""
    assert list(engine.generate(PROMPT, config.replace(detokenize=False), stream=True)) == []
    beams = engine.generate_outputs(PROMPT, config.replace(
        detokenize=False, num_beams=2, num_return_sequences=2), use_tqdm=False)[0]
    assert [s.text for s in beams.sequences] == ["", ""] and all(
        len(s.token_ids) == 10 for s in beams.sequences)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_token_is_in_the_token_ids_but_not_the_text(engine, model, stream):
    """As vLLM: stop_token_ids end the sequence with the token kept in token_ids; its text
    only with include_stop_str_in_output (it was always in the text, streamed as a delta)."""
    prompt = "Count from one to ten: 1, 2, 3,"
    full = engine.generate_outputs(prompt, kt.GenerationConfig(max_new_tokens=6, ignore_eos=True),
                                   use_tqdm=False)[0]
    comma = model.tokenizer.convert_tokens_to_ids(",")
    assert comma in full.token_ids
    cut = full.token_ids[:full.token_ids.index(comma) + 1]
    config = kt.GenerationConfig(max_new_tokens=6, stop_token_ids=[comma])
    for include in (False, True):
        handle = engine.submit(kt.Request(prompt, config.replace(
            include_stop_str_in_output=include)))
        streamed = "".join(handle) if stream else None
        out = handle.result(timeout=60)
        assert out.token_ids == cut and out.stop_reason == comma
        text_ids = cut if include else cut[:-1]
        assert out.text == model.tokenizer.decode(text_ids)
        assert streamed is None or streamed == out.text
        if not stream:  # beam search's answers follow the same rule
            beams = engine.generate_outputs(prompt, config.replace(
                num_beams=2, include_stop_str_in_output=include), use_tqdm=False)[0]
            assert beams.token_ids == cut and beams.text == out.text


def test_prompt_logprobs_match_transformers(model):
    import torch
    from transformers import AutoModelForCausalLM

    ids = model.tokenizer.encode(PROMPT + " It liked to sit by the window and watch the boats.")
    hf = AutoModelForCausalLM.from_pretrained(model.path, dtype=torch.float32).eval()
    with torch.no_grad():
        expected = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), dim=-1)
    # Chunked prefill, with the prompt's blocks already in the prefix cache: every prompt row
    # must still be computed (a request with prompt log-probs takes no cache hits).
    with kt.Engine(model, num_device_blocks=64, max_batch_size=64, split_fuse_token_num=7) as e:
        e.generate(ids, kt.GenerationConfig(max_new_tokens=2))
        hits = e._core.block_manager.prefix_hits
        out = e.generate_outputs(ids, kt.GenerationConfig(max_new_tokens=2, prompt_logprobs=3,
                                                          num_return_sequences=2, do_sample=True),
                                 use_tqdm=False)[0]
        assert e._core.block_manager.prefix_hits == hits
    entries = out.prompt_logprobs
    assert len(entries) == len(ids) and entries[0] is None
    for p in range(1, len(ids)):
        entry, row = entries[p], expected[p - 1]
        assert entry["token_id"] == ids[p]
        assert entry["logprob"] == pytest.approx(float(row[ids[p]]), abs=LOGIT_ATOL)
        top_v, top_i = row.topk(3)
        assert list(entry["top_logprobs"]) == top_i.tolist()
        assert list(entry["top_logprobs"].values()) == pytest.approx(top_v.tolist(), abs=LOGIT_ATOL)
        # The rank, within what the logit tolerance leaves undecided.
        lp = float(row[ids[p]])
        assert int((row > lp + LOGIT_ATOL).sum()) + 1 <= entry["rank"] <= int((row >= lp - LOGIT_ATOL).sum())
    assert any(entries[p]["rank"] > 3 for p in range(1, len(ids)))  # ranked outside the top k too
    assert len(out.sequences) == 2


def test_input_embeddings_replace_token_embeddings(engine, model):
    ids = model.tokenizer.encode(PROMPT)
    table = model.module.model.embed_tokens.weight
    swapped = list(ids)
    swapped[3], swapped[5] = model.tokenizer.encode(" dog")[0], model.tokenizer.encode(" lion")[0]
    rows = table[[swapped[3], swapped[5]]].detach().clone()
    config = kt.GenerationConfig(max_new_tokens=12, ignore_eos=True)
    plain = engine.generate_outputs(ids, config, use_tqdm=False)[0]  # its blocks are cached now
    hits = engine._core.block_manager.prefix_hits
    out = engine.submit(kt.Request(ids, config, input_embeddings=([3, 5], rows))).result(timeout=60)
    # Same ids as the cached prompt, different KV: no prefix-cache hit.
    assert engine._core.block_manager.prefix_hits == hits
    expected = engine.generate_outputs(swapped, config, use_tqdm=False)[0]
    assert out.token_ids == expected.token_ids != plain.token_ids
    with pytest.raises(ValueError, match="input_embeddings"):
        engine.submit(kt.Request(ids, config, input_embeddings=([3], rows)))
    with pytest.raises(ValueError, match="input_embeddings rows must hold finite values"):
        engine.submit(kt.Request(ids, config, input_embeddings=([3, 5], rows * float("nan"))))


def test_tokenizer_ids_past_the_vocabulary_fail_the_request_not_the_engine(model, tmp_path):
    """A text prompt whose tokens lie outside the model's vocabulary (a tokenizer that does not
    match the weights) is refused at submit; it used to fail the step and kill the engine."""
    from tests.tiny_models import build_tiny_model

    build_tiny_model("llama2", tmp_path)  # vocabulary of 256 ids
    tiny = kt.Model.from_pretrained(str(tmp_path), device="cpu", dtype="float32", progress=False)
    tokenizer_ids = model.tokenizer.encode(PROMPT)
    assert max(tokenizer_ids) >= tiny.vocab_size
    with kt.Engine(tiny, tokenizer=model.tokenizer, num_device_blocks=32) as engine:
        with pytest.raises(ValueError, match="prompt: the tokenizer gave token ids outside"):
            engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=2))
        out = engine.generate_outputs([[5, 6, 7]], kt.GenerationConfig(max_new_tokens=3,
                                                                       ignore_eos=True))
        assert len(out[0].token_ids) == 3 and engine.is_running


def test_the_model_folders_generation_config_is_the_default(tmp_path, caplog):
    """As transformers' generate() (and vLLM's LLM): the folder's generation_config.json sets the
    defaults; a value we refuse is left out with a warning; a GenerationConfig replaces them."""
    import json

    import torch

    from tests.tiny_models import build_tiny_model

    hf = build_tiny_model("llama2", tmp_path)
    path = tmp_path / "generation_config.json"
    values = json.loads(path.read_text())
    path.write_text(json.dumps({**values, "repetition_penalty": 1.3, "max_new_tokens": 8,
                                "no_repeat_ngram_size": 2, "min_p": -1.0}))
    hf.generation_config.repetition_penalty, hf.generation_config.max_new_tokens = 1.3, 8
    hf.generation_config.no_repeat_ngram_size = 2
    prompt = [5, 6, 7, 8, 9]
    with torch.no_grad():
        want = hf.generate(torch.tensor([prompt]), do_sample=False, pad_token_id=0,
                           attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    with caplog.at_level("WARNING", logger="ksana_llm.api"):
        engine = kt.Engine(str(tmp_path), device="cpu", dtype="float32", num_device_blocks=32)
    try:
        assert "min_p=-1.0 is not used" in caplog.text
        assert engine.generation_config.repetition_penalty == 1.3
        got = engine.generate_outputs([prompt], use_tqdm=False)[0].token_ids
        assert got == want[0, len(prompt):].tolist() and len(got) == 8
        plain = engine.generate_outputs([prompt], kt.GenerationConfig(max_new_tokens=3),
                                        use_tqdm=False)[0]
        assert len(plain.token_ids) == 3
    finally:
        engine.shutdown()
