"""no_repeat_ngram_size, logit_bias, min_new_tokens, the penalties, bad words and allowed token
ids against transformers (allowed token ids as its SuppressTokensLogitsProcessor of the rest).

Unit tests compare the batched sampler with transformers' own logits processors row by row; the
end-to-end test runs the real default model through the engine (all settings in one batch) and
compares its greedy tokens with `transformers.generate` using the equivalent processors.
"""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessor, LogitsProcessorList, MinNewTokensLengthLogitsProcessor,
                          NoBadWordsLogitsProcessor, NoRepeatNGramLogitsProcessor,
                          RepetitionPenaltyLogitsProcessor, SequenceBiasLogitsProcessor,
                          SuppressTokensLogitsProcessor)

import ksana_llm as kt
from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.sampler import SamplingRow, beam_log_probs, process_logits
from tests.family_harness import one_thread

VOCAB = 40


def _row(config: GenerationConfig, prompt: list[int], output: list[int],
         eos: tuple[int, ...] = ()) -> SamplingRow:
    return SamplingRow(config=config, prompt_token_ids=prompt, output_token_ids=output,
                       eos_token_ids=eos)


def _logits(rows: int, seed: int) -> torch.Tensor:
    return torch.randn(rows, VOCAB, generator=torch.Generator().manual_seed(seed)) * 2


def _same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert torch.equal(torch.isinf(actual), torch.isinf(expected))
    finite = torch.isfinite(expected)
    torch.testing.assert_close(actual[finite], expected[finite], rtol=1e-6, atol=1e-6)


class PresenceFrequency(LogitsProcessor):
    """OpenAI presence/frequency penalties over the generated tokens (transformers has none)."""

    def __init__(self, prompt_len: int, presence: float, frequency: float) -> None:
        self.prompt_len, self.presence, self.frequency = prompt_len, presence, frequency

    def __call__(self, input_ids: torch.LongTensor, scores: torch.Tensor) -> torch.Tensor:
        counts = torch.zeros_like(scores)
        generated = input_ids[:, self.prompt_len:]
        counts.scatter_add_(1, generated, torch.ones_like(generated, dtype=scores.dtype))
        return scores - self.presence * (counts > 0).to(scores.dtype) - self.frequency * counts


def _hf_processors(config: GenerationConfig, prompt_len: int,
                   eos: tuple[int, ...]) -> LogitsProcessorList:
    """What transformers' generate builds for `config`, in its order (+ the OpenAI penalties)."""
    procs = LogitsProcessorList()
    if config.allowed_token_ids is not None:
        vocab = max(VOCAB, max(config.allowed_token_ids) + 1, 49152)
        procs.append(SuppressTokensLogitsProcessor(
            [t for t in range(vocab) if t not in set(config.allowed_token_ids)]))
    if config.bad_words_ids:
        procs.append(NoBadWordsLogitsProcessor(config.bad_words_ids,
                                               eos_token_id=list(eos) or None))
    if config.logit_bias:
        procs.append(SequenceBiasLogitsProcessor({(t,): float(b) for t, b in config.logit_bias.items()}))
    if config.repetition_penalty != 1.0:
        procs.append(RepetitionPenaltyLogitsProcessor(config.repetition_penalty))
    if config.no_repeat_ngram_size:
        procs.append(NoRepeatNGramLogitsProcessor(config.no_repeat_ngram_size))
    stop = list(eos) + config.stop_token_ids
    if config.min_new_tokens and stop:
        procs.append(MinNewTokensLengthLogitsProcessor(prompt_len, config.min_new_tokens, stop))
    if config.presence_penalty or config.frequency_penalty:
        procs.append(PresenceFrequency(prompt_len, config.presence_penalty, config.frequency_penalty))
    return procs


def _check_rows(logits: torch.Tensor, rows: list[SamplingRow]) -> torch.Tensor:
    ours = process_logits(logits, rows)
    for i, row in enumerate(rows):
        ids = torch.tensor([row.prompt_token_ids + row.output_token_ids])
        hf = _hf_processors(row.config, len(row.prompt_token_ids), row.eos_token_ids)
        _same(ours[i:i + 1], hf(ids, logits[i:i + 1].clone()))
    return ours


# ---- unit: each processor vs transformers, batched rows with different histories -------------

def test_no_repeat_ngram_matches_hf_per_row():
    pattern = [5, 6, 7, 5, 6, 8, 5, 6]  # "5 6" was followed by 7 and 8: both banned for n=3
    rows = [
        _row(GenerationConfig(no_repeat_ngram_size=3), pattern[:3], pattern[3:]),
        _row(GenerationConfig(no_repeat_ngram_size=2), [1, 2, 1], [2, 3, 1]),
        _row(GenerationConfig(no_repeat_ngram_size=1), [4, 4, 9], []),
        _row(GenerationConfig(no_repeat_ngram_size=4), [1, 2], []),  # shorter than n: no ban
        _row(GenerationConfig(), [5, 6], [5]),  # no n-gram rule in a batch that has some
        _row(GenerationConfig(no_repeat_ngram_size=3), [VOCAB - 1, 3, VOCAB - 1, 3], [VOCAB + 5]),
        _row(GenerationConfig(no_repeat_ngram_size=2), list(range(30)) + [3], []),
    ]
    ours = _check_rows(_logits(len(rows), seed=1), rows)
    assert torch.isinf(ours[0, [7, 8]]).all() and torch.isinf(ours[0]).sum() == 2
    assert torch.isinf(ours[2, [4, 9]]).all()
    assert not torch.isinf(ours[3]).any() and not torch.isinf(ours[4]).any()


def test_logit_bias_matches_hf_sequence_bias():
    rows = [
        _row(GenerationConfig(logit_bias={3: 5.0, 7: -100.0, 0: 0.5}), [1, 2], [3]),
        _row(GenerationConfig(), [1], []),
        _row(GenerationConfig(logit_bias={VOCAB - 1: 100, 2: -2.5}), [4], [5, 6]),
    ]
    logits = _logits(3, seed=2)
    ours = _check_rows(logits, rows)
    assert ours[0, 3] == pytest.approx(float(logits[0, 3]) + 5.0)
    assert torch.equal(ours[1], logits[1])
    assert int(ours[2].argmax()) == VOCAB - 1


def test_bad_words_and_allowed_ids_match_hf_per_row():
    rows = [
        # [7] always; [5, 6] only after 5 (the history ends with 5 here); [1, 2, 3] after 1, 2.
        _row(GenerationConfig(bad_words_ids=[[7], [5, 6], [1, 2, 3]]), [9, 1, 2], [4, 5]),
        _row(GenerationConfig(bad_words_ids=[[1, 2, 3], [4, 8]]), [1, 2], [3, 1, 2]),
        _row(GenerationConfig(bad_words_ids=[[2, 3, 4, 5]]), [3], []),  # history too short
        _row(GenerationConfig(), [5], []),
        _row(GenerationConfig(allowed_token_ids=[3, 11, 12]), [1], [2]),
        _row(GenerationConfig(allowed_token_ids=[4, 9], bad_words_ids=[[4]]), [1], []),
    ]
    ours = _check_rows(_logits(len(rows), seed=5), rows)
    assert torch.isinf(ours[0, [7, 6]]).all() and torch.isinf(ours[0]).sum() == 2
    assert torch.isinf(ours[1, 3]) and torch.isinf(ours[1]).sum() == 1
    assert not torch.isinf(ours[2]).any() and not torch.isinf(ours[3]).any()
    assert torch.isfinite(ours[4]).nonzero().flatten().tolist() == [3, 11, 12]
    assert torch.isfinite(ours[5]).nonzero().flatten().tolist() == [9]
    # As transformers, an end-of-sequence token in bad_words_ids bans nothing.
    eos_row = _row(GenerationConfig(bad_words_ids=[[2], [3]]), [1], [], eos=(2,))
    banned = _check_rows(_logits(1, seed=6), [eos_row])
    assert torch.isinf(banned[0]).nonzero().flatten().tolist() == [3]
    with pytest.raises(ValueError, match="allowed_token_ids"):
        GenerationConfig(allowed_token_ids=[4], bad_words_ids=[[4]])


def test_all_processors_together_in_transformers_order():
    config = GenerationConfig(logit_bias={3: -3.0, 9: 2.0}, repetition_penalty=1.7,
                              no_repeat_ngram_size=2, min_new_tokens=4, presence_penalty=0.6,
                              frequency_penalty=0.4, stop_token_ids=[11])
    rows = [_row(config, [3, 9, 3, 12], [9, 3, 9], eos=(2,)),
            _row(config, [1, 2, 3], [4, 4, 4, 4, 4], eos=(2,)),  # past min_new_tokens
            _row(GenerationConfig(repetition_penalty=0.8), [3, 4], [5], eos=(2,))]
    ours = _check_rows(_logits(3, seed=3), rows)
    assert torch.isinf(ours[0, [2, 11]]).all() and not torch.isinf(ours[1, [2, 11]]).any()


def test_beam_log_probs_process_the_log_softmax():
    config = GenerationConfig(num_beams=2, repetition_penalty=1.5, no_repeat_ngram_size=2,
                              logit_bias={4: 1.0})
    rows = [_row(config, [1, 2, 1], [3]), _row(GenerationConfig(num_beams=2), [1], [])]
    logits = _logits(2, seed=4)
    processed, raw = beam_log_probs(logits, rows)
    torch.testing.assert_close(raw, torch.log_softmax(logits, dim=-1))
    hf = _hf_processors(config, 3, ())(torch.tensor([[1, 2, 1, 3]]), raw[:1].clone())
    _same(processed[:1], hf)
    torch.testing.assert_close(processed[1], raw[1])


# ---- end to end: the real model's greedy tokens vs transformers ------------------------------
#
# transformers' greedy decoding picks argmax(processors(ids so far, next-token logits)) at every
# step. One forward of transformers' model over prompt + our output gives every step's logits, so
# checking each of our tokens against that argmax (and that we stopped exactly at EOS or the
# limit) verifies the whole greedy sequence at the cost of one forward instead of a generate loop.

MAX_NEW = 16
PROMPTS = [
    "List the days of the week: Monday, Tuesday,",
    "Repeat after me: I like cats. I like cats. I like cats. I like",
]
CONFIGS = {
    "no_repeat_ngram_2": GenerationConfig(max_new_tokens=MAX_NEW, no_repeat_ngram_size=2),
    "no_repeat_ngram_3": GenerationConfig(max_new_tokens=MAX_NEW, no_repeat_ngram_size=3),
    "repetition_penalty": GenerationConfig(max_new_tokens=MAX_NEW, repetition_penalty=1.3),
    "presence_frequency": GenerationConfig(max_new_tokens=MAX_NEW, presence_penalty=1.0,
                                           frequency_penalty=0.8),
}


@pytest.fixture(scope="module")
def hf_model(default_model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(default_model_dir, dtype=torch.float32).eval()


def _check_greedy(hf_model, ids: list[int], out: list[int], config: GenerationConfig,
                  eos: tuple[int, ...]) -> None:
    full = torch.tensor([ids + out])
    with torch.no_grad(), one_thread():
        logits = hf_model(full).logits[0].float()
    procs = _hf_processors(config, len(ids), eos)
    for j, token in enumerate(out):
        pos = len(ids) + j - 1  # the row predicting output token j
        expected = int(procs(full[:, :pos + 1], logits[pos:pos + 1].clone()).argmax())
        assert token == expected, f"token {j}: ours {token} != transformers {expected} ({out})"
    assert len(out) == config.max_new_tokens or out[-1] in eos


@pytest.mark.parametrize("run_ahead", [False, True], ids=["sync", "async-scheduling"])
def test_greedy_with_processors_matches_transformers(default_model, hf_model, run_ahead):
    """With async scheduling the penalties and n-gram bans run ahead of the read-back, reading
    the token ids the sampler keeps on the device."""
    tok = default_model.tokenizer
    chat = tok.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                   add_generation_prompt=True, tokenize=False)
    prompts = [tok.encode(p) for p in PROMPTS]
    eos = default_model.eos_token_ids
    configs = dict(CONFIGS)
    jobs = [(name, ids) for name in configs for ids in prompts]
    with kt.Engine(default_model, num_device_blocks=256, async_scheduling=run_ahead) as engine:
        plain = [o.token_ids for o in engine.generate_outputs(
            prompts + [chat], GenerationConfig(max_new_tokens=MAX_NEW), use_tqdm=False)]
        assert plain[2][-1] in eos and len(plain[2]) < MAX_NEW  # the chat answer ends early
        # logit_bias: forbid the tokens plain greedy picks first, favour another one.
        configs["logit_bias"] = GenerationConfig(max_new_tokens=MAX_NEW, logit_bias={
            plain[0][0]: -100.0, plain[1][0]: -100.0, 578: 3.0})
        configs["min_new_tokens"] = GenerationConfig(max_new_tokens=MAX_NEW, min_new_tokens=MAX_NEW)
        # Bad words: each prompt's first two greedy tokens as a word, and its third alone.
        configs["bad_words"] = GenerationConfig(max_new_tokens=MAX_NEW, bad_words_ids=[
            plain[0][:2], plain[1][:2], [plain[0][2]], [plain[1][2]]])
        # Allowed ids: the greedy answers' tokens from the third on (and EOS).
        configs["allowed_token_ids"] = GenerationConfig(max_new_tokens=MAX_NEW, allowed_token_ids=sorted(
            {*plain[0][2:], *plain[1][2:], *eos}))
        jobs = [(name, ids) for name in configs for ids in prompts]
        jobs[-1] = ("min_new_tokens", tok.encode(chat))
        outs = engine.generate_outputs([ids for _, ids in jobs], [configs[n] for n, _ in jobs],
                                       use_tqdm=False)
        assert (engine._core.num_steps_ahead > 0) == run_ahead
    reference = {tuple(p): o for p, o in zip(prompts + [tok.encode(chat)], plain)}
    changed = set()
    for (name, ids), out in zip(jobs, outs):
        _check_greedy(hf_model, ids, out.token_ids, configs[name], eos)
        if out.token_ids != reference[tuple(ids)]:
            changed.add(name)
    # Every setting changed the greedy output of at least one prompt, so the test can bite.
    assert changed == set(configs), f"settings that changed nothing: {set(configs) - changed}"
