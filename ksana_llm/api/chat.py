"""`Engine.chat`: conversations in, answers out (vLLM's `LLM.chat`).

A conversation is a list of OpenAI-style message dicts (`{"role": ..., "content": ...}`, plus
whatever the model's chat template reads: `tool_calls`, `reasoning_content`, ...). It is
rendered with the model's chat template (or one given) by transformers' `apply_chat_template`,
then generated like any prompt, so every engine feature (batching, prefix caching, LoRA,
structured output) applies. Bad input is a ValueError naming the argument.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from ksana_llm.api.generate_calls import GenerateCalls
from ksana_llm.api.outputs import RequestOutput
from ksana_llm.generation_config import GenerationConfig

Conversation = list[dict[str, Any]]


class ChatMixin(GenerateCalls):
    """Mixed into `Engine`, which provides `tokenizer`; conversations run through
    `generate_outputs`."""

    tokenizer: Any

    def render_chat(self, messages: Conversation, *, chat_template: str | None = None,
                    add_generation_prompt: bool = True, continue_final_message: bool = False,
                    tools: list[dict[str, Any]] | None = None,
                    chat_template_kwargs: dict[str, Any] | None = None,
                    documents: list[dict[str, str]] | None = None) -> list[int]:
        """The prompt token ids of one conversation under the chat template (the model's, or
        `chat_template` text). `continue_final_message`: the last (assistant) message is left
        open for the model to go on with, instead of a new assistant turn starting.
        `documents`: retrieved texts for templates with a RAG section (transformers' argument,
        e.g. `[{"title": ..., "text": ...}]`)."""
        if self.tokenizer is None:
            raise ValueError("messages: this engine has no tokenizer to render a chat with; pass "
                             "Engine(tokenizer=...)")
        text = apply_chat_template(self.tokenizer, messages, chat_template=chat_template,
                                   add_generation_prompt=add_generation_prompt,
                                   continue_final_message=continue_final_message, tools=tools,
                                   chat_template_kwargs=chat_template_kwargs, documents=documents)
        # The template holds the special tokens (BOS etc.) already.
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def chat(self, messages: Conversation | Sequence[Conversation],
             generation_config: GenerationConfig | list[GenerationConfig] | None = None, *,
             use_tqdm: bool = True, lora: str | None = None, chat_template: str | None = None,
             add_generation_prompt: bool = True, continue_final_message: bool = False,
             tools: list[dict[str, Any]] | None = None,
             chat_template_kwargs: dict[str, Any] | None = None,
             documents: list[dict[str, str]] | None = None) -> list[RequestOutput]:
        """Answer one conversation or a list of them (batched), in input order: a list of
        outputs either way (as vLLM's `LLM.chat`). `generation_config`: one for all, or one
        per conversation; `lora`: the adapter every conversation uses."""
        if isinstance(messages, (list, tuple)) and messages and isinstance(messages[0], dict):
            conversations: Sequence[Conversation] = [list(messages)]
        else:
            conversations = messages
        if not isinstance(conversations, (list, tuple)) or not conversations:
            raise ValueError("messages: give a conversation (a list of message dicts) or a "
                             "non-empty list of conversations")
        prompts = [self.render_chat(c, chat_template=chat_template,
                                    add_generation_prompt=add_generation_prompt,
                                    continue_final_message=continue_final_message, tools=tools,
                                    chat_template_kwargs=chat_template_kwargs, documents=documents)
                   for c in conversations]
        return self.generate_outputs(prompts, generation_config, use_tqdm=use_tqdm, lora=lora)


# apply_chat_template's own arguments: template kwargs may not set them (they would clash, or
# change what comes back).
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
    "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
    "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "processor_kwargs"})


def apply_chat_template(tokenizer: Any, messages: Conversation, *, chat_template: str | None = None,
                        add_generation_prompt: bool = True, continue_final_message: bool = False,
                        tools: list[dict[str, Any]] | None = None,
                        chat_template_kwargs: dict[str, Any] | None = None,
                        documents: list[dict[str, str]] | None = None) -> str:
    """One conversation (message dicts) as prompt text, under `chat_template` or the
    tokenizer's own. Shared by `Engine.chat` and the server; every error is a ValueError that
    starts with the argument at fault."""
    _check_conversation(messages)
    if add_generation_prompt and continue_final_message:
        raise ValueError("continue_final_message cannot be true with add_generation_prompt true")
    if chat_template is None and not getattr(tokenizer, "chat_template", None):
        raise ValueError("chat_template: this model has no chat template; pass one")
    if chat_template_kwargs is not None and not (
            isinstance(chat_template_kwargs, dict)
            and all(isinstance(k, str) and k.isidentifier() for k in chat_template_kwargs)):
        raise ValueError("chat_template_kwargs must be a dict of template variable names to "
                         f"values, got {chat_template_kwargs!r}")
    if documents is not None and not (isinstance(documents, list) and all(
            isinstance(d, dict) and all(isinstance(k, str) and isinstance(v, str)
                                        for k, v in d.items()) for d in documents)):
        raise ValueError("documents must be a list of dicts of strings (e.g. 'title', 'text'), "
                         f"got {documents!r}"[:300])
    reserved = sorted(set(chat_template_kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise ValueError(f"chat_template_kwargs cannot set {', '.join(reserved)}")
    from jinja2 import TemplateError

    try:
        text = tokenizer.apply_chat_template(
            messages, chat_template=chat_template, tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message, tools=tools, documents=documents,
            **dict(chat_template_kwargs or {}))
    except (TemplateError, TypeError, KeyError, IndexError, AttributeError) as exc:
        # Templates raise on messages they do not accept (e.g. roles out of order), or fail
        # on a shape they do not expect (content parts where they concatenate strings).
        raise ValueError(f"messages: the chat template rejected them "
                         f"({type(exc).__name__}: {exc})") from exc
    if not isinstance(text, str) or not text:
        raise ValueError("messages: the chat template rendered an empty prompt")
    return text


def _check_conversation(messages: Any) -> None:
    if not isinstance(messages, (list, tuple)) or not messages:
        raise ValueError("messages: a conversation is a non-empty list of message dicts")
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError(f"messages[{i}]: a message is a dict with a string 'role'")
