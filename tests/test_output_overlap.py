"""Overlapped output processing (`EngineConfig.overlap_output_processing`): a step's tokens are
detokenized and delivered while the next step's forward runs.

On a CPU nothing actually runs concurrently, so these tests pin down what must not change and
that the deferral really happens: every output equals the one the same engine gives without
overlap (same model, same batch), streams join into the final text, aborts lose nothing, and
the core hands a token's output over during the following step."""

from __future__ import annotations

import pytest

import ksana_llm as kt

PROMPT = "Once upon a time, in a small village by the sea, there lived a cat named"


def _chat(model, text: str) -> str:
    return model.tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                               add_generation_prompt=True, tokenize=False)


def _mixed_requests(model) -> list[tuple[str, kt.GenerationConfig]]:
    """One batch touching every output path: deferred (plain, logprobs, n>1, penalties, EOS,
    stop tokens, prompt log-probs) and kept in their own step (stop strings, best_of, beams).
    Penalties and n-gram bans read the sampler's device copy of the ids, and run ahead."""
    cfg = kt.GenerationConfig
    return [
        (PROMPT, cfg(max_new_tokens=24, ignore_eos=True)),
        (_chat(model, "Say hi."), cfg(max_new_tokens=64)),  # ends on EOS
        (PROMPT, cfg(max_new_tokens=20, stop_token_ids=[264])),
        (PROMPT, cfg(max_new_tokens=30, stop=[" the"])),
        (PROMPT, cfg(max_new_tokens=16, do_sample=True, temperature=0.8, top_p=0.9, seed=7,
                     logprobs=2)),
        (PROMPT, cfg(max_new_tokens=12, do_sample=True, num_return_sequences=2, seed=3)),
        (PROMPT, cfg(max_new_tokens=8, do_sample=True, num_return_sequences=2, best_of=3, seed=5)),
        (PROMPT, cfg(max_new_tokens=8, num_beams=2)),
        ("The capital of France is", cfg(max_new_tokens=6, prompt_logprobs=1, logprobs=0)),
        (PROMPT, cfg(max_new_tokens=16, repetition_penalty=1.3, presence_penalty=0.5,
                     no_repeat_ngram_size=2, logit_bias={11: -5.0}, min_new_tokens=4)),
        ("你好！请用中文介绍一下你自己。", cfg(max_new_tokens=20, ignore_eos=True)),
        (PROMPT, cfg(max_new_tokens=14, do_sample=True, num_return_sequences=2, seed=9,
                     repetition_penalty=1.2, frequency_penalty=0.8, logprobs=1)),
    ]


def _summary(out: kt.RequestOutput) -> tuple:
    return (out.text, out.token_ids, out.finish_reason, out.stop_reason, out.logprobs,
            out.prompt_logprobs, out.cumulative_logprob,
            [(s.text, s.token_ids, s.finish_reason, s.stop_reason, s.cumulative_logprob)
             for s in out.sequences])


def _split_floats(value, floats: list[float]):
    """`value` with every float taken out (into `floats`, in order): what must match exactly."""
    if isinstance(value, float):
        floats.append(value)
        return "<float>"
    if isinstance(value, dict):
        return {k: _split_floats(v, floats) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_split_floats(v, floats) for v in value]
    return value


def _assert_same_outputs(expected: kt.RequestOutput, got: kt.RequestOutput, exact: bool) -> None:
    """Equal outputs; with `exact=False` log-probs may differ in float rounding (a sequence
    recomputed in another step runs in another batch shape), everything else may not."""
    if exact:
        assert _summary(got) == _summary(expected)
        return
    want_floats: list[float] = []
    got_floats: list[float] = []
    assert _split_floats(_summary(got), got_floats) == \
        _split_floats(_summary(expected), want_floats)
    assert got_floats == pytest.approx(want_floats, rel=1e-4, abs=1e-4)


# (overlap_output_processing, async_scheduling); the last is the CUDA default.
MODES = {"serial": (False, False), "overlap": (True, False), "async": (False, True),
         "overlap+async": (True, True)}


@pytest.mark.parametrize("blocks, preempt_mode", [(256, 0), (20, 1), (24, 0)],
                         ids=["roomy", "recomputing", "swapping"])
def test_overlapped_outputs_equal_the_serial_ones(default_model, blocks, preempt_mode):
    requests = _mixed_requests(default_model)
    prompts, configs = [p for p, _ in requests], [c for _, c in requests]
    results, preemptions = {}, {}
    for mode, (overlap, run_ahead) in MODES.items():
        with kt.Engine(default_model, num_device_blocks=blocks, preempt_mode=preempt_mode,
                       overlap_output_processing=overlap, async_scheduling=run_ahead,
                       seed=0) as engine:
            core = engine._core
            assert (core.overlap_outputs, core.async_scheduling) == (overlap, run_ahead)
            results[mode] = engine.generate_outputs(prompts, configs, use_tqdm=False)
            preemptions[mode] = core.stats().num_preemptions
            # Steps with beams wait for their tokens; the others ran ahead.
            assert (core.num_steps_ahead >= 5) if run_ahead else core.num_steps_ahead == 0
    # Async scheduling computes a row for a sequence that already stopped, so some steps run in
    # another batch shape (the CPU's matmuls then round log-probs differently, by ~1e-6); under
    # preemption, who is preempted when (and so recomputed in which batch) may differ too.
    for mode, (_, run_ahead) in MODES.items():
        for serial, other in zip(results["serial"], results[mode]):
            _assert_same_outputs(serial, other, exact=not run_ahead)
    assert preemptions["overlap"] == preemptions["serial"]
    if blocks < 256:
        assert preemptions["serial"] > 0  # the small cache really made sequences preempt
    finish = {o.finish_reason for o in results["serial"]}
    assert finish == {"length", "stop"}


@pytest.mark.parametrize("run_ahead", [False, True], ids=["overlap", "overlap+async"])
def test_overlapped_stream_joins_into_the_text_and_abort_loses_nothing(default_model, run_ahead):
    tokenizer = default_model.tokenizer
    with kt.Engine(default_model, num_device_blocks=256, overlap_output_processing=True,
                   async_scheduling=run_ahead) as engine:
        config = kt.GenerationConfig(max_new_tokens=40, ignore_eos=True)
        prompt = "你好！请用中文介绍一下你自己，再加一个表情符号。"
        deltas = list(engine.generate(prompt, config, stream=True))
        full = engine.generate_outputs(prompt, config, use_tqdm=False)[0]
        assert "".join(deltas) == full.text and len(deltas) > 1
        assert all("\ufffd" not in d for d in deltas)
        # Cut inside a character: the text held back for it comes out with the last output,
        # less the incomplete character (vLLM's rule: no trailing U+FFFD).
        cut = next(k for k in range(1, len(full.token_ids))
                   if tokenizer.decode(full.token_ids[:k], skip_special_tokens=True).endswith("\ufffd"))
        short = engine.generate_outputs(prompt, config.replace(max_new_tokens=cut), use_tqdm=False)[0]
        assert short.text == tokenizer.decode(full.token_ids[:cut],
                                              skip_special_tokens=True).rstrip("\ufffd")
        assert short.token_ids == full.token_ids[:cut]  # the cut character's bytes are kept

        handle = engine.submit(kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=500,
                                                                      ignore_eos=True)))
        stream = iter(handle)
        next(stream)
        engine.abort(handle.id)
        out = handle.result(timeout=60)
        assert out.finish_reason == "abort" and 0 < len(out.token_ids) < 500
        assert out.text == tokenizer.decode(out.token_ids, skip_special_tokens=True)
        assert engine.generate(PROMPT, kt.GenerationConfig(max_new_tokens=4)) != ""


def test_a_tokens_output_is_made_during_the_next_step(default_model):
    """The mechanism itself, on the core: token k's output reaches `early` inside step k + 1,
    before that step's token is read back (the sequence still knows k tokens); the last token's
    output, with no step left to overlap, comes back from its own step."""
    with kt.Engine(default_model, num_device_blocks=64, overlap_output_processing=True,
                   async_scheduling=False) as engine:
        engine._stop_step_loop()  # drive the core by hand from here on
        core = engine._core
        request = kt.Request(PROMPT, kt.GenerationConfig(max_new_tokens=5, ignore_eos=True))
        seq, _ = engine._requests.sequence(request, engine.generation_config)
        core.add(seq)
        early: list[tuple[int, list[int], str]] = []
        returned = []
        while core.has_work():
            returned.append(core.step(early=lambda outs: early.extend(
                (len(seq.output_token_ids) - seq.num_pending_tokens, o.new_token_ids,
                 o.text_delta) for o in outs)))
        tokens = seq.output_token_ids
        assert [(n, ids) for n, ids, _ in early] == [(k, [tokens[k - 1]]) for k in range(1, 5)]
        assert returned[:-1] == [[]] * 4
        assert [o.new_token_ids for o in returned[-1]] == [[tokens[4]]] and returned[-1][0].finished
        text = "".join(d for _, _, d in early) + returned[-1][0].text_delta
        assert text == default_model.tokenizer.decode(tokens, skip_special_tokens=True)
