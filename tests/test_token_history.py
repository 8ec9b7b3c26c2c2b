"""The sampler's device copy of the token ids of rows with penalties or n-gram bans
(`runner.token_history`).

The penalties and bans computed from it must equal those computed from the rows' own token
lists (which `test_sampler.py` and `test_logits_processors.py` check against transformers) at
every step, as the sampler extends it with the tokens it samples: across slot reuse, table growth
and ids beyond the logits. On a CUDA machine the first test also runs on the GPU (the GPU
benchmark's `tests` stage), against the token lists on the CPU.
"""

from __future__ import annotations

import gc

import pytest
import torch

from ksana_llm.generation_config import GenerationConfig
from ksana_llm.runner.logits_processing import process_logits
from ksana_llm.runner.sampler import Sampler, SamplingRow
from ksana_llm.runner.token_history import TokenHistories

VOCAB = 50
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _random_row(config: GenerationConfig, prompt_len: int, seed: int) -> SamplingRow:
    g = torch.Generator().manual_seed(seed)
    # Some prompt ids lie past the logits (a tokenizer's added tokens): never penalised, and
    # two different ones are different n-gram tokens.
    prompt = torch.randint(0, VOCAB + 5, (prompt_len,), generator=g).tolist()
    if config.no_repeat_ngram_size:
        # Few distinct ids, so the prompt repeats n-grams: bans from the first step on.
        prompt = [[0, 1, 2, 3, 4, 5, VOCAB + 1, VOCAB + 3][t % 8] for t in prompt]
    return SamplingRow(config=config, prompt_token_ids=prompt, output_token_ids=[])


def _configs() -> list[GenerationConfig]:
    return [
        GenerationConfig(repetition_penalty=1.4),
        GenerationConfig(presence_penalty=0.7, frequency_penalty=0.4),
        GenerationConfig(repetition_penalty=0.8, frequency_penalty=-0.3, do_sample=True,
                         temperature=0.9),
        GenerationConfig(),  # no penalty: holds no slot
        GenerationConfig(presence_penalty=-1.0, do_sample=True, top_k=5, seed=3),
        GenerationConfig(no_repeat_ngram_size=2),
        GenerationConfig(no_repeat_ngram_size=3, repetition_penalty=1.2, presence_penalty=0.3),
    ]


@pytest.mark.parametrize("device", DEVICES)
def test_device_ids_give_the_penalties_of_the_token_lists_at_every_step(device: str) -> None:
    sampler = Sampler(seed=0)
    configs = _configs()
    # Prompts long enough to widen the table (256 ids at first), and more rows than its first
    # 8 slots: it must grow both ways. A small vocabulary makes repeated n-grams common.
    rows = [_random_row(configs[i % len(configs)], 40 + 30 * i, seed=i) for i in range(12)]
    histories = sampler.token_histories(torch.device(device), VOCAB)
    g = torch.Generator().manual_seed(1)
    for step in range(12):
        logits = torch.randn(len(rows), VOCAB, generator=g) * 3
        # The same gathers and scatters over the same ids: exact on the same device.
        expected = process_logits(logits, rows)
        got = process_logits(logits.to(device), rows, histories).cpu()
        if device == "cpu":
            assert torch.equal(got, expected)
        else:
            torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6)
        tokens = sampler.sample(logits.to(device), rows).token_ids.tolist()
        for row, token in zip(rows, tokens):
            row.output_token_ids.append(token)
        if step == 5:
            # Rows finish and new ones take their slots: a reused slot is refilled first.
            for row in rows[:4]:
                sampler.release(row)
            rows[:4] = [_random_row(configs[i % len(configs)], 7 + i, seed=100 + i)
                        for i in range(4)]
    tracked = sum(1 for row in rows if row.uses_token_history)
    assert histories.num_rows == tracked
    assert histories.capacity == 16 and histories.width >= 40 + 30 * 11 + 12
    assert sorted(histories.lengths[s] for s in histories.slots(
        [r for r in rows if r.uses_token_history])) == sorted(
        len(r.prompt_token_ids) + len(r.output_token_ids) for r in rows if r.uses_token_history)


def test_a_row_nobody_releases_frees_its_slot_when_it_is_gone() -> None:
    histories = TokenHistories(VOCAB, torch.device("cpu"), capacity=2)
    rows = [_random_row(GenerationConfig(repetition_penalty=1.2), 5, seed=i) for i in range(2)]
    assert histories.slots(rows) == [0, 1]
    del rows[0]
    gc.collect()
    assert histories.num_rows == 1
    newcomer = _random_row(GenerationConfig(frequency_penalty=0.5), 3, seed=9)
    assert histories.slots([newcomer]) == [0] and histories.capacity == 2


def test_a_history_holding_a_token_not_read_back_is_refused() -> None:
    histories = TokenHistories(VOCAB, torch.device("cpu"))
    row = _random_row(GenerationConfig(repetition_penalty=1.2), 5, seed=0)
    row.output_token_ids.append(-1)  # async scheduling's placeholder
    with pytest.raises(RuntimeError, match="not yet read back"):
        histories.slots([row])
