"""vLLM's `add_special_tokens` reaches the tokenizer: `server.params.prompt_token_lists` (what
completions and embeddings read their text prompts with) and the embeddings route's inputs, in
both its forms. SmolLM2's tokenizer adds no special tokens, so this one is the same tokenizer
given a BOS post-processor (as Llama's tokenizers have). The embeddings route reads a server
state's tokenizer, limits and chat template only: a namespace holding those stands in for it.
A prompt holding a lone UTF-16 surrogate (a JSON escape some way in let through) is a 400 naming
the field, never a tokenizer failure (a 500)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from tokenizers.processors import TemplateProcessing
from transformers import AutoTokenizer

from ksana_llm.server.chat import ChatTemplate
from ksana_llm.server.embedding_protocol import EmbeddingRequest
from ksana_llm.server.embeddings import pooling_inputs
from ksana_llm.server.errors import APIError
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


def test_embeddings_inputs_take_add_special_tokens(bos_tokenizer):
    state = SimpleNamespace(tokenizer=bos_tokenizer, text_tokenizer=lambda field: bos_tokenizer,
                            limits=ModelLimits(max_model_len=256, vocab_size=len(bos_tokenizer)),
                            chat_template=ChatTemplate(), chat_template_kwargs=lambda kw: kw or {})
    bos = bos_tokenizer.convert_tokens_to_ids("<|im_start|>")
    bare = bos_tokenizer.encode("Hello there", add_special_tokens=False)

    def inputs(**body):
        return pooling_inputs(EmbeddingRequest(**body), state)

    assert inputs(input="Hello there") == [[bos, *bare]]
    assert inputs(input="Hello there", add_special_tokens=False) == [bare]
    messages = [{"role": "user", "content": "Hello there"}]
    rendered = bos_tokenizer.encode(bos_tokenizer.apply_chat_template(messages, tokenize=False),
                                    add_special_tokens=False)
    assert inputs(messages=messages) == [rendered]  # the template writes its own
    assert inputs(messages=messages, add_special_tokens=True) == [[bos, *rendered]]


def test_a_lone_surrogate_is_a_400_naming_the_field(default_model):
    tokenizer, limits = default_model.tokenizer, ModelLimits(2048, default_model.vocab_size)
    with pytest.raises(APIError) as info:
        prompt_token_lists(["fine", "x\ud800y"], tokenizer, limits, field="input")
    assert info.value.status == 400 and info.value.body()["error"]["param"] == "input"
    assert "surrogate" in info.value.body()["error"]["message"]
    assert prompt_token_lists("x\U0001F600", tokenizer, limits) == [tokenizer.encode("x\U0001F600")]
