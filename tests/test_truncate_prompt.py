"""vLLM's `truncate_prompt_tokens` in the Python API: generate, prompt embeddings, embed and
score keep a prompt's last k tokens, exactly as if only those had been given."""

from __future__ import annotations

import pytest
import torch

import ksana_llm as kt

PROMPT = "Once upon a time, in a land far away, there lived a curious little fox who"


def test_generate_keeps_the_last_tokens(local_engine):
    ids = local_engine.tokenizer.encode(PROMPT)
    greedy = kt.GenerationConfig(max_new_tokens=6)
    cut = local_engine.generate_outputs(PROMPT, greedy.replace(truncate_prompt_tokens=5),
                                        use_tqdm=False)[0]
    assert cut.prompt_token_ids == ids[-5:]
    assert cut.token_ids == local_engine.generate_outputs(ids[-5:], greedy,
                                                          use_tqdm=False)[0].token_ids
    assert cut.token_ids != local_engine.generate_outputs(ids, greedy, use_tqdm=False)[0].token_ids
    # -1: as many as the context holds (all of this short prompt); longer than it: all.
    for keep in (-1, len(ids) + 3):
        whole = local_engine.generate_outputs(ids, greedy.replace(truncate_prompt_tokens=keep),
                                              use_tqdm=False)[0]
        assert whole.prompt_token_ids == ids
    # Prompt embeddings: the last rows.
    hidden = local_engine.model.hf_config.hidden_size
    rows = torch.randn(len(ids), hidden, generator=torch.Generator().manual_seed(0)) * 0.05
    from_rows = local_engine.generate_outputs(
        {"prompt_embeds": rows}, greedy.replace(truncate_prompt_tokens=5), use_tqdm=False)[0]
    assert from_rows.token_ids == local_engine.generate_outputs(
        {"prompt_embeds": rows[-5:]}, greedy, use_tqdm=False)[0].token_ids


@pytest.mark.parametrize("bad", [0, -2, 1.5, True])
def test_bad_values_are_refused(local_engine, bad):
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        kt.GenerationConfig(truncate_prompt_tokens=bad)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        local_engine.embed(PROMPT, truncate_prompt_tokens=bad)


def test_more_than_the_context_is_refused(local_engine):
    """vLLM's rule: a truncation longer than max_model_len is a setting error, refused by name
    (the engine serves on)."""
    too_many = local_engine.max_model_len + 1
    config = kt.GenerationConfig(max_new_tokens=2, truncate_prompt_tokens=too_many)
    with pytest.raises(ValueError, match="truncate_prompt_tokens .* greater than max_model_len"):
        local_engine.generate_outputs(PROMPT, config, use_tqdm=False)
    with pytest.raises(ValueError, match="truncate_prompt_tokens"):
        local_engine.embed(PROMPT, truncate_prompt_tokens=too_many)
    fits = config.replace(truncate_prompt_tokens=too_many - 1)
    assert local_engine.generate_outputs(PROMPT, fits, use_tqdm=False)[0].token_ids


def test_embed_and_score_keep_the_last_tokens(local_engine):
    ids = local_engine.tokenizer.encode(PROMPT)
    cut = local_engine.embed([PROMPT, "short"], truncate_prompt_tokens=4)
    torch.testing.assert_close(cut, local_engine.embed([ids[-4:], "short"]))
    assert not torch.allclose(cut[0], local_engine.embed(PROMPT)[0])
    assert local_engine.score(PROMPT, ["a fox", "a tale"], truncate_prompt_tokens=4) == \
        pytest.approx(local_engine.score(ids[-4:], ["a fox", "a tale"]), abs=1e-6)


def test_input_embeddings_cannot_be_cut(local_engine):
    ids = local_engine.tokenizer.encode(PROMPT)
    hidden = local_engine.model.hf_config.hidden_size
    request = kt.Request(ids, kt.GenerationConfig(max_new_tokens=2, truncate_prompt_tokens=4),
                         input_embeddings=([0], torch.zeros(1, hidden)))
    with pytest.raises(ValueError, match="truncate_prompt_tokens cannot cut"):
        local_engine.submit(request)
