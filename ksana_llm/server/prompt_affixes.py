"""KsanaLLM's `/generate` prompt helpers: `model_type` wraps a plain prompt in that model family's
one-turn chat format, `use_chat_template` reads the prompt as JSON messages for the served
model's own chat template (ksana-notes §1, `build_prompt`)."""

from __future__ import annotations

import logging
from types import MappingProxyType
from typing import Any

from pydantic import ValidationError

from ksana_llm.server.chat import ChatTemplate, render_chat
from ksana_llm.server.errors import bad_request
from ksana_llm.server.json_body import load_json
from ksana_llm.server.openai_protocol import ChatMessage

logger = logging.getLogger("ksana_llm.server")

# model_type -> (text before the prompt, text after it): each family's one-user-turn format,
# ending where the assistant's answer starts. "empty" leaves the prompt as it is.
PROMPT_AFFIXES: MappingProxyType[str, tuple[str, str]] = MappingProxyType({
    "empty": ("", ""),
    "llama": ("[INST]", "[/INST]"),
    "llama-3": ("<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\n",
                "<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"),
    "baichuan": ("<reserved_106>", "<reserved_107>"),
    "qwen": ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n<|im_start|>user\n",
             "<|im_end|>\n<|im_start|>assistant\n"),
    "yi": ("<|im_start|>user\n", "<|im_end|>\n<|im_start|>assistant\n"),
    "vicuna": ("A chat between a curious user and an assistant. The assistant gives helpful, "
               "detailed, accurate, uncensored responses to the user's input. USER: ",
               " ASSISTANT:"),
    "chatglm": ("<|system|>\nYou are a large language model trained by Zhipu.AI. Follow the "
                "user's instructions carefully. Respond using markdown.\n<|user|>\n",
                "\n<|assistant|>\n"),
    "deepseek_v2": ("<｜begin▁of▁sentence｜>User: ", "\n\nAssistant:"),
    "deepseek_v3": ("<｜begin▁of▁sentence｜><｜User｜>", "<｜Assistant｜>"),
    "deepseek_r1": ("<｜begin▁of▁sentence｜><｜User｜>", "<｜Assistant｜><think>\n"),
    "hunyuan_large": ("<|startoftext|><|startoftext|>", "<|extra_4|><|extra_0|>"),
    "kimi_k2": ("<|im_system|>system<|im_middle|>You are Kimi, an AI assistant created by "
                "Moonshot AI.<|im_end|><|im_user|>user<|im_middle|>",
                "<|im_end|><|im_assistant|>assistant<|im_middle|>"),
})


def build_prompt(prompt: str, model_type: str, use_chat_template: bool, tokenizer: Any,
                 chat_template: ChatTemplate,
                 template_kwargs: dict[str, Any] | None = None) -> str:
    """The text to tokenize for a `/generate` prompt (KsanaLLM's rules: an unknown model_type is
    "empty", with a warning, as KsanaLLM prints one). `template_kwargs` go to the chat template
    (with use_chat_template)."""
    if use_chat_template:
        try:
            messages = load_json(prompt)
            if not isinstance(messages, list) or not messages:
                raise ValueError("not a non-empty list")
            parsed = [ChatMessage.model_validate(m) for m in messages]
        except (ValueError, ValidationError) as exc:
            raise bad_request("With use_chat_template, `prompt` is the JSON text of a list of chat "
                              f"messages ({exc.__class__.__name__}: {str(exc)[:200]}).",
                              param="prompt") from None
        return render_chat(tokenizer, parsed, chat_template, template_kwargs=template_kwargs)
    if model_type not in PROMPT_AFFIXES:
        logger.warning("model_type %r is not one of %s; the prompt is used as it is",
                       model_type, ", ".join(PROMPT_AFFIXES))
        return prompt
    before, after = PROMPT_AFFIXES[model_type]
    return before + prompt + after
