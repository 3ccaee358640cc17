"""Last stage of a Messages request: the chat output, parsed as for chat (ChatOutput: reasoning,
tool calls, text), as Anthropic's `message` object or as its Server-Sent Events:

    message_start, ping, then per content block content_block_start, content_block_delta
    (text_delta, thinking_delta, input_json_delta) ..., content_block_stop; message_delta (the
    stop_reason, stop_sequence and output tokens), message_stop

Blocks come in output order: thinking, then text and tool_use blocks as the model wrote them.
Once the 200 is out an error can only be an `error` event (a refused request got its 4xx first).
"""

import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from minisgl.logging_setup import get_logger
from minisgl.message import UserReply
from minisgl.server.build import Job
from minisgl.server.chat_output import ChatOutput
from minisgl.server.render import ChoiceTracker
from minisgl.server.stream import guarded_stream, sse_event

log = get_logger("minisgl.server")


def output_parser(job: Job, t: ChoiceTracker) -> ChatOutput:
    return ChatOutput(job.reasoning, t.reasoning_open[0], job.tool_format, job.max_calls)


def stop_reason(finish: str | None, matched: str | None) -> str:
    """Anthropic's stop_reason for the parsed finish (ChatOutput.finish: "tool_calls" when the
    model stopped after calling) and the stop string that ended it, if one did."""
    if finish == "length":
        return "max_tokens"
    if finish == "tool_calls":
        return "tool_use"
    return "stop_sequence" if matched is not None else "end_turn"


def tool_input(arguments: str) -> dict[str, Any] | None:
    try:
        value = json.loads(arguments)
    except json.JSONDecodeError:
        return None
    return value if isinstance(value, dict) else None


def content_blocks(out: ChatOutput) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    if out.reasoning_text:
        blocks.append({"type": "thinking", "thinking": out.reasoning_text, "signature": ""})
    if out.content:
        blocks.append({"type": "text", "text": out.content})
    for call in out.calls:
        fn = call["function"]
        args = tool_input(fn["arguments"])
        if args is None:  # an unconstrained model's malformed call: passed on as text, not lost
            blocks.append({"type": "text", "text": fn["arguments"]})
        else:
            blocks.append({"type": "tool_use", "id": call["id"], "name": fn["name"], "input": args})
    return blocks


def message_head(model: str, prompt_tokens: int) -> dict[str, Any]:
    return {
        "id": f"msg_{uuid.uuid4().hex}",
        "type": "message",
        "role": "assistant",
        "model": model,
        "content": [],
        "stop_reason": None,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": 0},
    }


async def message(job: Job, replies: AsyncIterator[UserReply], t: ChoiceTracker, model: str) -> dict[str, Any]:
    """The whole answer of a non-streamed Messages request."""
    matched = None
    async for r in replies:
        t.add(r)
        matched = r.matched_stop or matched
    out = output_parser(job, t)
    out.feed(t.text[0])
    _, finish = out.finish(t.finish[0])
    reason = stop_reason(finish, matched)
    body = message_head(model, t.prompt_tokens[0])
    body.update(
        content=content_blocks(out), stop_reason=reason, stop_sequence=matched if reason == "stop_sequence" else None
    )
    body["usage"]["output_tokens"] = t.completion_tokens[0]
    return body


class _Blocks:
    """Turns ChatOutput's deltas into content block events, opening a block when the kind of
    output changes (thinking, text, a tool call) and closing the one before."""

    def __init__(self) -> None:
        self.index = -1
        self.kind: str | None = None

    def _open(self, block: dict[str, Any]) -> list[str]:
        events = self.close()
        self.index += 1
        self.kind = block["type"]
        return [*events, sse_event("content_block_start", {"index": self.index, "content_block": block})]

    def close(self) -> list[str]:
        if self.kind is None:
            return []
        self.kind = None
        return [sse_event("content_block_stop", {"index": self.index})]

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse_event("content_block_delta", {"index": self.index, "delta": delta})

    def events(self, d: dict[str, Any]) -> list[str]:
        out: list[str] = []
        if d.get("reasoning_content"):
            if self.kind != "thinking":
                out += self._open({"type": "thinking", "thinking": "", "signature": ""})
            out.append(self._delta({"type": "thinking_delta", "thinking": d["reasoning_content"]}))
        if d.get("content"):
            if self.kind != "text":
                out += self._open({"type": "text", "text": ""})
            out.append(self._delta({"type": "text_delta", "text": d["content"]}))
        for call in d.get("tool_calls") or []:
            if "id" in call:  # a call starts: its id and name; the arguments follow in pieces
                out += self._open({"type": "tool_use", "id": call["id"], "name": call["function"]["name"], "input": {}})
            if call["function"].get("arguments"):
                out.append(self._delta({"type": "input_json_delta", "partial_json": call["function"]["arguments"]}))
        return out


async def message_events(
    job: Job, replies: AsyncIterator[UserReply], t: ChoiceTracker, model: str
) -> AsyncIterator[str]:
    blocks, out, matched, finish = _Blocks(), None, None, None
    async for r in replies:
        t.add(r)
        if out is None:  # the first reply: the prompt's size, and whether it opened a reasoning block
            out = output_parser(job, t)
            yield sse_event("message_start", {"message": message_head(model, t.prompt_tokens[0])})
            yield sse_event("ping", {})
        matched = r.matched_stop or matched
        deltas = out.feed(r.text)
        if r.finish_reason is not None:
            tail, finish = out.finish(r.finish_reason)
            deltas += tail
        for d in deltas:
            for event in blocks.events(d):
                yield event
    for event in blocks.close():
        yield event
    reason = stop_reason(finish, matched)
    delta = {"stop_reason": reason, "stop_sequence": matched if reason == "stop_sequence" else None}
    usage = {"input_tokens": t.prompt_tokens[0], "output_tokens": t.completion_tokens[0]}
    yield sse_event("message_delta", {"delta": delta, "usage": usage})
    yield sse_event("message_stop", {})


def anthropic_stream(body: AsyncIterator[str], request_id: str) -> StreamingResponse:
    return guarded_stream(body, request_id, lambda e, _: sse_event("error", {"error": e.anthropic_body()["error"]}))
