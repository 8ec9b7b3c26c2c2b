"""A request's own `logits_processors` (vLLM's per-request callables): checked at construction,
run after the built-in processors on each row, against `transformers.generate` with the same
processors as `LogitsProcessor`s (greedy and beam search, with and without async scheduling);
a processor that fails fails only its request; speculative decoding leaves them exact."""

from __future__ import annotations

import pytest
import torch
from transformers import LogitsProcessor, LogitsProcessorList

import ksana_llm as kt
from ksana_llm.runner.sampler import SamplingRow, process_logits
from tests.family_harness import one_thread

PROMPTS = ["The quick brown fox", "My favourite food is"]
MAX_NEW = 8


def no_repeats(output_token_ids: list[int], logits: torch.Tensor) -> torch.Tensor:
    """vLLM's two-argument form: never the same token twice in the output."""
    logits[output_token_ids] = float("-inf")
    return logits


def echo_prompt(prompt_token_ids: list[int], output_token_ids: list[int],
                logits: torch.Tensor) -> torch.Tensor:
    """The three-argument form, returning a new tensor: favour the prompt's own tokens."""
    bonus = torch.zeros_like(logits)
    bonus[prompt_token_ids] = 4.0
    return logits + bonus


class AsHF(LogitsProcessor):
    """One of our per-row processors as transformers' batch processor."""

    def __init__(self, fn, prompt_len: int) -> None:
        self.fn, self.prompt_len = fn, prompt_len

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        rows = []
        for ids, row in zip(input_ids.tolist(), scores.clone()):
            prompt, output = ids[:self.prompt_len], ids[self.prompt_len:]
            rows.append(self.fn(prompt, output, row) if self.fn is echo_prompt
                        else self.fn(output, row))
        return torch.stack(rows)


class Recorder:
    """A stateful processor: what it was called with."""

    def __init__(self) -> None:
        self.calls: list[tuple[list[int], list[int]]] = []

    def __call__(self, prompt_token_ids, output_token_ids, logits):
        self.calls.append((prompt_token_ids, output_token_ids))
        return logits


def test_config_checks_processors_and_copies_share_them():
    with pytest.raises(ValueError, match=r"logits_processors\[1\]"):
        kt.GenerationConfig(logits_processors=[no_repeats, lambda logits: logits])
    with pytest.raises(ValueError, match=r"logits_processors\[0\]"):
        kt.GenerationConfig(logits_processors=["no_repeats"])
    with pytest.raises(ValueError, match="logits_processors"):
        kt.GenerationConfig(logits_processors=no_repeats)
    recorder = Recorder()
    config = kt.GenerationConfig(logits_processors=(recorder,))
    assert config.logits_processors == [recorder]
    copy = config.replace(max_new_tokens=3)
    assert copy.logits_processors[0] is recorder and copy.logits_processors is not \
        config.logits_processors


def test_processors_run_last_on_their_rows_only():
    logits = torch.randn(3, 16, generator=torch.Generator().manual_seed(0))
    recorder = Recorder()
    bias = {3: 5.0}
    rows = [SamplingRow(kt.GenerationConfig(logit_bias=bias, logits_processors=[recorder,
                                                                                no_repeats]),
                        [1, 2], [3, 4]),
            SamplingRow(kt.GenerationConfig(logit_bias=bias), [1, 2], [3, 4]),
            SamplingRow(kt.GenerationConfig(logits_processors=[lambda out, lg: lg[:4]]), [1], [])]
    out = process_logits(logits, rows)
    plain = logits[1].clone()
    plain[3] += 5.0
    torch.testing.assert_close(out[1], plain)  # no processor: built-ins only
    banned = logits[0].clone()
    banned[[3, 4]] = float("-inf")
    torch.testing.assert_close(out[0], banned)  # after the bias: the biased token is banned
    assert recorder.calls == [([1, 2], [3, 4])] and rows[0].processor_error is None
    assert "must return a dense floating-point tensor of shape (16,), got a torch.strided " \
        "torch.float32 tensor of shape (4,)" in str(rows[2].processor_error)
    torch.testing.assert_close(out[2], logits[2])  # a failed processor leaves the logits


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _hf_tokens(hf_model, ids: list[int], fn, **kwargs) -> list[int]:
    with torch.no_grad(), one_thread():
        out = hf_model.generate(torch.tensor([ids]), max_new_tokens=MAX_NEW, do_sample=False,
                                logits_processor=LogitsProcessorList([AsHF(fn, len(ids))]),
                                pad_token_id=0, **kwargs)
    return out[0, len(ids):].tolist()


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async-scheduling"])
def test_greedy_tokens_match_transformers(default_model, hf_model, async_scheduling):
    tok = default_model.tokenizer
    prompts = [tok.encode(p) for p in PROMPTS]
    recorder = Recorder()
    with kt.Engine(default_model, num_device_blocks=128,
                   async_scheduling=async_scheduling) as engine:
        plain = [o.token_ids for o in engine.generate_outputs(
            prompts, kt.GenerationConfig(max_new_tokens=MAX_NEW), use_tqdm=False)]
        configs = [kt.GenerationConfig(max_new_tokens=MAX_NEW, logits_processors=[fn])
                   for fn in (no_repeats, echo_prompt)]
        jobs = [(ids, config) for ids in prompts for config in configs]
        # Plain requests in the same batch, and one with a stateful processor.
        jobs += [(ids, kt.GenerationConfig(max_new_tokens=MAX_NEW)) for ids in prompts]
        jobs.append((prompts[0], kt.GenerationConfig(max_new_tokens=MAX_NEW, ignore_eos=True,
                                                     logits_processors=[recorder])))
        outs = [o.token_ids for o in engine.generate_outputs(
            [ids for ids, _ in jobs], [config for _, config in jobs], use_tqdm=False)]
        assert (engine._core.num_steps_ahead > 0) == async_scheduling
    changed = set()
    for (ids, config), out in zip(jobs[:4], outs):
        fn = config.logits_processors[0]
        assert out == _hf_tokens(hf_model, ids, fn), fn.__name__
        if out != plain[prompts.index(ids)]:
            changed.add(fn.__name__)
    # Each processor changed what greedy picks for a prompt: the test can bite.
    assert changed == {"no_repeats", "echo_prompt"}
    assert outs[4:6] == plain
    # Called once per generated token, with the prompt and the output so far (all known ids).
    assert recorder.calls == [(prompts[0], outs[6][:k]) for k in range(MAX_NEW)]


def test_beam_search_matches_transformers(default_model, hf_model):
    """Beam search runs the processors on log_softmax(logits), as transformers does: the same
    beams with the same scores."""
    ids = default_model.tokenizer.encode(PROMPTS[1])
    config = kt.GenerationConfig(max_new_tokens=MAX_NEW, num_beams=3, num_return_sequences=2,
                                 logits_processors=[no_repeats])
    with kt.Engine(default_model, num_device_blocks=128) as engine:
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
    with torch.no_grad(), one_thread():
        expected = hf_model.generate(
            torch.tensor([ids]), max_new_tokens=MAX_NEW, num_beams=3, num_return_sequences=2,
            do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_scores=True,
            logits_processor=LogitsProcessorList([AsHF(no_repeats, len(ids))]))
    eos = default_model.eos_token_ids
    sequences = []
    for row in expected.sequences[:, len(ids):].tolist():
        sequences.append(row[:next((i + 1 for i, t in enumerate(row) if t in eos), len(row))])
    assert [s.token_ids for s in out.sequences] == sequences
    assert [s.score for s in out.sequences] == pytest.approx(expected.sequences_scores.tolist(),
                                                             abs=2e-4)


@pytest.mark.parametrize("settings, error", [
    ({}, RuntimeError), ({"overlap_output_processing": True}, RuntimeError),
    ({"async_scheduling": True}, RuntimeError),
    ({}, KeyboardInterrupt),  # not an Exception: it once ended the step loop for everyone
], ids=["plain", "overlap-outputs", "async-scheduling", "keyboard-interrupt"])
def test_a_failing_processor_fails_only_its_request(default_model, settings, error):
    """Whatever the step loop defers (outputs, tokens in flight) is delivered before the
    failed request ends, and the engine serves on."""
    def fails_at_third(output_token_ids, logits):
        if len(output_token_ids) == 2:
            raise error("out of ideas")
        return logits

    with kt.Engine(default_model, num_device_blocks=128, **settings) as engine:
        reference = engine.generate_outputs(PROMPTS[1], kt.GenerationConfig(
            max_new_tokens=MAX_NEW, ignore_eos=True), use_tqdm=False)[0].token_ids
        failing = engine.submit(kt.Request(PROMPTS[0], kt.GenerationConfig(
            max_new_tokens=MAX_NEW, logits_processors=[fails_at_third])))
        other = engine.submit(kt.Request(PROMPTS[1], kt.GenerationConfig(
            max_new_tokens=MAX_NEW, ignore_eos=True)))
        with pytest.raises(kt.RequestError, match=rf"logits_processors\[0\] raised "
                                                  rf"{error.__name__}: out of ideas"):
            failing.result(timeout=120)
        assert other.result(timeout=120).token_ids == reference
        assert engine.stats().num_free_kv_blocks == 128  # nothing held by the failed request
        assert engine.is_running and engine.generate("Hi", kt.GenerationConfig(max_new_tokens=2))


def test_modules_and_clones():
    """A torch Module is called as its forward takes it; one with clone() (vLLM's rule) gives
    each config copy its own."""
    class Bias(torch.nn.Module):
        def forward(self, prompt_token_ids, output_token_ids, logits):
            return logits + 1

    class Counter:
        def __init__(self) -> None:
            self.calls = 0

        def __call__(self, output_token_ids, logits):
            self.calls += 1
            return logits

        def clone(self):
            return Counter()

    rows = [SamplingRow(kt.GenerationConfig(logits_processors=[Bias()]), [1], [2])]
    logits = torch.zeros(1, 8)
    torch.testing.assert_close(process_logits(logits, rows), logits + 1)
    counter = Counter()
    copy = kt.GenerationConfig(logits_processors=[counter]).replace(max_new_tokens=2)
    assert isinstance(copy.logits_processors[0], Counter) and copy.logits_processors[0] \
        is not counter


def test_speculative_decoding_leaves_them_exact(default_model):
    # A copying task: prompt lookup has drafts for every request but the one with a
    # processor, which is not drafted for.
    tok = default_model.tokenizer
    prompt = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Copy the list: apples, bananas, cherries, dates, elderberries, figs, grapes."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    configs = [kt.GenerationConfig(max_new_tokens=24, logits_processors=[no_repeats]),
               kt.GenerationConfig(max_new_tokens=24)]
    with kt.Engine(default_model, num_device_blocks=128) as engine:
        expected = engine.generate_outputs([prompt, prompt], configs, use_tqdm=False)
    with kt.Engine(default_model, num_device_blocks=128, speculative_method="ngram",
                   num_speculative_tokens=3) as engine:
        outs = engine.generate_outputs([prompt, prompt], configs, use_tqdm=False)
        assert engine.stats().num_accepted_draft_tokens > 0
    assert [o.token_ids for o in outs] == [o.token_ids for o in expected]
    assert outs[0].token_ids != outs[1].token_ids
