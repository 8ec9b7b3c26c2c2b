"""Reasoning parsers (`--reasoning-parser NAME`): split a thinking model's output into
`reasoning_content` (inside `<think>...</think>`, or a model's own tags: Seed-OSS's
`<seed:think>`, Magistral's `[THINK]`, Granite's `Here is my thought process:` sentences) and
`content` (after it); GPT-OSS's (`openai_gptoss`) by the harmony channel of each message instead
(`tool_parsers.harmony`).

As with the tool parsers, one incremental machine serves both paths (`extract` streams the whole
text through it), so streamed deltas always add up to the non-streamed answer. Text that may be
half of a tag is held back until the next chunk decides it. Whitespace between `</think>` and
the answer is dropped (templates put a blank line there).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from types import MappingProxyType
from typing import ClassVar

from ksana_llm.server.tool_parsers.harmony import CALL, HarmonyEvent, HarmonyMessages, harmony_header
from ksana_llm.server.tool_parsers.base import held_prefix

THINK_START = "<think>"
THINK_END = "</think>"

_START, _REASONING, _CONTENT_START, _CONTENT, _ANSWER = range(5)
_WHITESPACE = " \t\r\n"


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content)


@dataclass(frozen=True)
class ReasoningOutput:
    reasoning: str | None
    content: str | None


class ReasoningSplitter(ABC):
    """One output's incremental split: `feed` text as it comes, then `finish`."""

    @abstractmethod
    def feed(self, text: str) -> ReasoningDelta: ...

    @abstractmethod
    def finish(self) -> ReasoningDelta: ...


def _find_first(text: str, tags: tuple[str, ...]) -> tuple[int, str]:
    """Where the first of `tags` occurs in `text`, and which: (-1, "") if none does."""
    found = [(at, tag) for tag in tags if (at := text.find(tag)) >= 0]
    return min(found) if found else (-1, "")


class ReasoningStream(ReasoningSplitter):
    """`starts_in_reasoning`: the prompt already opened the thinking block (DeepSeek-R1), so the
    output is reasoning until `</think>` even without a `<think>` of its own. Otherwise (Qwen3)
    only an output that opens with `<think>` has reasoning. `start` / `end`: the block's tags,
    or several spellings of each (Granite writes "Here's" or "Here is"). `answer`: the (open,
    close) tags a model puts around its answer (Hunyuan's `<answer>`): left out of the content,
    with the whitespace just inside them."""

    def __init__(self, starts_in_reasoning: bool, start: str | tuple[str, ...] = THINK_START,
                 end: str | tuple[str, ...] = THINK_END,
                 answer: tuple[str, str] | None = None) -> None:
        self._starts_in_reasoning = starts_in_reasoning
        self._starts = (start,) if isinstance(start, str) else start
        self._ends = (end,) if isinstance(end, str) else end
        self._answer = answer
        self._in_answer = False  # the answer's open tag came, its close tag not yet
        self._state = _START
        self._buffer = ""

    def feed(self, text: str) -> ReasoningDelta:
        self._buffer += text
        out = ReasoningDelta()
        while self._buffer:
            if self._state == _START:
                visible = self._buffer.lstrip(_WHITESPACE)
                opener = next((tag for tag in self._starts if visible.startswith(tag)), None)
                if opener is not None:
                    self._buffer = visible[len(opener):]
                    self._state = _REASONING
                elif any(tag.startswith(visible) for tag in self._starts):
                    return out  # whitespace, or the tag still being spelled out
                elif self._starts_in_reasoning:
                    self._state = _REASONING
                else:
                    self._state = _CONTENT_START if self._answer else _CONTENT
            elif self._state == _REASONING:
                end, closer = _find_first(self._buffer, self._ends)
                if end < 0:
                    cut = len(self._buffer) - held_prefix(self._buffer, self._ends)
                    out.reasoning += self._buffer[:cut]
                    self._buffer = self._buffer[cut:]
                    return out
                out.reasoning += self._buffer[:end]
                self._buffer = self._buffer[end + len(closer):]
                self._state = _CONTENT_START
            elif self._state == _CONTENT_START:
                self._buffer = self._buffer.lstrip(_WHITESPACE)
                if not self._buffer:
                    break
                if self._answer and not self._in_answer:
                    opener = self._answer[0]
                    if self._buffer.startswith(opener):
                        self._buffer = self._buffer[len(opener):]
                        self._in_answer = True
                        continue  # (and the whitespace after the tag goes too)
                    if opener.startswith(self._buffer):
                        return out  # the tag still being spelled out
                self._state = _ANSWER if self._in_answer else _CONTENT
            elif self._state == _ANSWER:
                self._read_answer(out)
                if self._state == _ANSWER:
                    return out
            else:
                out.content += self._buffer
                self._buffer = ""
        return out

    def _read_answer(self, out: ReasoningDelta) -> None:
        """Content up to the answer's close tag (the whitespace before it left out); what may
        be that whitespace and tag waits for more text."""
        close = self._answer[1]
        end = self._buffer.find(close)
        if end < 0:
            cut = len(self._buffer) - held_prefix(self._buffer, (close,))
            cut = len(self._buffer[:cut].rstrip(_WHITESPACE))
            out.content += self._buffer[:cut]
            self._buffer = self._buffer[cut:]
            return
        out.content += self._buffer[:end].rstrip(_WHITESPACE)
        self._buffer = self._buffer[end + len(close):]
        self._in_answer = False
        self._state = _CONTENT_START  # what follows the answer is content still

    def finish(self) -> ReasoningDelta:
        out = ReasoningDelta()
        rest, self._buffer = self._buffer, ""
        if self._state == _REASONING or (self._state == _START and self._starts_in_reasoning):
            out.reasoning = rest
        elif self._state == _ANSWER:
            out.content = rest.rstrip(_WHITESPACE)  # (an answer cut off before its close tag)
        elif self._state != _CONTENT_START or rest.strip(_WHITESPACE):
            out.content = rest
        return out


class PrefixedContentStream(ReasoningSplitter):
    """No split: the whole output is content, with `prefix` before its first text (MiniMax-M2's
    `<think>`, which the template wrote into the prompt, so the client sees the block whole)."""

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix  # "" once sent

    def feed(self, text: str) -> ReasoningDelta:
        if not text:
            return ReasoningDelta()  # (an empty output gets no prefix either)
        content, self._prefix = self._prefix + text, ""
        return ReasoningDelta(content=content)

    def finish(self) -> ReasoningDelta:
        return ReasoningDelta()


def opens_thinking(prompt: str, start: str = THINK_START) -> bool:
    """Whether the rendered prompt leaves a thinking block open for the output: its generation
    prompt ends with `<think>` (Qwen3-Thinking-2507, QwQ, DeepSeek-R1), so the output starts
    as reasoning and only writes `</think>`. (A prompt with thinking turned off ends with an
    empty `<think></think>` block instead.)"""
    return prompt.rstrip(_WHITESPACE).endswith(start)


class HarmonyReasoningStream(ReasoningSplitter):
    """GPT-OSS: the `analysis` channel is reasoning, every other message's body content. A
    message to a recipient (a tool call) goes on to the content as harmony, header and `<|call|>`
    included, when the `openai` tool-call parser reads it (`calls_read`); otherwise it is no
    text for the user (its body is a call's arguments) and is left out."""

    def __init__(self, calls_read: bool) -> None:
        self._messages = HarmonyMessages()
        self._calls_read = calls_read

    def feed(self, text: str) -> ReasoningDelta:
        return self._route(self._messages.feed(text))

    def finish(self) -> ReasoningDelta:
        return self._route(self._messages.finish())

    def _route(self, events: list[HarmonyEvent]) -> ReasoningDelta:
        out = ReasoningDelta()
        for event in events:
            message = event.message
            if message.recipient is not None:
                if self._calls_read:
                    out.content += {"open": harmony_header(message), "text": event.text,
                                    "close": CALL}[event.kind]
            elif message.channel == "analysis":
                out.reasoning += event.text
            else:
                out.content += event.text
        return out


class ReasoningParser(ABC):
    name: ClassVar[str]
    # The tags of the thinking block (Seed-OSS's are its own).
    start_tag: ClassVar[str] = THINK_START
    end_tag: ClassVar[str] = THINK_END
    # (open, close) tags around the answer that are no content (Hunyuan's <answer>), if any.
    answer_tags: ClassVar[tuple[str, str] | None] = None
    # Whether it reads the output's special tokens (harmony's): the server then decodes the
    # output with them, whatever the request's skip_special_tokens says.
    reads_special_tokens: ClassVar[bool] = False

    @abstractmethod
    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningSplitter:
        """`prompt_opens_thinking`: `opens_thinking` of the request's prompt. `calls_read`: a
        tool-call parser reading harmony follows (GPT-OSS's; other formats ignore it)."""

    def thinking_tags(self) -> tuple[str, str] | None:
        """The (start, end) text of the thinking block, which the engine watches for (a
        request's thinking budget, structured output that starts after the thinking); None for
        a format without one (harmony's channels, whose `reasoning_config` says where thought
        ends)."""
        return self.start_tag, self.end_tag

    def reasoning_config(self) -> dict[str, str] | None:
        """The engine's `reasoning_config` that watches this parser's thinking block (what
        `serve` and `build_app` give an engine built without one); None without tags."""
        tags = self.thinking_tags()
        if tags is None:
            return None
        return {"reasoning_start_str": tags[0], "reasoning_end_str": tags[1]}

    def opens_thinking(self, prompt: str) -> bool:
        """Whether `prompt` (the rendered chat) leaves this parser's thinking block open."""
        return opens_thinking(prompt, self.start_tag)

    def extract(self, text: str, prompt_opens_thinking: bool = False, *,
                calls_read: bool = False) -> ReasoningOutput:
        stream = self.stream(prompt_opens_thinking, calls_read=calls_read)
        first, last = stream.feed(text), stream.finish()
        return ReasoningOutput(first.reasoning + last.reasoning or None,
                               first.content + last.content or None)


class DeepSeekR1ReasoningParser(ReasoningParser):
    """DeepSeek-R1's template ends the prompt with `<think>\\n`: the output starts inside the
    thinking block; everything before `</think>` is reasoning (a leading `<think>` is tolerated),
    and an output without `</think>` is all reasoning."""

    name = "deepseek_r1"

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningStream:
        return ReasoningStream(True, self.start_tag, self.end_tag)


class Qwen3ReasoningParser(ReasoningParser):
    """Qwen3 writes `<think>...</think>` itself when thinking; without it the output is content,
    unless the prompt opened the block (Qwen3-Thinking-2507's template ends with `<think>`):
    then the output is reasoning until `</think>`."""

    name = "qwen3"

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningStream:
        return ReasoningStream(prompt_opens_thinking, self.start_tag, self.end_tag,
                               answer=self.answer_tags)


class Glm45ReasoningParser(Qwen3ReasoningParser):
    """GLM-4.5 / 4.6 / 4.7 (vLLM's `glm45`): the model opens `<think>` itself, as Qwen3 does;
    with thinking off (`enable_thinking: false`) the template closes an empty block in the
    prompt and the output is the answer."""

    name = "glm45"


class DeepSeekV3ReasoningParser(ReasoningParser):
    """DeepSeek-V3.1 / V3.2 think only when asked (`chat_template_kwargs: {"thinking": true}`),
    and their template then ends the prompt with `<think>`; otherwise with `</think>`, and the
    output is the answer. So, as vLLM's `deepseek_v3` does by the same flag: R1's split when the
    prompt opened the thinking block, plain content (unless the output opens one) when not."""

    name = "deepseek_v3"

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningStream:
        return ReasoningStream(prompt_opens_thinking, self.start_tag, self.end_tag)


class SeedOssReasoningParser(Qwen3ReasoningParser):
    """ByteDance Seed-OSS (vLLM's `seed_oss`), whose thinking block is `<seed:think>...
    </seed:think>`, split as Qwen3's: the model opens the block itself, and an output that
    does not open it is the answer (a prompt that left it open makes the output reasoning
    until the end tag)."""

    name = "seed_oss"
    start_tag = "<seed:think>"
    end_tag = "</seed:think>"


class HunyuanA13BReasoningParser(Qwen3ReasoningParser):
    """Tencent Hunyuan-A13B (vLLM's `hunyuan_a13b`): `<think>...</think>` then the answer inside
    `<answer>...</answer>`, whose tags (and the newlines just inside them) are not content. An
    output without the thinking block is content (its answer tags still dropped)."""

    name = "hunyuan_a13b"
    answer_tags = ("<answer>", "</answer>")


class GptOssReasoningParser(ReasoningParser):
    """GPT-OSS's harmony channels (vLLM's `openai_gptoss`)."""

    name = "openai_gptoss"
    reads_special_tokens = True

    def thinking_tags(self) -> tuple[str, str] | None:
        return None  # channels, not a tagged block (see reasoning_config)

    def reasoning_config(self) -> dict[str, str] | None:
        """Everything before the final channel is thought (vLLM constrains structured output
        to the final channel too): the block opens with the assistant's turn, where a harmony
        prompt ends, and closes at the final channel's header; a spent budget ends the
        message it is in and opens the final channel."""
        return {"reasoning_start_str": "<|start|>assistant",
                "reasoning_end_str": "<|end|><|start|>assistant<|channel|>final<|message|>",
                "reasoning_end_tag": "<|channel|>final<|message|>"}

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningSplitter:
        return HarmonyReasoningStream(calls_read)


class MistralReasoningParser(Qwen3ReasoningParser):
    """Magistral (vLLM's `mistral`): thinking inside `[THINK]...[/THINK]`, which the model opens
    itself, split as Qwen3's (an output that does not open it is the answer). From Magistral
    Small 1.1 on the tags are control tokens of the tokenizer, which decoding with
    skip_special_tokens would drop: the server keeps them for this parser."""

    name = "mistral"
    start_tag = "[THINK]"
    end_tag = "[/THINK]"
    reads_special_tokens = True


class Step3ReasoningParser(DeepSeekR1ReasoningParser):
    """StepFun Step-3 (vLLM's `step3`): the model writes no `<think>`, its output starts inside
    the thinking block; everything before `</think>` is reasoning, and an output without
    `</think>` is all reasoning (R1's split)."""

    name = "step3"


class MiniMaxM2ReasoningParser(DeepSeekR1ReasoningParser):
    """MiniMax-M2 (vLLM's `minimax_m2`): the template opens `<think>` in the prompt, so the
    output is reasoning until `</think>` (R1's split)."""

    name = "minimax_m2"


class MiniMaxM2AppendThinkReasoningParser(ReasoningParser):
    """MiniMax-M2 (vLLM's `minimax_m2_append_think`, which MiniMax recommends): no split. The
    content is the whole output with the `<think>` the template put in the prompt before it, so
    a client that sends the answer back gives the model its thinking block whole (M2 works best
    with its earlier thinking in the conversation)."""

    name = "minimax_m2_append_think"

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningSplitter:
        return PrefixedContentStream(self.start_tag)


class Ernie45ReasoningParser(DeepSeekR1ReasoningParser):
    """Baidu ERNIE-4.5-21B-A3B-Thinking (vLLM's `ernie45`): the output starts inside the
    thinking block (a leading `<think>` is tolerated) and is reasoning until `</think>`; the
    answer after it may be wrapped in `<response>...</response>`, whose tags (and the newlines
    just inside them) are not content. An output without `</think>` is all reasoning."""

    name = "ernie45"
    answer_tags = ("<response>", "</response>")

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningStream:
        return ReasoningStream(True, self.start_tag, self.end_tag, answer=self.answer_tags)


class Olmo3ReasoningParser(Qwen3ReasoningParser):
    """AllenAI Olmo 3 Think (vLLM's `olmo3`): `<think>...</think>`, which the template may open
    in the prompt (then the output is reasoning until `</think>`) or the model itself; split as
    Qwen3's."""

    name = "olmo3"


class GraniteReasoningParser(ReasoningParser):
    """IBM Granite 3.2 (vLLM's `granite`; thinking on with `chat_template_kwargs:
    {"thinking": true}`): the output is `Here is my thought process:`, the reasoning, then
    `Here is my response:` and the answer; either sentence may begin `Here's` instead. An
    output that does not begin (after whitespace) with the first is all content; one cut off
    before the second is all reasoning. The template never leaves the thoughts open."""

    name = "granite"
    start_tag = "Here is my thought process:"
    end_tag = "Here is my response:"

    def stream(self, prompt_opens_thinking: bool = False, *,
               calls_read: bool = False) -> ReasoningStream:
        return ReasoningStream(False, (self.start_tag, "Here's my thought process:"),
                               (self.end_tag, "Here's my response:"))

    def opens_thinking(self, prompt: str) -> bool:
        return False


REASONING_PARSERS: MappingProxyType[str, type[ReasoningParser]] = MappingProxyType({
    cls.name: cls for cls in (DeepSeekR1ReasoningParser, DeepSeekV3ReasoningParser,
                              Qwen3ReasoningParser, GptOssReasoningParser, Glm45ReasoningParser,
                              SeedOssReasoningParser, HunyuanA13BReasoningParser,
                              MistralReasoningParser, Step3ReasoningParser,
                              MiniMaxM2ReasoningParser, MiniMaxM2AppendThinkReasoningParser,
                              Ernie45ReasoningParser, Olmo3ReasoningParser,
                              GraniteReasoningParser)})


def get_reasoning_parser(name: str) -> ReasoningParser:
    """The parser registered as `name`; ValueError listing the known names otherwise."""
    cls = REASONING_PARSERS.get(name)
    if cls is None:
        raise ValueError(f"unknown reasoning parser {name!r}; known: "
                         f"{', '.join(sorted(REASONING_PARSERS))}")
    return cls()
