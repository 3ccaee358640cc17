"""Streamed answers: Server-Sent Events exactly as OpenAI (and SGLang, for /generate) send
them. Once the 200 is out an error can only be an event: a refused request still got its
400 earlier (the frontend waits for the first reply before answering)."""

from __future__ import annotations

import json
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi.responses import StreamingResponse

from minisgl.logging_setup import get_logger
from minisgl.message import UserReply
from minisgl.server.build import Job
from minisgl.server.chat_output import ChatOutput
from minisgl.server.errors import ApiError, internal_error
from minisgl.server.render import (
    ChoiceTracker,
    chat_logprobs,
    chat_output,
    completion_logprobs,
    echo_logprobs,
    echo_text,
    generate_result,
    head,
    vllm_prompt_logprobs,
)

log = get_logger("minisgl.server")
SSE_DONE = "data: [DONE]\n\n"


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


def sse_event(kind: str, data: dict[str, Any]) -> str:
    """A named SSE event whose data starts with its type (Anthropic's and Responses' streams)."""
    return f"event: {kind}\ndata: {json.dumps({'type': kind, **data}, ensure_ascii=False)}\n\n"


def guarded_stream(
    body: AsyncIterator[str], request_id: str, error_event: Callable[[ApiError, int], str], done: str = ""
) -> StreamingResponse:
    """Streams `body`. The status is sent by then, so an error is reported in-band, as the
    route's API writes one (`error_event(error, chunks sent so far)`), and the server keeps
    serving; `done` closes the stream either way."""

    async def guarded() -> AsyncIterator[str]:
        sent = 0
        try:
            async for chunk in body:
                sent += 1
                yield chunk
        except ApiError as e:
            yield error_event(e, sent)
        except Exception:  # noqa: BLE001 - the status is sent: report in-band, keep serving
            log.exception("internal error while streaming (request id %s)", request_id)
            yield error_event(internal_error(request_id), sent)
        if done:
            yield done

    return StreamingResponse(guarded(), media_type="text/event-stream")


def event_stream(body: AsyncIterator[str], request_id: str) -> StreamingResponse:
    """The OpenAI routes' stream: an error as a data event with the error object, then [DONE]."""
    return guarded_stream(body, request_id, lambda e, _: sse(e.body()), SSE_DONE)


async def openai_events(
    job: Job, replies: AsyncIterator[UserReply], t: ChoiceTracker, model: str
) -> AsyncIterator[str]:
    chat = job.kind == "chat"
    top = {**head(job, model), "object": "chat.completion.chunk" if chat else "text_completion"}
    extra = {"usage": None} if job.include_usage else {}
    started: set[int] = set()
    offsets = [0] * len(t.text)
    outputs: dict[int, ChatOutput | None] = {}

    def event(choice: dict[str, Any], **more: Any) -> str:
        return sse({**top, "choices": [choice], **more, **extra})

    async for r in replies:
        i = t.add(r)
        if i not in started:
            started.add(i)
            outputs[i] = chat_output(job, t.reasoning_open[i])
            first = _first_event(job, t, i, offsets)
            if first is not None:
                yield event(first[0], **first[1])
        lp = None
        if job.logprobs is not None and r.token_ids:
            texts, lps = r.token_texts or [], r.logprobs or []
            alts = r.top_logprobs or [None] * len(lps)
            lp = (
                chat_logprobs(texts, lps, r.token_bytes or [], r.top_logprobs or [], job.logprobs)
                if chat
                else completion_logprobs(texts, list(lps), list(alts), job.logprobs, offsets[i])
            )
        offsets[i] += sum(len(x) for x in r.token_texts or [])
        out = outputs[i]
        if out is not None:
            for choice in parsed_choices(out, i, r, lp):
                yield event(choice)
            continue
        if not (r.text or lp or r.finish_reason):
            continue
        c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": r.finish_reason}
        if chat:
            c["delta"] = {"content": r.text} if r.text else {}
        else:
            c["text"] = r.text
        yield event(c)
    if job.include_usage:
        yield sse({**top, "choices": [], "usage": t.usage()})


def parsed_choices(out: ChatOutput, i: int, r: UserReply, lp: Any) -> list[dict[str, Any]]:
    """The stream choices of one reply through the output parser: one per delta (reasoning,
    content, a tool call's id and name, a piece of its arguments), then its logprobs, the
    finish last (with "tool_calls" when the model stopped after calling)."""
    deltas = out.feed(r.text)
    reason = None
    if r.finish_reason is not None:
        tail, reason = out.finish(r.finish_reason)
        deltas += tail
    choices = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
    if lp is not None:
        choices.append({"index": i, "delta": {}, "logprobs": lp, "finish_reason": None})
    if reason is not None:
        choices.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
    return choices


def _first_event(job: Job, t: ChoiceTracker, i: int, offsets: list[int]) -> tuple[dict, dict] | None:
    """(choice, top-level fields) of a choice's first event, if it has one. Chat: the
    assistant role (and vLLM's prompt_logprobs); completions with echo: the prompt's text and,
    with logprobs, its tokens'."""
    prompt_lps = None
    if job.prompt_logprobs is not None:
        prompt_lps = vllm_prompt_logprobs(t.prompt[i], job.prompt_logprobs)
    if job.kind == "chat":
        c = {"index": i, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
        return c, ({} if prompt_lps is None else {"prompt_logprobs": prompt_lps})
    c = {"index": i, "text": "", "logprobs": None, "finish_reason": None}
    if prompt_lps is not None:
        c["prompt_logprobs"] = prompt_lps
    p = t.prompt[i]
    if job.echo_texts is not None:
        c["text"] = echo_text(job, t, i)
        if job.logprobs is not None and p is not None:
            lps, alts = echo_logprobs(p)
            c["logprobs"] = completion_logprobs(p.token_texts, lps, alts, job.logprobs, 0)
            offsets[i] = sum(len(x) for x in p.token_texts)
        else:
            offsets[i] = len(c["text"])
    return (c, {}) if c["text"] or prompt_lps is not None else None


async def generate_events(job: Job, replies: AsyncIterator[UserReply], t: ChoiceTracker) -> AsyncIterator[str]:
    rid = uuid.uuid4().hex
    async for r in replies:
        t.add(r)
        yield sse(generate_result(job, t, rid))
