"""`--enable-log-requests` (vLLM's): one INFO line per engine request as it is submitted, with
its prompt (as text, and its token ids), the generation settings it asked for (those that differ
from the defaults) and its LoRA adapter. `--enable-log-outputs` (vLLM's): one line per returned
sequence when its request finishes (streamed or not), with its text, token ids and finish
reason. `--max-log-len N` shows at most N characters and N token ids of each. On the
`ksana_llm.requests` logger, which `serve` lets through whatever KLLM_LOG_LEVEL is. Off by
default: prompts and answers are the users' data.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from typing import Any

from ksana_llm.api.outputs import RequestOutput
from ksana_llm.generation_config import GenerationConfig

LOGGER_NAME = "ksana_llm.requests"


def changed_settings(config: GenerationConfig) -> str:
    """`name=value` for each field `config` sets to other than its default."""
    default = GenerationConfig()
    return ", ".join(f"{f.name}={getattr(config, f.name)!r}" for f in dataclasses.fields(config)
                     if getattr(config, f.name) != getattr(default, f.name))


@dataclass(frozen=True)
class RequestLog:
    max_log_len: int | None = None  # characters and token ids shown of each (None: all)
    requests: bool = True  # log each request as it is submitted (--enable-log-requests)
    outputs: bool = False  # log each finished request's sequences (--enable-log-outputs)

    def enable(self) -> RequestLog:
        logging.getLogger(LOGGER_NAME).setLevel(logging.INFO)
        return self

    def submitted(self, request_id: str, prompt: Any, config: GenerationConfig,
                  tokenizer: Any, lora: str | None = None) -> None:
        """Log one engine request; `prompt`: its token ids, or a prompt dict (embeddings)."""
        logger = logging.getLogger(LOGGER_NAME)
        if not self.requests or not logger.isEnabledFor(logging.INFO):
            return
        cut = self.max_log_len
        if isinstance(prompt, dict):
            rows = prompt["prompt_embeds"]
            shown = f"prompt_embeds of shape {tuple(rows.shape)}"
        else:
            ids = prompt[:cut] if cut is not None else prompt
            shown = f"prompt_token_ids: {ids}"
            if tokenizer is not None:  # (none with --skip-tokenizer-init: the ids alone)
                text = tokenizer.decode(ids)
                shown = f"prompt: {text[:cut] if cut is not None else text!r}, {shown}"
        logger.info("Received request %s: %s, params: %s, lora: %s", request_id, shown,
                    changed_settings(config) or "defaults", lora)

    def finished(self, output: RequestOutput) -> None:
        """Log what a finished engine request returned: one line per sequence."""
        logger = logging.getLogger(LOGGER_NAME)
        if not self.outputs or not logger.isEnabledFor(logging.INFO):
            return
        cut = self.max_log_len
        several = len(output.sequences) > 1
        for k, seq in enumerate(output.sequences):
            which = f" (sequence {k})" if several else ""
            text = seq.text if cut is None else seq.text[:cut]
            ids = list(seq.token_ids) if cut is None else list(seq.token_ids[:cut])
            logger.info("Generated response %s%s: output: %r, output_token_ids: %s, "
                        "finish_reason: %s", output.request_id, which, text, ids,
                        seq.finish_reason)
