"""One chat choice's text -> message parts: reasoning, content and tool calls.

Text flows through the reasoning parser first (when the server has one and the request did not
turn thinking off), and whatever it calls content through the tool-call extractor (when the
request's tool_choice wants one). The same object serves streaming (feed deltas, then finish)
and non-streaming (feed everything, then finish), so both answers agree.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from ksana_llm.server.openai_protocol import (
    ChatResponseMessage,
    DeltaFunctionCall,
    DeltaMessage,
    DeltaToolCall,
    FunctionCall,
    ToolCallModel,
)
from ksana_llm.server.reasoning_parsers import ReasoningSplitter
from ksana_llm.server.tool_parsers import ToolCallDelta, ToolCallStream, ToolParser, coalesce


@dataclass
class ChatDelta:
    reasoning: str = ""
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.reasoning or self.content or self.tool_calls)

    def then(self, later: ChatDelta) -> ChatDelta:
        """This delta and a later one as one (a stream's last text and its finishing tail):
        one chunk still names each call index once."""
        return ChatDelta(self.reasoning + later.reasoning, self.content + later.content,
                         coalesce(self.tool_calls + later.tool_calls))


class ChoiceOutputParser:
    """`forced_call`: tool_choice named the function, so a call is no news to the caller
    (OpenAI's finish_reason is then "stop", not "tool_calls"). `new_call_id` gives each call
    its id (the server's tool-call parser's, whose model may check them)."""

    def __init__(self, reasoning: ReasoningSplitter | None, tools: ToolCallStream | None, *,
                 forced_call: bool = False, include_reasoning: bool = True,
                 new_call_id: Callable[[str, int], str] = ToolParser.new_call_id) -> None:
        self._reasoning = reasoning
        self._new_call_id = new_call_id
        self._include_reasoning = include_reasoning  # else parsed out and dropped
        self._tools = tools
        self._forced_call = forced_call
        self._ids: dict[int, str] = {}  # tool-call index -> id, given with the call's name

    @property
    def num_tool_calls(self) -> int:
        return len(self._ids)

    def call_id(self, index: int) -> str:
        """The id of tool call `index` (known once its name was parsed)."""
        return self._ids[index]

    def _route(self, reasoning: str, content: str, last: bool) -> ChatDelta:
        out = ChatDelta(reasoning=reasoning if self._include_reasoning else "")
        if self._tools is None:
            out.content = content
            return out
        parsed = self._tools.feed(content) if content else None
        if last:
            tail = self._tools.finish()
            if parsed is None:
                parsed = tail
            else:
                parsed.extend(tail)
        if parsed is not None:
            out.content = parsed.content
            out.tool_calls = coalesce(parsed.tool_calls)
            for call in parsed.tool_calls:
                if call.name is not None:
                    self._ids[call.index] = call.id or self._new_call_id(call.name, call.index)
        return out

    def feed(self, text: str) -> ChatDelta:
        if self._reasoning is None:
            return self._route("", text, last=False)
        split = self._reasoning.feed(text)
        return self._route(split.reasoning, split.content, last=False)

    def finish(self) -> ChatDelta:
        if self._reasoning is None:
            return self._route("", "", last=True)
        split = self._reasoning.finish()
        return self._route(split.reasoning, split.content, last=True)

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """OpenAI (and vLLM) say "tool_calls" when the model stopped after calling tools of its
        own choosing ("auto" or "required"); "stop" for a call to the function tool_choice named."""
        if self.num_tool_calls and engine_reason == "stop" and not self._forced_call:
            return "tool_calls"
        return engine_reason

    # ---- OpenAI shapes ------------------------------------------------------------------------
    def delta_message(self, delta: ChatDelta) -> DeltaMessage:
        calls = None
        if delta.tool_calls:
            # The first delta of a call carries its id, type and name (arguments "" if none yet),
            # later ones only argument text, as OpenAI streams them.
            calls = [DeltaToolCall(index=c.index,
                                   id=self._ids[c.index] if c.name is not None else None,
                                   type="function" if c.name is not None else None,
                                   function=DeltaFunctionCall(name=c.name, arguments=c.arguments))
                     for c in delta.tool_calls]
        return DeltaMessage(content=delta.content or None, reasoning_content=delta.reasoning or None,
                            tool_calls=calls)

    def message(self, deltas: list[ChatDelta]) -> ChatResponseMessage:
        """The whole message from all of a choice's deltas."""
        names: dict[int, str] = {}
        args: dict[int, list[str]] = {}
        for d in deltas:
            for c in d.tool_calls:
                if c.name is not None:
                    names[c.index] = c.name
                args.setdefault(c.index, []).append(c.arguments)
        calls = [ToolCallModel(id=self._ids[i], function=FunctionCall(name=names[i],
                                                                      arguments="".join(args.get(i, []))))
                 for i in sorted(names)]
        content = "".join(d.content for d in deltas)
        reasoning = "".join(d.reasoning for d in deltas)
        # A plain answer keeps its text as is ("" included); beside calls or reasoning, no text
        # is null, as OpenAI sends it.
        return ChatResponseMessage(content=content if content or not (calls or reasoning) else None,
                                   reasoning_content=reasoning or None, tool_calls=calls)
