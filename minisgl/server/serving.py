"""Shared pieces of the generation endpoints: sampling fields → SamplingParams fields, the
OpenAI error type, and walking a request's replies (with abort on any early exit)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from minisgl.engine.sampling_params import SamplingParams
from minisgl.message import UserReply
from minisgl.server.frontend import Frontend, RequestHandle

MAX_N = 128
_PARAM_NAMES = {"max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "stop", "stop_token_ids", "ignore_eos"}


class ServingError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = (message, param, status, code, kind)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def refuse_unsupported(fields: dict[str, Any]) -> None:
    """Fields that would change the output but are not implemented: 400, never ignored."""
    for name, value, neutral in (
        ("presence_penalty", fields.get("presence_penalty"), 0.0),
        ("frequency_penalty", fields.get("frequency_penalty"), 0.0),
        ("repetition_penalty", fields.get("repetition_penalty"), 1.0),
    ):
        if value is not None and value != neutral:
            raise ServingError(f"{name} is not supported (only {neutral} is)", name)
    if fields.get("logit_bias"):
        raise ServingError("logit_bias is not supported", "logit_bias")


def build_sampling(fields: dict[str, Any], max_tokens_field: str = "max_tokens") -> dict[str, Any]:
    """SamplingParams fields from request fields (OpenAI names), validated; max_tokens None
    means "the rest of the context" (the tokenizer fills it in)."""
    refuse_unsupported(fields)
    top_k = fields.get("top_k")
    d: dict[str, Any] = {
        "max_tokens": fields.get("max_tokens"),
        "temperature": 1.0 if fields.get("temperature") is None else fields["temperature"],
        "top_p": 1.0 if fields.get("top_p") is None else fields["top_p"],
        "top_k": -1 if top_k in (None, 0) else top_k,  # 0 and -1 both mean off
        "min_p": fields.get("min_p") or 0.0,
        "seed": fields.get("seed"),
        "stop": fields.get("stop"),
        "stop_token_ids": fields.get("stop_token_ids"),
        "ignore_eos": bool(fields.get("ignore_eos", False)),
    }
    try:
        probe = {**d, "max_tokens": 1 if d["max_tokens"] is None else d["max_tokens"]}
        params = SamplingParams(**probe)
    except ValueError as e:
        name = str(e).split(" ", 1)[0]
        if name == "max_tokens" and max_tokens_field != "max_tokens":
            raise ServingError(str(e).replace("max_tokens", max_tokens_field, 1), max_tokens_field) from e
        raise ServingError(str(e), name if name in _PARAM_NAMES else None) from e
    d["stop"] = params.stop
    return d


def check_n(n: int) -> None:
    if not 1 <= n <= MAX_N:
        raise ServingError(f"n must be in [1, {MAX_N}], got {n}", "n")


def raise_error(frontend: Frontend, reply: UserReply) -> None:
    if frontend.dead:
        raise ServingError(reply.error or "server error", None, 503, kind="server_error")
    raise ServingError(reply.error or "bad request", reply.error_param)


async def first_reply(frontend: Frontend, handle: RequestHandle, request: Any) -> UserReply:
    """Waits for the request's first reply before any HTTP status is sent, so that a prompt
    the tokenizer or scheduler refuses still gets its 400."""
    try:
        reply = await frontend.next_reply(handle, request)
    except BaseException:
        frontend.abort(handle)
        raise
    if reply.error is not None:
        frontend.abort(handle)
        raise_error(frontend, reply)
    return reply


async def all_replies(
    frontend: Frontend, handle: RequestHandle, first: UserReply | None, request: Any
) -> AsyncIterator[UserReply]:
    """Every reply of `handle` (starting with `first`); whoever stops early (client gone,
    error, cancellation) aborts what is still running, freeing its KV slots."""
    try:
        if first is not None:
            yield first
        while not handle.done or not handle.queue.empty():
            reply = await frontend.next_reply(handle, request)
            if reply.error is not None:
                raise_error(frontend, reply)
            yield reply
    finally:
        if not handle.done:
            frontend.abort(handle)


def sse(obj: Any) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False)}\n\n"


SSE_DONE = "data: [DONE]\n\n"


class ChoiceTracker:
    """Accumulates each choice's text, tokens and usage across replies."""

    def __init__(self, handle: RequestHandle, n: int) -> None:
        k = len(handle.uids)
        self.handle, self.n = handle, n
        self.text = [""] * k
        self.token_ids: list[list[int]] = [[] for _ in range(k)]
        self.logprobs: list[list[float]] = [[] for _ in range(k)]
        self.token_texts: list[list[str]] = [[] for _ in range(k)]
        self.finish: list[str | None] = [None] * k
        self.prompt_tokens = [0] * k
        self.completion_tokens = [0] * k

    def add(self, r: UserReply) -> int:
        i = self.handle.index[r.uid]
        self.text[i] += r.text
        self.token_ids[i] += r.token_ids
        self.logprobs[i] += r.logprobs or []
        self.token_texts[i] += r.token_texts or []
        self.prompt_tokens[i] = r.prompt_tokens
        self.completion_tokens[i] = r.completion_tokens
        if r.finish_reason is not None:
            self.finish[i] = r.finish_reason
        return i

    def usage(self) -> dict[str, int]:
        # A prompt counts once however many choices (n) it has, as OpenAI counts it.
        prompt = sum(self.prompt_tokens[i] for i in range(0, len(self.text), self.n))
        completion = sum(self.completion_tokens)
        return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
