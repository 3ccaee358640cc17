"""The FastAPI app: routes wire one request through the stages, in one direction:

    protocol (parse, validate) -> build (engine request) -> frontend (submit, await) -> render / stream

This module has no `from __future__ import annotations`: the request models are built per
server (their bounds are the model's), and FastAPI reads route annotations as objects.
"""

from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.metadata import PackageNotFoundError, version
from typing import Any

from fastapi import FastAPI, Request
from fastapi import Path as PathParam
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from minisgl.message import DecodeMsg
from minisgl.models.embedding_config import EmbeddingConfig
from minisgl.models.sampling_defaults import OPENAI_DEFAULTS
from minisgl.server import openapi_doc
from minisgl.server.anthropic_api import add_anthropic_routes
from minisgl.server.anthropic_protocol import AnthropicProtocol
from minisgl.server.build import Builder, Job
from minisgl.server.chat_request import ChatFeatures
from minisgl.server.embeddings import GENERATION_PATHS, add_embedding_routes
from minisgl.server.errors import ApiError, from_validation
from minisgl.server.frontend import ClientGone, Frontend
from minisgl.server.gates import ApiKeyGate, BodyLimitGate, RequestGuard
from minisgl.server.protocol import Protocol
from minisgl.server.protocol_types import Limits
from minisgl.server.render import generate_result, respond
from minisgl.server.responses_api import add_responses_routes
from minisgl.server.responses_protocol import ResponsesProtocol
from minisgl.server.stages import Stages
from minisgl.server.stream import event_stream, generate_events, openai_events

_CLIENT_CLOSED = 499  # nginx's code for "client closed request"; nobody reads it
_BAD_BODY = "There was an error parsing the body"  # FastAPI's words for a non-UTF-8 body


def package_version() -> str:
    try:
        return version("minisgl")
    except PackageNotFoundError:
        return "unknown"


@dataclass
class ServerInfo:
    model_name: str
    limits: Limits
    sampling_defaults: dict[str, Any]  # the model's, for fields a request leaves out
    max_request_bytes: int
    api_key: str | None = None
    started: float = 0.0
    workers_alive: Callable[[], bool] = field(default=lambda: True)
    features: ChatFeatures = field(default_factory=ChatFeatures)  # tool-call and reasoning parsers
    embedding: EmbeddingConfig | None = None  # set on an embedding model's server (--task embed)

    def model_card(self) -> dict[str, Any]:
        card = {
            "id": self.model_name,
            "object": "model",
            "created": int(self.started),
            # SGLang's value: SMG (the SGLang model gateway) tells an SGLang HTTP worker by it, and
            # then reads its loads from /v1/loads (server/gateway.py), which this server serves.
            "owned_by": "sglang",
            "max_model_len": self.limits.max_model_len,
            "task": "embed" if self.embedding is not None else "generate",
        }
        if self.embedding is None:
            card["sampling_defaults"] = {**OPENAI_DEFAULTS, **self.sampling_defaults}
        else:
            card.update(pooling=self.embedding.pooling, dimensions=self.embedding.dimensions)
        return card


def build_app(frontend: Frontend, info: ServerInfo) -> FastAPI:
    app = FastAPI(title="minisgl", version=package_version(), redoc_url=None)
    tools, reasoning = info.features.tool_format is not None, info.features.reasoning is not None
    P = Protocol(info.limits, tools=tools)
    builder = Builder(info.model_name, info.limits, info.sampling_defaults, info.features)
    stages = Stages(frontend, builder, P.chat)
    _install_error_handlers(app)
    hidden = GENERATION_PATHS if info.embedding is not None else ()  # refused by the task (embeddings.py)
    openapi_doc.install(app, info.api_key is not None, package_version(), hidden)
    app.add_middleware(BodyLimitGate, limit=info.max_request_bytes)
    if info.api_key is not None:
        app.add_middleware(ApiKeyGate, key=info.api_key)
    app.add_middleware(RequestGuard)
    gen_errors = {**openapi_doc.errors(400, 404, 503)}
    add_embedding_routes(app, stages, info.limits, info.embedding)  # first: it may refuse the generate routes

    async def run(job: Job, request: Request) -> Response:
        replies, tracker, rid = await stages.start(job, request)
        if job.kind == "generate":
            if job.stream:
                return event_stream(generate_events(job, replies, tracker), rid)
            async for r in replies:
                tracker.add(r)
            return JSONResponse(generate_result(job, tracker, rid))
        if job.stream:
            return event_stream(openai_events(job, replies, tracker, info.model_name), rid)
        return await respond(job, replies, tracker, info.model_name)

    @app.post(
        "/v1/chat/completions",
        responses={**openapi_doc.streams("A chat.completion, or chat.completion.chunk events"), **gen_errors},
    )
    async def chat(req: P.chat, request: Request) -> Response:  # type: ignore[valid-type]
        return await run(builder.chat(req), request)

    @app.post("/v1/completions", responses={**openapi_doc.streams("A text_completion, or its events"), **gen_errors})
    async def completions(req: P.completion, request: Request) -> Response:  # type: ignore[valid-type]
        return await run(builder.completion(req), request)

    @app.post("/generate", responses={**openapi_doc.streams("SGLang's {text, output_ids, meta_info}"), **gen_errors})
    async def generate(req: P.generate, request: Request) -> Response:  # type: ignore[valid-type]
        """SGLang-style native endpoint; streams carry the cumulative text, as SGLang's do."""
        return await run(builder.generate(req), request)

    add_anthropic_routes(app, stages, AnthropicProtocol(info.limits, tools, reasoning))
    add_responses_routes(app, stages, ResponsesProtocol(info.limits, tools, reasoning))

    @app.post("/tokenize", responses=openapi_doc.errors(400, 404, 503))
    async def tokenize(req: P.tokenize, request: Request) -> dict[str, Any]:  # type: ignore[valid-type]
        """vLLM's: `{count, max_model_len, tokens}` (and `token_strs` when asked)."""
        msg, names = builder.tokenize(req)
        reply = await stages.tokenize(msg, names, request)
        body: dict[str, Any] = {
            "count": len(reply.token_ids),
            "max_model_len": info.limits.max_model_len,
            "tokens": reply.token_ids,
        }
        if req.return_token_strs:
            body["token_strs"] = reply.token_texts
        return body

    @app.post("/detokenize", responses=openapi_doc.errors(400, 404, 503))
    async def detokenize(req: P.detokenize, request: Request) -> dict[str, str]:  # type: ignore[valid-type]
        """vLLM's: `{tokens}` -> `{prompt}` (special tokens kept)."""
        builder.check_model(req.model)
        return {"prompt": (await stages.tokenize(DecodeMsg(0, list(req.tokens)), {}, request)).text}

    @app.get("/health", responses={503: {"description": "a server process is gone, or the server is draining"}})
    async def health() -> Response:
        if frontend.admission.draining:  # readiness off at once: routers stop sending here
            return JSONResponse({"status": "draining", "reason": "draining: the server is shutting down"}, 503)
        ok = frontend.dead is None and info.workers_alive()
        return JSONResponse({"status": "ok" if ok else "unhealthy"}, status_code=200 if ok else 503)

    @app.get("/metrics", response_class=PlainTextResponse, responses=openapi_doc.errors())
    async def metrics() -> Response:
        """Prometheus text format."""
        return Response(frontend.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/version", responses=openapi_doc.errors())
    async def server_version() -> dict[str, str]:
        return {"version": package_version()}

    @app.get("/v1/models", responses=openapi_doc.errors())
    async def models() -> dict[str, Any]:
        return {"object": "list", "data": [info.model_card()]}

    @app.get("/v1/models/{model_id:path}", responses=openapi_doc.errors(404))
    async def model(model_id: str = PathParam(examples=[info.model_name])) -> dict[str, Any]:
        builder.check_model(model_id)
        return info.model_card()

    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(ApiError)
    async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        return exc.response(path=request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        return from_validation(list(exc.errors())).response(path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 404:
            err = ApiError(f"no route {request.method} {request.url.path}", None, 404, "not_found")
        elif exc.status_code == 405:
            err = ApiError(f"{request.url.path} does not take {request.method}", None, 405, "method_not_allowed")
        elif exc.detail == _BAD_BODY:
            err = ApiError("the request body is not valid UTF-8 JSON")
        else:
            err = ApiError(str(exc.detail), None, exc.status_code)
        return err.response(dict(exc.headers or {}), request.url.path)

    @app.exception_handler(ClientGone)
    async def _client_gone(_: Request, __: ClientGone) -> Response:
        return Response(status_code=_CLIENT_CLOSED)
