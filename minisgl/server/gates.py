"""ASGI gates every HTTP request passes before routing, outermost first: a request id and the
last-resort 500, the API key, the body-size limit. Plain ASGI rather than
@app.middleware("http"), which would wrap streams and hide client disconnects."""

from __future__ import annotations

import hmac
import uuid
from typing import Any

from minisgl.logging_setup import get_logger
from minisgl.message import trace
from minisgl.server.errors import ApiError, internal_error

log = get_logger("minisgl.server")
PUBLIC_PATHS = ("/health", "/openapi.json", "/docs")  # open even with --api-key: no data, no work
REQUEST_ID_HEADER = "x-request-id"


def default_max_request_bytes(max_model_len: int) -> int:
    """64 bytes per token of context (English is ~4 bytes a token; JSON-escaped emoji and CJK,
    6-12 bytes a character; a token id with its comma, under 8), and never below 1 MiB."""
    return max(1 << 20, 64 * max_model_len)


class RequestGuard:
    """Gives each request an id (the `x-request-id` response header) and turns an exception
    no handler caught into an `internal_error` 500, logged once with the id. The server keeps
    serving: the exception ends this request only. It also notes when the request came in,
    the start of its hop trace (message/trace.py), whose line it logs once the first chunk
    of the answer is written."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid = uuid.uuid4().hex
        state = scope.setdefault("state", {})
        state["request_id"], state["received"] = rid, trace.now()
        started = False

        async def send_with_id(message: dict[str, Any]) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                message["headers"] = [*message.get("headers", []), (REQUEST_ID_HEADER.encode(), rid.encode())]
            await send(message)
            if message["type"] == "http.response.body" and "trace" in state:  # a traced request's first chunk
                hops, info = state.pop("trace")
                trace.stamp(hops, "sent")
                log.info("%s", trace.request_line(hops, info))

        try:
            await self.app(scope, receive, send_with_id)
        except Exception:  # noqa: BLE001 - the last resort: any bug is one request's 500
            log.exception("internal error in %s %s (request id %s)", scope.get("method"), scope.get("path"), rid)
            if not started:
                await internal_error(rid).response(path=scope.get("path"))(scope, receive, send_with_id)


class ApiKeyGate:
    """Every route but PUBLIC_PATHS needs the key: `Authorization: Bearer KEY`, or `x-api-key: KEY`
    (how Anthropic's clients send it)."""

    def __init__(self, app: Any, key: str) -> None:
        self.app, self.bearer, self.key = app, f"Bearer {key}".encode(), key.encode()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] not in PUBLIC_PATHS:
            headers = dict(scope["headers"])
            bearer_ok = hmac.compare_digest(headers.get(b"authorization", b""), self.bearer)
            if not (bearer_ok or hmac.compare_digest(headers.get(b"x-api-key", b""), self.key)):
                err = ApiError(
                    "invalid or missing API key (Authorization: Bearer KEY, or x-api-key: KEY)",
                    None,
                    401,
                    "invalid_api_key",
                    "authentication_error",
                )
                await err.response({"www-authenticate": "Bearer"}, scope["path"])(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitGate:
    """Refuses a body over `limit` bytes with 413 before it is parsed: from Content-Length
    without reading it, else (chunked) as soon as the bytes read pass the limit. A body
    within the limit is read whole here and replayed to the app."""

    def __init__(self, app: Any, limit: int) -> None:
        self.app, self.limit = app, limit

    def _too_large(self, size: str) -> ApiError:
        return ApiError(
            f"the request body is {size} bytes; this server takes at most {self.limit} "
            "(--max-request-bytes)",
            None,
            413,
            "request_too_large",
        )

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        length = dict(scope["headers"]).get(b"content-length")
        if length is not None:
            if not length.isdigit():
                err = ApiError("the Content-Length header is not a number")
                await err.response(path=scope["path"])(scope, receive, send)
                return
            if int(length) > self.limit:
                err = self._too_large(length.decode())
                await err.response({"connection": "close"}, scope["path"])(scope, receive, send)
                return
        chunks, size = [], 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                return  # the client left while sending: nobody to answer
            size += len(message.get("body", b""))
            if size > self.limit:
                err = self._too_large(f"over {size}")
                await err.response({"connection": "close"}, scope["path"])(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            if not message.get("more_body", False):
                break
        body, replayed = b"".join(chunks), False

        async def replay() -> dict[str, Any]:
            nonlocal replayed
            if replayed:
                return await receive()  # after the body: disconnect notices
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}

        await self.app(scope, replay, send)
