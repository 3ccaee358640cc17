"""The FastAPI app: OpenAI-compatible routes, native /generate, /health, /metrics."""

from __future__ import annotations

import hmac
import time
import uuid
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse

from minisgl.message import TokenizeMsg
from minisgl.server.frontend import ClientGone, Frontend
from minisgl.server.openai_protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from minisgl.server.openai_serving import ChatFeatures, OpenAIServing
from minisgl.server.serving import SSE_DONE, ChoiceTracker, ServingError, all_replies, build_sampling, first_reply, sse

_GENERATE_KEYS = {
    "max_new_tokens",
    "max_tokens",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "seed",
    "stop",
    "stop_token_ids",
    "ignore_eos",
    "skip_special_tokens",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
}
_CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it


def _param_of(loc: tuple[Any, ...]) -> str | None:
    parts = [p for p in loc if p != "body"]
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (f".{p}" if out else str(p))
    return out or None


def _validation_error(exc: RequestValidationError) -> ServingError:
    err = exc.errors()[0]
    if err.get("type") == "json_invalid":
        return ServingError(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    param = _param_of(tuple(err.get("loc", ())))
    if param is None:
        return ServingError(f"the request body must be a JSON object: {err.get('msg')}")
    return ServingError(f"{param}: {err.get('msg')}", param)


class _ApiKeyMiddleware:
    """Every route but /health needs `Authorization: Bearer KEY`. Plain ASGI rather than
    @app.middleware("http"), which would wrap streams and hide client disconnects."""

    def __init__(self, app: Any, expected: bytes) -> None:
        self.app, self.expected = app, expected

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                err = ServingError(
                    "invalid or missing API key (Authorization: Bearer KEY)",
                    None,
                    401,
                    "invalid_api_key",
                    "authentication_error",
                )
                await JSONResponse(err.body(), status_code=401)(scope, receive, send)
                return
        await self.app(scope, receive, send)


def build_app(
    frontend: Frontend, model_name: str, api_key: str | None, workers_alive: Callable[[], bool],
    features: ChatFeatures | None = None,
) -> FastAPI:
    app = FastAPI(title="minisgl", docs_url=None, redoc_url=None)
    serving = OpenAIServing(frontend, model_name, features)

    @app.exception_handler(ServingError)
    async def _serving_error(_: Request, exc: ServingError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        err = _validation_error(exc)
        return JSONResponse(err.body(), status_code=err.status)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=_CLIENT_CLOSED)

    if api_key is not None:
        app.add_middleware(_ApiKeyMiddleware, expected=f"Bearer {api_key}".encode())

    @app.get("/health")
    async def health() -> Response:
        ok = frontend.dead is None and workers_alive()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "created": int(app.state.started), "owned_by": "minisgl"}
        return {"object": "list", "data": [card]}

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request) -> Any:
        return await serving.chat(req, request)

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request) -> Any:
        return await serving.completion(req, request)

    @app.post("/generate")
    async def generate(req: GenerateRequest, request: Request) -> Any:
        return await _generate(frontend, req, request)

    app.state.started = time.time()
    return app


async def _generate(frontend: Frontend, req: GenerateRequest, request: Request) -> Any:
    """SGLang-style native endpoint; streams carry the cumulative text, as SGLang's do."""
    sp = dict(req.sampling_params)
    unknown = sorted(set(sp) - _GENERATE_KEYS)
    if unknown:
        raise ServingError(
            f"sampling_params.{unknown[0]} is not a known sampling parameter", f"sampling_params.{unknown[0]}"
        )
    if (req.text is None) == (req.input_ids is None):
        raise ServingError("give exactly one of text and input_ids", "text")
    name = "max_new_tokens" if "max_new_tokens" in sp else "max_tokens"
    sp["max_tokens"] = sp.pop("max_new_tokens", sp.get("max_tokens", 128))
    skip = bool(sp.pop("skip_special_tokens", True))
    try:
        sampling = build_sampling(sp, name)
    except ServingError as e:
        e.param = e.param and f"sampling_params.{e.param}"
        raise
    prompt = {"text": req.text} if req.text is not None else {"input_ids": req.input_ids}
    msg = TokenizeMsg(
        frontend.new_uids(1),
        sampling=sampling,
        logprobs=req.return_logprob,
        skip_special_tokens=skip,
        prompt_field="text" if req.text is not None else "input_ids",
        max_tokens_field=f"sampling_params.{name}",
        **prompt,
    )
    handle = frontend.submit([msg])
    first = await first_reply(frontend, handle, request)
    tracker, rid = ChoiceTracker(handle, 1), uuid.uuid4().hex

    def result() -> dict[str, Any]:
        meta: dict[str, Any] = {
            "id": rid,
            "prompt_tokens": tracker.prompt_tokens[0],
            "completion_tokens": tracker.completion_tokens[0],
            "finish_reason": tracker.finish[0] and {"type": tracker.finish[0]},
        }
        if req.return_logprob:
            meta["output_token_logprobs"] = [
                [lp, t] for lp, t in zip(tracker.logprobs[0], tracker.token_ids[0], strict=False)
            ]
        return {"text": tracker.text[0], "output_ids": tracker.token_ids[0], "meta_info": meta}

    if not req.stream:
        async for r in all_replies(frontend, handle, first, request):
            tracker.add(r)
        return JSONResponse(result())

    async def body() -> AsyncIterator[str]:
        try:
            async for r in all_replies(frontend, handle, first, None):
                tracker.add(r)
                yield sse(result())
        except ServingError as e:
            yield sse(e.body())
        yield SSE_DONE

    return StreamingResponse(body(), media_type="text/event-stream")
