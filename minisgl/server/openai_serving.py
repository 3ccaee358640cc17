"""POST /v1/chat/completions and /v1/completions: OpenAI bodies in, OpenAI responses out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from minisgl.message import TokenizeMsg, UserReply
from minisgl.parsers.tool_formats import ToolFormat
from minisgl.server.chat_output import ChatOutput
from minisgl.server.chat_request import ChatPlan, plan_chat, template_messages
from minisgl.server.frontend import Frontend
from minisgl.server.openai_protocol import ChatCompletionRequest, CompletionRequest
from minisgl.server.serving import (
    SSE_DONE,
    ChoiceTracker,
    ServingError,
    all_replies,
    build_sampling,
    check_n,
    first_reply,
    sse,
)


@dataclass(frozen=True)
class ChatFeatures:
    """Server-wide output parsing: the tool-call format (--tool-call-parser, or detected from
    the chat template) and the reasoning parser (--reasoning-parser)."""

    tool_format: ToolFormat | None = None
    reasoning: str | None = None


CHAT_ROLES = {"system", "developer", "user", "assistant", "tool"}


def check_model(requested: str | None, served: str) -> None:
    if requested is not None and requested != served:
        raise ServingError(
            f"The model `{requested}` does not exist; this server serves `{served}`.", "model", 404, "model_not_found"
        )


def chat_messages(req: ChatCompletionRequest) -> list[dict[str, str]]:
    if not req.messages:
        raise ServingError("messages must not be empty", "messages")
    out = []
    for i, m in enumerate(req.messages):
        if m.role not in CHAT_ROLES:
            raise ServingError(
                f"messages[{i}].role {m.role!r} is not one of {sorted(CHAT_ROLES)}", f"messages[{i}].role"
            )
        if isinstance(m.content, list):
            if any(p.type != "text" or p.text is None for p in m.content):
                raise ServingError(f"messages[{i}].content: only text parts are supported", f"messages[{i}].content")
            content = "".join(p.text or "" for p in m.content)
        else:
            content = m.content or ""
        msg: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": content}
        for key in ("tool_calls", "tool_call_id", "name"):  # assistant calls and tool results
            if getattr(m, key, None) is not None:
                msg[key] = getattr(m, key)
        out.append(msg)
    try:
        return template_messages(out)
    except ValueError as e:
        raise ServingError(str(e), str(e).split(":", 1)[0]) from e


def _chat_logprobs(texts: list[str], lps: list[float]) -> dict[str, Any]:
    return {
        "content": [
            {"token": t, "logprob": lp, "bytes": list(t.encode()), "top_logprobs": []}
            for t, lp in zip(texts, lps, strict=False)
        ]
    }


def _completion_logprobs(texts: list[str], lps: list[float], offset: int) -> dict[str, Any]:
    offsets = []
    for t in texts:
        offsets.append(offset)
        offset += len(t)
    return {
        "tokens": texts,
        "token_logprobs": lps,
        "top_logprobs": [{t: lp} for t, lp in zip(texts, lps, strict=False)],
        "text_offset": offsets,
    }


class OpenAIServing:
    def __init__(self, frontend: Frontend, model_name: str, features: ChatFeatures | None = None) -> None:
        self.frontend = frontend
        self.model_name = model_name
        self.features = features or ChatFeatures()

    def _check_common(self, req: Any) -> None:
        check_model(req.model, self.model_name)
        check_n(req.n)
        if req.stream_options is not None and not req.stream:
            raise ServingError("stream_options is only allowed when stream is true", "stream_options")

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        self._check_common(req)
        try:
            plan = plan_chat(req.response_format, req.regex, req.ebnf, req.tools, req.tool_choice,
                             req.parallel_tool_calls, self.features.tool_format)
        except ValueError as e:
            raise ServingError(str(e), str(e).split(":", 1)[0]) from e
        if req.top_logprobs:
            raise ServingError(
                "top_logprobs > 0 is not supported (the chosen tokens' logprobs are returned with top_logprobs 0)",
                "top_logprobs",
            )
        fields = req.model_dump()
        mt_field = "max_tokens"
        if req.max_completion_tokens is not None:
            fields["max_tokens"], mt_field = req.max_completion_tokens, "max_completion_tokens"
        sampling = {**build_sampling(fields, mt_field), **plan.grammar}
        msg = TokenizeMsg(
            self.frontend.new_uids(req.n),
            messages=chat_messages(req),
            sampling=sampling,
            logprobs=req.logprobs,
            skip_special_tokens=req.skip_special_tokens,
            prompt_field="messages",
            max_tokens_field=mt_field,
            tools=plan.template_tools,
            chat_template_kwargs=req.chat_template_kwargs,
            reasoning=self.features.reasoning,
        )
        return await self._run([msg], req, request, chat=True, logprobs=req.logprobs, plan=plan)

    async def completion(self, req: CompletionRequest, request: Request) -> Any:
        self._check_common(req)
        for name, bad in (("echo", req.echo), ("suffix", req.suffix), ("best_of", req.best_of not in (None, req.n))):
            if bad:
                raise ServingError(f"{name} is not supported", name)
        if req.logprobs:
            raise ServingError(
                "logprobs > 0 is not supported (logprobs 0 returns the chosen tokens' logprobs)", "logprobs"
            )
        sampling = build_sampling(req.model_dump())
        if req.max_tokens is None:
            sampling["max_tokens"] = 16  # OpenAI's default for completions
        prompts: list[Any]
        p = req.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            prompts = [p]
        else:
            prompts = list(p)
        if not prompts:
            raise ServingError("prompt must not be empty", "prompt")
        msgs = []
        for prompt in prompts:
            kind = {"text": prompt} if isinstance(prompt, str) else {"input_ids": prompt}
            msgs.append(
                TokenizeMsg(
                    self.frontend.new_uids(req.n),
                    sampling=sampling,
                    logprobs=req.logprobs is not None,
                    skip_special_tokens=req.skip_special_tokens,
                    **kind,
                )
            )
        return await self._run(msgs, req, request, chat=False, logprobs=req.logprobs is not None)

    async def _run(
        self, msgs: list[TokenizeMsg], req: Any, request: Request, chat: bool, logprobs: bool,
        plan: ChatPlan | None = None,
    ) -> Any:
        handle = self.frontend.submit(msgs)
        first = await first_reply(self.frontend, handle, request)
        tracker = ChoiceTracker(handle, req.n)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {
            "id": rid,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
        }
        # Streams learn of a gone client from Starlette cancelling them; others poll for it.
        replies = all_replies(self.frontend, handle, first, None if req.stream else request)
        outputs = None
        if chat and plan is not None and (plan.tool_format or self.features.reasoning):
            fmt, reasoning = plan.tool_format, self.features.reasoning
            outputs = [ChatOutput(reasoning, first.reasoning_open, fmt, plan.max_calls) for _ in handle.uids]
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(replies, tracker, head, chat, logprobs, usage, outputs)
            return StreamingResponse(body, media_type="text/event-stream")
        async for r in replies:
            tracker.add(r)
        choices = []
        for i, text in enumerate(tracker.text):
            lp = None
            if logprobs:
                lp = (
                    _chat_logprobs(tracker.token_texts[i], tracker.logprobs[i])
                    if chat
                    else _completion_logprobs(tracker.token_texts[i], tracker.logprobs[i], 0)
                )
            c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": tracker.finish[i]}
            if chat and outputs is not None:
                out = outputs[i]
                out.feed(text)
                _, c["finish_reason"] = out.finish(tracker.finish[i])
                c["message"] = out.message()
            elif chat:
                c["message"] = {"role": "assistant", "content": text}
            else:
                c["text"] = text
            choices.append(c)
        return JSONResponse({**head, "choices": choices, "usage": tracker.usage()})

    async def _stream(
        self,
        replies: AsyncIterator[UserReply],
        tracker: ChoiceTracker,
        head: dict[str, Any],
        chat: bool,
        logprobs: bool,
        usage: bool,
        outputs: list[ChatOutput] | None = None,
    ) -> AsyncIterator[str]:
        head = {**head, "object": "chat.completion.chunk" if chat else "text_completion"}
        extra = {"usage": None} if usage else {}
        started: set[int] = set()
        offsets = [0] * len(tracker.text)
        try:
            async for r in replies:
                i = tracker.add(r)
                if chat and i not in started:
                    started.add(i)
                    delta = {"role": "assistant", "content": ""}
                    yield sse(
                        {
                            **head,
                            "choices": [{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}],
                            **extra,
                        }
                    )
                lp = None
                if logprobs and r.token_ids:
                    lp = (
                        _chat_logprobs(r.token_texts or [], r.logprobs or [])
                        if chat
                        else _completion_logprobs(r.token_texts or [], r.logprobs or [], offsets[i])
                    )
                offsets[i] += len(r.text)
                if outputs is not None:
                    for chunk in self._chat_chunks(outputs[i], i, r, lp):
                        yield sse({**head, "choices": [chunk], **extra})
                    continue
                if not (r.text or lp or r.finish_reason):
                    continue
                c: dict[str, Any] = {"index": i, "logprobs": lp, "finish_reason": r.finish_reason}
                if chat:
                    c["delta"] = {"content": r.text} if r.text else {}
                else:
                    c["text"] = r.text
                yield sse({**head, "choices": [c], **extra})
            if usage:
                yield sse({**head, "choices": [], "usage": tracker.usage()})
        except ServingError as e:  # after the 200 went out, an error can only be an event
            yield sse(e.body())
        yield SSE_DONE

    @staticmethod
    def _chat_chunks(out: ChatOutput, i: int, r: UserReply, lp: Any) -> list[dict[str, Any]]:
        """The stream choices of one reply through the output parser: one per delta (reasoning,
        content, a tool call's id and name, a piece of its arguments), the finish last."""
        deltas = out.feed(r.text)
        reason = None
        if r.finish_reason is not None:
            tail, reason = out.finish(r.finish_reason)
            deltas += tail
        chunks = [{"index": i, "delta": d, "logprobs": None, "finish_reason": None} for d in deltas]
        if lp is not None:
            chunks.append({"index": i, "delta": {}, "logprobs": lp, "finish_reason": None})
        if reason is not None:
            chunks.append({"index": i, "delta": {}, "logprobs": None, "finish_reason": reason})
        return chunks
