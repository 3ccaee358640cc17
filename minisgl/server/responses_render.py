"""Last stage of a Responses request: the chat output, parsed as for chat (ChatOutput: reasoning,
tool calls, text), as a `response` object with its output items (`reasoning`, `message`,
`function_call`), or as the Responses streaming events, each numbered (sequence_number):

    response.created, response.in_progress; per item response.output_item.added, then
    message: response.content_part.added, response.output_text.delta ..., .done, content_part.done
    function_call: response.function_call_arguments.delta ..., .done
    reasoning: response.content_part.added, response.reasoning_text.delta ..., .done, content_part.done
    response.output_item.done; response.completed (or response.incomplete: max_output_tokens)

Once the 200 is out an error can only be an `error` event (a refused request got its 4xx first).
"""

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from minisgl.logging_setup import get_logger
from minisgl.message import UserReply
from minisgl.server.build import Job
from minisgl.server.chat_output import ChatOutput
from minisgl.server.errors import ApiError
from minisgl.server.render import ChoiceTracker
from minisgl.server.stream import guarded_stream, sse_event

log = get_logger("minisgl.server")


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def response_object(req: Any, model: str, tools: list[dict[str, Any]]) -> dict[str, Any]:
    """The response as created (in progress, no output yet), echoing the request's settings."""
    text = req.text.model_dump(by_alias=True, exclude_none=True) if req.text is not None else {}
    reasoning = req.reasoning.model_dump(exclude_none=True) if hasattr(req.reasoning, "model_dump") else None
    choice = req.tool_choice.model_dump() if hasattr(req.tool_choice, "model_dump") else req.tool_choice
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "in_progress",
        "model": model,
        "output": [],
        "error": None,
        "incomplete_details": None,
        "instructions": req.instructions,
        "max_output_tokens": req.max_output_tokens,
        "parallel_tool_calls": req.parallel_tool_calls is not False,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "tool_choice": choice or "auto",
        "tools": tools,
        "text": {"format": text.get("format", {"type": "text"})},
        "reasoning": reasoning,
        "store": False,
        "previous_response_id": None,
        "truncation": "disabled",
        "metadata": req.metadata or {},
        "user": req.user,
        "usage": None,
    }


def finished(resp: dict[str, Any], output: list[dict[str, Any]], t: ChoiceTracker, finish: str | None) -> None:
    """Fills in the output, status and usage once the generation is over."""
    prompt, completion = t.prompt_tokens[0], t.completion_tokens[0]
    resp["output"] = output
    resp["status"] = "incomplete" if finish == "length" else "completed"
    resp["incomplete_details"] = {"reason": "max_output_tokens"} if finish == "length" else None
    # The reasoning tokens are not counted per request here: 0.
    resp["usage"] = {
        "input_tokens": prompt,
        "input_tokens_details": {"cached_tokens": t.cached_tokens[0]},
        "output_tokens": completion,
        "output_tokens_details": {"reasoning_tokens": 0},
        "total_tokens": prompt + completion,
    }


def reasoning_item(text: str, status: str = "completed") -> dict[str, Any]:
    return {
        "type": "reasoning",
        "id": _id("rs"),
        "summary": [],
        "content": [{"type": "reasoning_text", "text": text}],
        "status": status,
    }


def message_item(text: str, status: str) -> dict[str, Any]:
    part = {"type": "output_text", "text": text, "annotations": [], "logprobs": []}
    return {"type": "message", "id": _id("msg"), "status": status, "role": "assistant", "content": [part]}


def call_item(call: dict[str, Any], status: str = "completed") -> dict[str, Any]:
    return {
        "type": "function_call",
        "id": _id("fc"),
        "call_id": call["id"],
        "name": call["function"]["name"],
        "arguments": call["function"]["arguments"],
        "status": status,
    }


async def respond(
    job: Job, req: Any, replies: AsyncIterator[UserReply], t: ChoiceTracker, model: str, tools: list[dict[str, Any]]
) -> dict[str, Any]:
    """The whole response of a non-streamed request."""
    async for r in replies:
        t.add(r)
    out = ChatOutput(job.reasoning, t.reasoning_open[0], job.tool_format, job.max_calls)
    out.feed(t.text[0])
    _, finish = out.finish(t.finish[0])
    status = "incomplete" if finish == "length" else "completed"
    output = [reasoning_item(out.reasoning_text)] if out.reasoning_text else []
    if out.content or not out.calls:
        output.append(message_item(out.content, status))
    output += [call_item(c) for c in out.calls]
    resp = response_object(req, model, tools)
    finished(resp, output, t, finish)
    return resp


class _Events:
    """The numbered events of one response; the item being written and its accumulated text."""

    def __init__(self) -> None:
        self.seq = 0
        self.output: list[dict[str, Any]] = []
        self.item: dict[str, Any] | None = None
        self.text = ""

    def event(self, kind: str, **data: Any) -> str:
        self.seq += 1
        return sse_event(kind, {**data, "sequence_number": self.seq - 1})

    def _where(self) -> dict[str, Any]:
        assert self.item is not None
        return {"item_id": self.item["id"], "output_index": len(self.output)}

    def open(self, item: dict[str, Any]) -> list[str]:
        events = self.close()
        self.item, self.text = item, ""
        events.append(self.event("response.output_item.added", output_index=len(self.output), item=item))
        if item["type"] in ("message", "reasoning"):
            part = (
                {"type": "output_text", "text": "", "annotations": []}
                if item["type"] == "message"
                else {"type": "reasoning_text", "text": ""}
            )
            events.append(self.event("response.content_part.added", **self._where(), content_index=0, part=part))
        return events

    def delta(self, text: str) -> str:
        assert self.item is not None
        self.text += text
        kind = {
            "message": "response.output_text.delta",
            "reasoning": "response.reasoning_text.delta",
            "function_call": "response.function_call_arguments.delta",
        }[self.item["type"]]
        more: dict[str, Any] = {"logprobs": []} if self.item["type"] == "message" else {}
        if self.item["type"] != "function_call":
            more["content_index"] = 0
        return self.event(kind, **self._where(), delta=text, **more)

    def close(self, status: str = "completed") -> list[str]:
        item, where = self.item, self._where() if self.item is not None else {}
        if item is None:
            return []
        events = []
        if item["type"] == "function_call":
            item.update(arguments=self.text, status=status)
            events.append(self.event("response.function_call_arguments.done", **where, arguments=self.text))
        else:
            message = item["type"] == "message"
            part = (
                message_item(self.text, status)["content"][0]
                if message
                else {"type": "reasoning_text", "text": self.text}
            )
            item.update(status=status, content=[part])
            done = "response.output_text.done" if message else "response.reasoning_text.done"
            events.append(
                self.event(done, **where, content_index=0, text=self.text, **({"logprobs": []} if message else {}))
            )
            events.append(self.event("response.content_part.done", **where, content_index=0, part=part))
        events.append(self.event("response.output_item.done", output_index=len(self.output), item=item))
        self.output.append(item)
        self.item = None
        return events


async def response_events(
    job: Job, req: Any, replies: AsyncIterator[UserReply], t: ChoiceTracker, model: str, tools: list[dict[str, Any]]
) -> AsyncIterator[str]:
    ev, resp = _Events(), response_object(req, model, tools)
    yield ev.event("response.created", response=resp)
    yield ev.event("response.in_progress", response=resp)
    out, finish = None, None
    async for r in replies:
        t.add(r)
        if out is None:
            out = ChatOutput(job.reasoning, t.reasoning_open[0], job.tool_format, job.max_calls)
        deltas = out.feed(r.text)
        if r.finish_reason is not None:
            tail, finish = out.finish(r.finish_reason)
            deltas += tail
        for d in deltas:
            for kind, text in (("reasoning", d.get("reasoning_content")), ("message", d.get("content"))):
                if text:
                    if ev.item is None or ev.item["type"] != kind:
                        item = (
                            reasoning_item("", "in_progress")
                            if kind == "reasoning"
                            else message_item("", "in_progress")
                        )
                        for e in ev.open({**item, "content": []}):
                            yield e
                    yield ev.delta(text)
            for call in d.get("tool_calls") or []:
                if "id" in call:
                    for e in ev.open(call_item(call, "in_progress")):
                        yield e
                if call["function"].get("arguments"):
                    yield ev.delta(call["function"]["arguments"])
    status = "incomplete" if finish == "length" else "completed"
    if not ev.output and ev.item is None:  # an empty answer is still a message
        for e in ev.open({**message_item("", "in_progress"), "content": []}):
            yield e
    for e in ev.close(status):
        yield e
    finished(resp, ev.output, t, finish)
    yield ev.event("response.incomplete" if status == "incomplete" else "response.completed", response=resp)


def responses_stream(body: AsyncIterator[str], request_id: str) -> StreamingResponse:
    """Each event is one chunk, so the error event's sequence number is the chunks sent."""
    return guarded_stream(body, request_id, _error_event)


def _error_event(e: ApiError, seq: int) -> str:
    error = {"code": e.code or e.kind, "message": e.message, "param": e.param}
    return sse_event("error", {**error, "sequence_number": seq})
