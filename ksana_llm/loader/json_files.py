"""Reading the small JSON files beside a checkpoint (config.json, generation_config.json,
quantize_config.json, weight maps): a file that is not a UTF-8 JSON object is a ValueError that
names it, never a bare decoder error from deep inside a load."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

# The model folder's decoding defaults (transformers' name), read by the engine, the server and
# the EOS lookup.
GENERATION_CONFIG_FILE = "generation_config.json"


def read_json_object(path: str | os.PathLike[str]) -> dict[str, Any]:
    """The JSON object in `path`; ValueError naming the file when it is not one."""
    file = Path(path)
    try:
        data = json.loads(file.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ValueError(f"{file} is not valid JSON ({exc})") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{file} must hold a JSON object, got a {type(data).__name__}")
    return data
