"""`server.params.prompt_token_lists`, what completions, embeddings, /score and /rerank read
their text prompts with: vLLM's `add_special_tokens` reaches the tokenizer. SmolLM2's tokenizer
adds no special tokens, so this one is the same tokenizer given a BOS post-processor (as Llama's
tokenizers have)."""

from __future__ import annotations

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from ksana_llm.server.params import ModelLimits, prompt_token_lists


@pytest.fixture(scope="module")
def bos_tokenizer(default_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(default_model_dir)
    bos = tokenizer.convert_tokens_to_ids("<|im_start|>")
    tokenizer._tokenizer.post_processor = TemplateProcessing(
        single="<|im_start|> $A", special_tokens=[("<|im_start|>", bos)])
    return tokenizer


def test_add_special_tokens_reaches_the_tokenizer(bos_tokenizer):
    limits = ModelLimits(max_model_len=64, vocab_size=len(bos_tokenizer))
    bare = bos_tokenizer.encode("Hello there", add_special_tokens=False)
    bos = bos_tokenizer.convert_tokens_to_ids("<|im_start|>")
    assert prompt_token_lists("Hello there", bos_tokenizer, limits) == [[bos, *bare]]
    assert prompt_token_lists(["Hello there"], bos_tokenizer, limits,
                              add_special_tokens=False) == [bare]
    # Token-id prompts are taken as given either way.
    assert prompt_token_lists(bare, bos_tokenizer, limits) == [bare]
