"""vLLM's `logprobs_mode` (`EngineConfig.logprobs_mode`, `--logprobs-mode`): what requested
log-probs report, checked against transformers' logits on the same weights with transformers'
own processors and warpers: raw logits (samples, prompt log-probs, beams, speculative
verification), and the processed log-probs / logits a token was chosen from."""

from __future__ import annotations

import pytest
import torch
from transformers import (LogitsProcessorList, RepetitionPenaltyLogitsProcessor,
                          TemperatureLogitsWarper, TopKLogitsWarper)

import ksana_llm as kt
from ksana_llm.runner.sampler import Sampler
from tests.family_harness import one_thread

PROMPT = "The quick brown fox"
TOP = 3


def _hf_logits(hf_model, ids: list[int]) -> torch.Tensor:
    """transformers' logits [len(ids), V] over the whole sequence."""
    with torch.no_grad(), one_thread():
        return hf_model(torch.tensor([ids])).logits[0].float()


def _check_entries(entries, expected_rows: torch.Tensor, k: int) -> None:
    """Each entry's chosen value, its rank in the row (1 = the largest; values within the
    tolerance of the chosen one may fall either side) and top-k (ids and values) are those of
    its expected row."""
    assert len(entries) == len(expected_rows)
    for entry, row in zip(entries, expected_rows):
        value = float(row[entry["token_id"]])
        assert entry["logprob"] == pytest.approx(value, abs=2e-3)
        assert int((row > value + 2e-3).sum()) + 1 <= entry["rank"] <= int((row >= value - 2e-3).sum())
        values, ids = torch.topk(row, k)
        assert list(entry["top_logprobs"]) == ids.tolist()
        assert list(entry["top_logprobs"].values()) == pytest.approx(values.tolist(), abs=2e-3)


def test_raw_logits_of_samples_and_prompts(default_model, hf_default_model):
    ids = default_model.tokenizer.encode(PROMPT)
    config = kt.GenerationConfig(max_new_tokens=6, logprobs=TOP, prompt_logprobs=TOP)
    with kt.Engine(default_model, num_device_blocks=64, logprobs_mode="raw_logits") as engine:
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
    logits = _hf_logits(hf_default_model, ids + out.token_ids)
    _check_entries(out.logprobs, logits[len(ids) - 1:-1], TOP)
    # Logits, not log-probs: the chosen values are not all negative.
    assert any(entry["logprob"] > 0 for entry in out.logprobs)
    assert out.sequences[0].cumulative_logprob == pytest.approx(
        sum(entry["logprob"] for entry in out.logprobs), abs=1e-3)
    # Prompt log-probs stay log-probs, as vLLM's model runner computes them.
    prompt_entries = out.prompt_logprobs[1:]
    _check_entries(prompt_entries, torch.log_softmax(logits[:len(ids) - 1], dim=-1), TOP)
    for entry, row in zip(prompt_entries, logits):
        assert entry["rank"] == int((row >= row[entry["token_id"]]).sum())


def test_processed_logprobs_of_a_sampled_request(default_model, hf_default_model):
    """After the repetition penalty, temperature and top-k: the distribution sampled from."""
    ids = default_model.tokenizer.encode(PROMPT)
    config = kt.GenerationConfig(max_new_tokens=6, do_sample=True, temperature=0.7, top_k=5,
                                 repetition_penalty=1.3, seed=3, logprobs=TOP)
    with kt.Engine(default_model, num_device_blocks=64,
                   logprobs_mode="processed_logprobs") as engine:
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
    full = ids + out.token_ids
    logits = _hf_logits(hf_default_model, full)
    steps = LogitsProcessorList([RepetitionPenaltyLogitsProcessor(1.3),
                                 TemperatureLogitsWarper(0.7), TopKLogitsWarper(5)])
    expected = torch.stack([
        torch.log_softmax(steps(torch.tensor([full[:n]]), logits[n - 1:n].clone())[0], dim=-1)
        for n in range(len(ids), len(full))])
    _check_entries(out.logprobs, expected, TOP)
    assert any(entry["rank"] > 1 for entry in out.logprobs)  # sampled: not always the top one
    # Tokens outside the top 5 are gone: the kept ones carry all the probability.
    for row in expected:
        assert torch.isfinite(row).sum() == 5


def test_processed_logits_of_a_greedy_request(default_model, hf_default_model):
    """Logit bias, then the repetition penalty (transformers' order); greedy rows have no
    temperature, so the chosen token's processed logit is the row's largest."""
    ids = default_model.tokenizer.encode(PROMPT)
    favoured = default_model.tokenizer.encode(" cat")[0]
    config = kt.GenerationConfig(max_new_tokens=5, logit_bias={favoured: 4.0},
                                 repetition_penalty=1.5, logprobs=TOP)
    with kt.Engine(default_model, num_device_blocks=64,
                   logprobs_mode="processed_logits") as engine:
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
    full = ids + out.token_ids
    logits = _hf_logits(hf_default_model, full)
    rows = []
    for n in range(len(ids), len(full)):
        row = logits[n - 1].clone()
        row[favoured] += 4.0
        rows.append(RepetitionPenaltyLogitsProcessor(1.5)(torch.tensor([full[:n]]),
                                                          row[None])[0])
    _check_entries(out.logprobs, torch.stack(rows), TOP)
    for entry in out.logprobs:
        assert entry["logprob"] == pytest.approx(max(entry["top_logprobs"].values()))


def test_raw_logits_of_beams(default_model, hf_default_model):
    ids = default_model.tokenizer.encode(PROMPT)
    config = kt.GenerationConfig(max_new_tokens=4, num_beams=2, num_return_sequences=2,
                                 logprobs=TOP)
    with kt.Engine(default_model, num_device_blocks=64, logprobs_mode="raw_logits") as engine:
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
    assert len(out.sequences) == 2
    for seq in out.sequences:
        logits = _hf_logits(hf_default_model, ids + seq.token_ids)
        _check_entries(seq.logprobs, logits[len(ids) - 1:-1], TOP)
    assert any(entry["rank"] > 1 for seq in out.sequences for entry in seq.logprobs)


def test_raw_logits_through_speculative_verification(default_model, hf_default_model):
    tok = default_model.tokenizer
    ids = tok.encode(tok.apply_chat_template(
        [{"role": "user", "content": "Copy the list: apples, bananas, cherries, dates, "
                                     "elderberries, figs, grapes."}],
        add_generation_prompt=True, tokenize=False), add_special_tokens=False)
    config = kt.GenerationConfig(max_new_tokens=16, logprobs=TOP)
    with kt.Engine(default_model, num_device_blocks=128, speculative_method="ngram",
                   num_speculative_tokens=3, logprobs_mode="raw_logits") as engine:
        out = engine.generate_outputs(ids, config, use_tqdm=False)[0]
        assert engine.stats().num_accepted_draft_tokens > 0
    logits = _hf_logits(hf_default_model, ids + out.token_ids)
    _check_entries(out.logprobs, logits[len(ids) - 1:-1], TOP)


def test_best_of_needs_log_probs_to_rank(default_model):
    """best_of ranks samples by summed log-probs: refused when they are logits, served when
    they are processed log-probs."""
    config = kt.GenerationConfig(max_new_tokens=3, do_sample=True, best_of=3, seed=2)
    with kt.Engine(default_model, num_device_blocks=64, logprobs_mode="raw_logits") as engine:
        with pytest.raises(ValueError, match=r"best_of \(3\) ranks samples by their summed "
                                             r"log-probs, but this engine's logprobs_mode "
                                             r"\(raw_logits\) reports logits"):
            engine.submit(kt.Request(PROMPT, config))
        assert len(engine.generate_outputs(PROMPT, config.replace(best_of=None),
                                           use_tqdm=False)[0].token_ids) == 3
    with kt.Engine(default_model, num_device_blocks=64,
                   logprobs_mode="processed_logprobs") as engine:
        out = engine.generate_outputs(PROMPT, config, use_tqdm=False)[0]
    assert len(out.token_ids) == 3 and out.sequences[0].cumulative_logprob <= 0


def test_the_setting_and_its_flag():
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    config = configs_from_args(parse(["serve", "--logprobs-mode", "processed_logits"]))[0]
    assert config.logprobs_mode == "processed_logits"
    assert configs_from_args(parse(["serve"]))[0].logprobs_mode == "raw_logprobs"
    with pytest.raises(SystemExit):
        parse(["serve", "--logprobs-mode", "logits"])
    with pytest.raises(ValueError, match="logprobs_mode"):
        kt.EngineConfig(logprobs_mode="logits")
    with pytest.raises(ValueError, match="logprobs_mode must be one of raw_logprobs"):
        Sampler(logprobs_mode="logits")



@pytest.mark.parametrize("k", [0, 3])
def test_prompt_logprobs_in_row_slices_are_the_same_numbers(k):
    """token_logprobs takes a long prompt chunk's rows a slice at a time (a whole 8,192-token
    chunk over a 150k vocabulary would need over 10 GB at once): slices of 5 rows, or of 1,
    give exactly what one pass gives, and no rows give empty results."""
    from ksana_llm.runner.prompt_logprobs import token_logprobs

    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(37, 101, generator=generator)
    logits[3, 7] = logits[3, 8] = logits[3].max() + 1  # a tie: ranks count it against the token
    ids = torch.randint(0, 101, (37,), generator=generator)
    ids[3] = 8
    whole = token_logprobs(logits, ids, k)
    assert whole[1][3] == 2
    for chunk in (101 * 5, 1):
        for got, want in zip(token_logprobs(logits, ids, k, chunk_elements=chunk), whole):
            assert torch.equal(got, want)
    empty = token_logprobs(logits[:0], ids[:0], k)
    assert [tuple(t.shape) for t in empty] == [(0,), (0,), (0, k), (0, k)]
