"""Request JSON read the way the OpenAI routes read it: Python's `json.loads` takes an escaped
lone UTF-16 surrogate ("\\ud800") and makes a string no tokenizer or response can encode, where
the OpenAI routes' parser refuses the body. The routes that parse JSON themselves (/generate,
/forward, /invocations, run-batch lines, /generate's chat-message prompts) use `load_json`, so
such a body is the same 400 everywhere instead of a failure deep in the tokenizer."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["LONE_SURROGATE", "holds_lone_surrogate", "load_json"]

LONE_SURROGATE = "a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which is not text"

# Only a \u escape can make a surrogate (raw UTF-8 cannot carry one): the walk below runs only
# for bodies that hold such an escape.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")


def load_json(raw: bytes | str) -> Any:
    """`json.loads(raw)`; a ValueError (as for any malformed JSON) when a string in it holds a
    lone surrogate (a well-formed pair is one character and passes)."""
    value = json.loads(raw)
    data = raw.encode("utf-8", "surrogatepass") if isinstance(raw, str) else raw
    if _SURROGATE_ESCAPE.search(data) is not None:
        _check_strings(value)
    return value


def _check_strings(value: Any) -> None:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            if holds_lone_surrogate(item):
                raise ValueError(f"a string holds {LONE_SURROGATE}")
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)


def holds_lone_surrogate(text: str) -> bool:
    """Whether `text` cannot be UTF-8 (only a lone surrogate makes a Python string so)."""
    if text.isascii():
        return False
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return True
    return False
