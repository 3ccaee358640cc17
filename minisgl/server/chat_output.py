"""One chat choice's output as OpenAI shapes it: reasoning split off (--reasoning-parser), tool
calls parsed (--tool-call-parser, when the request has tools), the rest content.

`feed(text)` turns the next text delta into zero or more `delta` objects for stream chunks;
`finish(reason)` flushes what was held and gives the final finish_reason ("tool_calls" when a
call was made and the model stopped by itself); `message()` is the non-stream message, built
from the same events, so a stream and a whole response always agree.
"""

from __future__ import annotations

from typing import Any

from minisgl.parsers.harmony import HarmonyParser, ReasoningDelta
from minisgl.parsers.reasoning import ReasoningParser
from minisgl.parsers.tool_calls import ArgsDelta, CallStart, TextDelta, ToolCallParser
from minisgl.parsers.tool_formats import ToolFormat


class ChatOutput:
    def __init__(
        self, reasoning: str | None, reasoning_open: bool, tools: ToolFormat | None, max_calls: int | None
    ) -> None:
        # Harmony (GPT-OSS) carries reasoning, calls and content in one structure: one parser.
        harmony = reasoning == "gpt-oss" or (tools is not None and tools.name == "gpt-oss")
        self.harmony = HarmonyParser(tools is not None, max_calls) if harmony else None
        self.reasoning = ReasoningParser(reasoning, reasoning_open) if reasoning and not harmony else None
        self.tools = ToolCallParser(tools, max_calls) if tools and not harmony else None
        self.content = ""
        self.reasoning_text: str | None = None
        self.calls: list[dict[str, Any]] = []

    def feed(self, text: str, final: bool = False) -> list[dict[str, Any]]:
        deltas: list[dict[str, Any]] = []
        if self.harmony is not None:
            events = self.harmony.feed(text) + (self.harmony.finish() if final else [])
            return self._deltas(events, deltas)
        content = text
        if self.reasoning is not None:
            r, content = self.reasoning.feed(text, final)
            if r:
                self.reasoning_text = (self.reasoning_text or "") + r
                deltas.append({"reasoning_content": r})
        if self.tools is None:
            if content:
                self.content += content
                deltas.append({"content": content})
            return deltas
        events = self.tools.feed(content) if content else []
        if final:
            events += self.tools.finish()
        return self._deltas(events, deltas)

    def _deltas(self, events: list[Any], deltas: list[dict[str, Any]]) -> list[dict[str, Any]]:
        for e in events:
            if isinstance(e, ReasoningDelta):
                self.reasoning_text = (self.reasoning_text or "") + e.text
                deltas.append({"reasoning_content": e.text})
            elif isinstance(e, TextDelta):
                self.content += e.text
                deltas.append({"content": e.text})
            elif isinstance(e, CallStart):
                self.calls.append({"id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}})
                head = {"index": e.index, "id": e.id, "type": "function", "function": {"name": e.name, "arguments": ""}}
                deltas.append({"tool_calls": [head]})  # its own dicts: self.calls grows after this
            elif isinstance(e, ArgsDelta):
                self.calls[e.index]["function"]["arguments"] += e.text
                deltas.append({"tool_calls": [{"index": e.index, "function": {"arguments": e.text}}]})
        return deltas

    def finish(self, reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        deltas = self.feed("", final=True)
        if self.calls and reason == "stop":
            reason = "tool_calls"
        return deltas, reason

    def message(self) -> dict[str, Any]:
        msg: dict[str, Any] = {"role": "assistant", "content": self.content or (None if self.calls else "")}
        if self.reasoning is not None or self.harmony is not None:
            msg["reasoning_content"] = self.reasoning_text
        if self.calls:
            msg["tool_calls"] = self.calls
        return msg
