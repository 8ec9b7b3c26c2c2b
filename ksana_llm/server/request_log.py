"""`--enable-log-requests` (vLLM's): one INFO line per engine request as it is submitted, with
its prompt (as text, and its token ids), the generation settings it asked for (those that differ
from the defaults) and its LoRA adapter; `--max-log-len N` shows at most N characters of the
prompt and N of its token ids. On the `ksana_llm.requests` logger, which `serve` lets through
whatever KLLM_LOG_LEVEL is. Off by default: prompts are the users' data.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from ksana_llm.generation_config import GenerationConfig

LOGGER_NAME = "ksana_llm.requests"


def changed_settings(config: GenerationConfig) -> str:
    """`name=value` for each field `config` sets to other than its default."""
    default = GenerationConfig()
    return ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                     if getattr(config, f.name) != getattr(default, f.name))


@dataclass(frozen=True)
class RequestLog:
    max_log_len: int | None = None  # prompt characters and token ids shown (None: all)

    def enable(self) -> RequestLog:
        logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
        return self

    def submitted(self, request_id: str, prompt: Any, config: GenerationConfig,
                  tokenizer: Any, lora: str | None = None) -> None:
        """Log one engine request; `prompt`: its token ids, or a prompt dict (embeddings)."""
        logger = logging.getLogger(LOGGER_NAME)
        if not logger.isEnabledFor(logging.INFO):
            return
        cut = self.max_log_len
        if isinstance(prompt, dict):
            rows = prompt["prompt_embeds"]
            shown = f"prompt_embeds of shape {tuple(rows.shape)}"
        else:
            text = tokenizer.decode(prompt[:cut] if cut is not None else prompt)
            shown = (f"prompt: {text[:cut] if cut is not None else text!r}, "
                     f"prompt_token_ids: {prompt[:cut] if cut is not None else prompt}")
        logger.info("Received request %s: %s, params: %s, lora: %s", request_id, shown,
                    changed_settings(config) or "defaults", lora)
