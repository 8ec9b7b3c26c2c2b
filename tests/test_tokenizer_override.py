"""A tokenizer other than the model's own (vLLM's `--tokenizer`, KsanaLLM's `tokenizer_dir`): a
weights-only folder runs on text with it, giving transformers' greedy tokens on the same weights
and prompt ids; a wrong folder is a ValueError naming `tokenizer`."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

import ksana_llm as kt
from tests.tiny_models import COMMON

PROMPT = "The capital of France is"


@pytest.fixture(scope="module")
def tokenizer_dir(default_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tokenizer")
    default_model.tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def weights_only(default_model, tmp_path_factory):
    """A tiny random Llama sized to SmolLM2's vocabulary, saved without any tokenizer files or
    EOS id."""
    folder = tmp_path_factory.mktemp("weights-only")
    torch.manual_seed(0)
    # (no EOS id of its own: the tokenizer's is the only one)
    config = LlamaConfig(**{**COMMON, "vocab_size": default_model.vocab_size,
                            "eos_token_id": None}, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    model.save_pretrained(folder)
    return folder, model


def test_weights_only_folder_runs_on_text_with_the_given_tokenizer(weights_only, tokenizer_dir):
    from transformers import AutoTokenizer

    folder, hf_model = weights_only
    reference = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = reference(PROMPT).input_ids
    expected = hf_model.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False,
                                 eos_token_id=None, pad_token_id=0)[0, len(ids):].tolist()
    config = kt.GenerationConfig(max_new_tokens=8, ignore_eos=True)
    with kt.Engine(str(folder), tokenizer=str(tokenizer_dir), device="cpu",
                   num_device_blocks=32) as engine:
        out = engine.generate_outputs(PROMPT, config, use_tqdm=False)[0]
        assert engine.config.tokenizer == str(tokenizer_dir)
        assert out.prompt_token_ids == ids
        assert out.token_ids == expected
        assert out.text == reference.decode(expected, skip_special_tokens=True)
    # Without it the folder has no tokenizer: token ids only.
    with kt.Engine(str(folder), device="cpu", num_device_blocks=32) as engine:
        assert engine.tokenizer is None
        with pytest.raises(ValueError, match="tokenizer"):
            engine.generate(PROMPT, config)
        assert engine.generate_outputs([ids], config, use_tqdm=False)[0].token_ids == expected
    # A loaded Model takes one too, through the Engine, EOS ids included: the weights-only
    # folder names none, SmolLM2's tokenizer does.
    model = kt.Model.from_pretrained(folder, device="cpu", progress=False)
    with kt.Engine(model, tokenizer=tokenizer_dir, num_device_blocks=32) as engine:
        assert engine.generate_outputs(PROMPT, config, use_tqdm=False)[0].token_ids == expected
        assert reference.eos_token_id in engine.model.eos_token_ids
        assert engine.model.module is model.module  # the same weights
    assert reference.eos_token_id not in model.eos_token_ids  # the caller's model unchanged


def test_wrong_tokenizer_folders_are_named(weights_only, tokenizer_dir, tmp_path):
    import time

    folder, _ = weights_only
    with pytest.raises(ValueError, match=f"tokenizer: cannot load a tokenizer from {tmp_path}"):
        kt.Model.from_pretrained(folder, device="cpu", tokenizer=tmp_path, progress=False)
    # A folder that is not there is never looked up as a hub name (a minute of retries, or a
    # download of someone else's tokenizer).
    start = time.monotonic()
    with pytest.raises(ValueError, match="tokenizer: my_tok_dir is not a folder"):
        kt.Model.from_pretrained(folder, device="cpu", tokenizer="my_tok_dir", progress=False)
    assert time.monotonic() - start < 10
    # SmolLM2's 49152 tokens against a 256-token model: not its tokenizer.
    small = tmp_path / "small-vocab"
    LlamaForCausalLM(LlamaConfig(**COMMON)).save_pretrained(small)
    with pytest.raises(ValueError, match="tokenizer: .* 49152 tokens, more than the model's "
                                         "vocab_size 256"):
        kt.Engine(str(small), tokenizer=str(tokenizer_dir), device="cpu")


def test_cli_tokenizer_flag(weights_only, tokenizer_dir):
    """`generate --tokenizer` (KsanaLLM's --tokenizer_path spelling) as a real process."""
    folder, _ = weights_only
    proc = subprocess.run([sys.executable, "-m", "ksana_llm.cli", "generate", PROMPT,
                           "--model", str(folder), "--tokenizer_path", str(tokenizer_dir),
                           "--device", "cpu", "--max-new-tokens", "4"],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip()
