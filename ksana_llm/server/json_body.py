"""Request JSON read the way the OpenAI routes read it: Python's `json.loads` takes an escaped
lone UTF-16 surrogate ("\\ud800") and makes a string no tokenizer or response can encode, where
the OpenAI routes' parser refuses the body. The routes that parse JSON themselves (/generate,
/forward, /invocations, run-batch lines, /generate's chat-message prompts) use `load_json`, so
such a body is the same 400 everywhere instead of a failure deep in the tokenizer."""

from __future__ import annotations

import json
import re
from typing import Any

__all__ = ["load_json"]

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
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("a string holds a lone UTF-16 surrogate (an unpaired "
                                 "\\ud800-\\udfff escape), which is not text") from None
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
