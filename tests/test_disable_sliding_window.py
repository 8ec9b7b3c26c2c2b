"""vLLM's `disable_sliding_window` (`EngineConfig`, `--disable-sliding-window`): sequences are
capped at the model's sliding window, within which its tokens are transformers' (windowed
attention there is full attention); longer prompts are refused, a larger `max_model_len` is a
clear error, and a model without a window ignores the setting."""

from __future__ import annotations

import pytest

import ksana_llm as kt
from tests.family_harness import greedy_trace, hf_reference
from tests.tiny_models import build_tiny_model

WINDOW = 24  # tests.tiny_models' "mistral-sliding"


def _engine(folder, **settings) -> kt.Engine:
    return kt.Engine(str(folder), device="cpu", dtype="float32", num_device_blocks=64,
                     block_token_num=4, **settings)


def _check_capped_tokens(folder, reference) -> tuple[list[int], list[int]]:
    """The model serves its whole context without the flag and its window with it, within
    which 6 greedy tokens are the reference's. (prompt, reference trace)."""
    prompt = list(range(3, 3 + WINDOW - 6))
    expected, _ = greedy_trace(reference, prompt, 6)
    with _engine(folder) as engine:
        assert engine.max_model_len > WINDOW  # the model's context
    with _engine(folder, disable_sliding_window=True) as engine:
        assert engine.max_model_len == WINDOW
        out = engine.generate_outputs(prompt, kt.GenerationConfig(max_new_tokens=6,
                                                                  ignore_eos=True),
                                      use_tqdm=False)[0]
        assert out.token_ids == expected[len(prompt):]
    return prompt, expected


def test_sequences_are_capped_at_the_window(tmp_path):
    folder = tmp_path / "mistral"
    reference = hf_reference(build_tiny_model("mistral-sliding", folder))
    prompt, expected = _check_capped_tokens(folder, reference)
    with _engine(folder, disable_sliding_window=True) as engine:
        with pytest.raises(ValueError, match="max_model_len"):
            engine.submit(kt.Request(list(range(3, 3 + WINDOW + 2)),
                                     kt.GenerationConfig(max_new_tokens=2)))
        again = engine.generate_outputs(prompt, kt.GenerationConfig(max_new_tokens=1),
                                        use_tqdm=False)[0]
        assert again.token_ids == expected[len(prompt):len(prompt) + 1]  # still serving
    with pytest.raises(ValueError, match=r"max_model_len=32 is more than the model's sliding "
                                         r"window \(24\)"):
        _engine(folder, disable_sliding_window=True, max_model_len=32)


def test_alternating_windows_cap_at_the_layers_window(tmp_path):
    """Gemma 2: windowed layers between full ones, no model-wide window; the flag caps
    sequences at the windowed layers' window, within which tokens are transformers'."""
    import torch
    from transformers import Gemma2Config, Gemma2ForCausalLM

    torch.manual_seed(0)
    hf = Gemma2ForCausalLM(Gemma2Config(
        hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, vocab_size=256, sliding_window=WINDOW,
        query_pre_attn_scalar=16, bos_token_id=1, eos_token_id=2, pad_token_id=0)).eval()
    folder = tmp_path / "gemma2"
    hf.save_pretrained(folder)
    _check_capped_tokens(folder, hf_reference(hf))


def test_models_without_a_window_ignore_it(tmp_path):
    folder = tmp_path / "llama"
    build_tiny_model("llama2", folder)
    with _engine(folder) as plain, _engine(folder, disable_sliding_window=True) as flagged:
        assert flagged.max_model_len == plain.max_model_len > WINDOW


def test_the_flag():
    from ksana_llm.cli import build_parser
    from ksana_llm.server.app import configs_from_args

    parse = build_parser().parse_args
    assert configs_from_args(parse(["serve", "--disable-sliding-window"]))[0] \
        .disable_sliding_window is True
    assert configs_from_args(parse(["serve"]))[0].disable_sliding_window is False
