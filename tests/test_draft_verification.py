"""Draft verification (`runner.draft_verification`) on synthetic logits: greedy rows keep the
argmax's tokens, sampled rows keep the sampling distribution over many draws (the speculative
sampling rule for one-hot drafts), and a seeded row emits the tokens sampling each position
alone gives, whatever the drafts. The engine end to end: tests/test_speculative_decoding.py.
"""

from __future__ import annotations

import pytest
import torch

from ksana_llm import GenerationConfig
from ksana_llm.runner.draft_verification import NO_DRAFT, verify_drafts
from ksana_llm.runner.sampler import Sampler, SamplingRow, seeded_draws, warp_logits


def _emitted(verdict: torch.Tensor, drafts: list[int], k: int) -> list[list[int]]:
    """Per sequence (k + 1 rows each): the tokens verification emits."""
    out = []
    for start in range(0, verdict.shape[0], k + 1):
        rows = verdict[start:start + k + 1].tolist()
        accepted = 0
        while accepted < k and rows[accepted][0]:
            accepted += 1
        out.append(drafts[start:start + accepted] + [rows[accepted][1]])
    return out


@pytest.mark.parametrize("draft", [0, 3])
def test_verification_keeps_the_sampling_distribution(draft):
    """k = 1: the first token follows the warped p0 whatever the draft (likely or not), and the
    second one (after an accepted draft) follows p1."""
    torch.manual_seed(0)
    vocab, num = 6, 40000
    p_logits = torch.randn(2, vocab) * 1.5
    config = GenerationConfig(do_sample=True, temperature=0.8, top_p=0.95, max_new_tokens=4)
    row = SamplingRow(config=config, prompt_token_ids=[1], output_token_ids=[])
    logits = p_logits.repeat(num, 1)
    drafts = [draft, NO_DRAFT] * num
    verdict = verify_drafts(Sampler(seed=0), logits, [row] * (2 * num), drafts)
    emitted = _emitted(verdict, drafts, 1)
    target = warp_logits(p_logits, [row, row]).softmax(dim=-1)
    first = torch.bincount(torch.tensor([e[0] for e in emitted]), minlength=vocab) / num
    assert (first - target[0]).abs().sum() / 2 < 0.015
    seconds = torch.tensor([e[1] for e in emitted if len(e) == 2])
    second = torch.bincount(seconds, minlength=vocab) / len(seconds)
    assert len(seconds) > 0.9 * num * target[0, draft].item()
    assert (second - target[1]).abs().sum() / 2 < 0.04


def test_greedy_verification_keeps_the_argmax_tokens():
    logits = torch.tensor([[0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0],
                           [0.0, 3.0, 1.0], [2.0, 0.0, 1.0], [0.0, 0.0, 5.0]])
    greedy = SamplingRow(config=GenerationConfig(), prompt_token_ids=[1], output_token_ids=[])
    drafts = [1, 2, NO_DRAFT, 1, 0, NO_DRAFT]  # first: refused at row 1; second: all accepted
    verdict = verify_drafts(Sampler(), logits, [greedy] * 6, drafts)
    assert _emitted(verdict, drafts, 2) == [[1, 0], [1, 0, 2]]


def test_seeded_verification_emits_the_tokens_sampled_one_at_a_time():
    """Row j of a seeded sequence decides output position len(output) + j with the noise the
    sampler draws there: whatever the drafts, the emitted tokens are those sampling each
    position alone gives (a refused draft's row emits that position's sample)."""
    vocab, k = 50, 3
    logits = torch.randn(k + 1, vocab, generator=torch.Generator().manual_seed(2)) * 2
    config = GenerationConfig(do_sample=True, temperature=1.0, seed=7)

    def row(num_outputs: int) -> SamplingRow:
        return SamplingRow(config=config, prompt_token_ids=[1],
                           output_token_ids=[5] * num_outputs, draws=seeded_draws(7, "cpu"))

    # Position 3 + j sampled alone from logits row j (a fresh Sampler each: no shared state).
    alone = [int(Sampler().sample(logits[j:j + 1], [row(3 + j)]).token_ids[0])
             for j in range(k + 1)]
    assert len(set(alone)) > 1
    for wrong_at in (None, 0, 1, 2):
        drafts = alone[:k]
        if wrong_at is not None:
            drafts[wrong_at] = (alone[wrong_at] + 1) % vocab
        verdict = verify_drafts(Sampler(), logits, [row(3)] * (k + 1), drafts + [NO_DRAFT])
        stop = k if wrong_at is None else wrong_at
        assert _emitted(verdict, drafts + [NO_DRAFT], k) == [alone[:stop + 1]]


def test_log_prob_columns_hold_the_draft_and_the_token_with_their_ranks():
    """With log-probs, each row carries its draft's and its own token's raw log-prob and rank in
    the row (1 = the most likely), then the top k: the entries the engine reports."""
    from ksana_llm.runner.draft_verification import (DRAFT_LOGPROB, DRAFT_RANK, TOKEN,
                                                     TOKEN_LOGPROB, TOKEN_RANK, TOP_LOGPROBS)

    vocab, k = 30, 2
    logits = torch.randn(3, vocab, generator=torch.Generator().manual_seed(4)) * 2
    config = GenerationConfig(do_sample=True, temperature=1.5, seed=3)
    rows = [SamplingRow(config=config, prompt_token_ids=[1], output_token_ids=[],
                        draws=seeded_draws(3, "cpu"))] * 3
    raw = torch.log_softmax(logits, dim=-1)
    order = raw.argsort(dim=-1, descending=True)
    drafts = [int(order[0, 5]), int(order[1, 9]), NO_DRAFT]  # unlikely drafts: ranks 6 and 10
    verdict = verify_drafts(Sampler(), logits, rows, drafts, num_top_logprobs=k)
    assert verdict.shape == (3, TOP_LOGPROBS + 2 * k)
    for r in range(3):
        token = int(verdict[r, TOKEN])
        assert verdict[r, TOKEN_LOGPROB].item() == pytest.approx(raw[r, token].item())
        assert int(verdict[r, TOKEN_RANK]) == int((raw[r] >= raw[r, token]).sum())
        if drafts[r] != NO_DRAFT:
            assert verdict[r, DRAFT_LOGPROB].item() == pytest.approx(raw[r, drafts[r]].item())
        values, ids = torch.topk(raw[r], k)
        assert verdict[r, TOP_LOGPROBS:TOP_LOGPROBS + k].tolist() == pytest.approx(values.tolist())
        assert verdict[r, TOP_LOGPROBS + k:].long().tolist() == ids.tolist()
    assert [int(verdict[r, DRAFT_RANK]) for r in range(2)] == [6, 10]
