"""vLLM's `GET /tokenizer_info` (mounted with `--enable-tokenizer-info-endpoint`): the served
tokenizer's configuration as its tokenizer_config.json spells it, for a client or router that
tokenizes for itself: the tokenizer's init arguments made JSON, its class, and the chat template
the server renders with (`--chat-template`, else the tokenizer's own)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from ksana_llm.server.errors import bad_request

router = APIRouter()

# Init arguments that are objects, not configuration (a fast tokenizer's backing object; the
# added tokens' table, which `tokenizer.json` holds).
_NOT_CONFIG = ("tokenizer_object", "added_tokens_decoder", "tokenizer_file", "vocab_file",
               "merges_file", "name_or_path")


def tokenizer_config(tokenizer: Any, chat_template: str | None) -> dict[str, Any]:
    config = {key: _json_value(value)
              for key, value in dict(getattr(tokenizer, "init_kwargs", None) or {}).items()
              if key not in _NOT_CONFIG}
    config["tokenizer_class"] = type(tokenizer).__name__
    template = chat_template or getattr(tokenizer, "chat_template", None)
    if template:
        config["chat_template"] = template
    return config


def _json_value(value: Any) -> Any:
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, dict):
        return {str(k): _json_value(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_value(v) for v in value]
    content = getattr(value, "content", None)  # an AddedToken: its text, as the file writes it
    return content if isinstance(content, str) else str(value)


@router.get("/tokenizer_info")
async def tokenizer_info(request: Request) -> JSONResponse:
    state = request.app.state.server
    if state.engine.tokenizer is None:
        raise bad_request("This server has no tokenizer (--skip-tokenizer-init).")
    return JSONResponse(tokenizer_config(state.engine.tokenizer, state.chat_template.text))
