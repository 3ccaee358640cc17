"""POST /v1/chat/completions and /v1/completions: OpenAI bodies in, OpenAI responses out."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

from minisgl.message import TokenizeMsg, UserReply
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

CHAT_ROLES = {"system", "developer", "user", "assistant"}


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
        out.append({"role": "system" if m.role == "developer" else m.role, "content": content})
    return out


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
    def __init__(self, frontend: Frontend, model_name: str) -> None:
        self.frontend = frontend
        self.model_name = model_name

    def _check_common(self, req: Any) -> None:
        check_model(req.model, self.model_name)
        check_n(req.n)
        if req.stream_options is not None and not req.stream:
            raise ServingError("stream_options is only allowed when stream is true", "stream_options")

    async def chat(self, req: ChatCompletionRequest, request: Request) -> Any:
        self._check_common(req)
        if req.tools:
            raise ServingError("tools are not supported", "tools")
        if req.response_format and req.response_format.get("type", "text") != "text":
            raise ServingError("response_format other than text is not supported", "response_format")
        if req.top_logprobs:
            raise ServingError(
                "top_logprobs > 0 is not supported (the chosen tokens' logprobs are returned with top_logprobs 0)",
                "top_logprobs",
            )
        fields = req.model_dump()
        mt_field = "max_tokens"
        if req.max_completion_tokens is not None:
            fields["max_tokens"], mt_field = req.max_completion_tokens, "max_completion_tokens"
        sampling = build_sampling(fields, mt_field)
        msg = TokenizeMsg(
            self.frontend.new_uids(req.n),
            messages=chat_messages(req),
            sampling=sampling,
            logprobs=req.logprobs,
            skip_special_tokens=req.skip_special_tokens,
            prompt_field="messages",
            max_tokens_field=mt_field,
        )
        return await self._run([msg], req, request, chat=True, logprobs=req.logprobs)

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

    async def _run(self, msgs: list[TokenizeMsg], req: Any, request: Request, chat: bool, logprobs: bool) -> Any:
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
        if req.stream:
            usage = bool(req.stream_options and req.stream_options.include_usage)
            body = self._stream(replies, tracker, head, chat, logprobs, usage)
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
            if chat:
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
