"""What sglang-router (the SGLang Model Gateway, `pip install sglang-router`) needs from a
worker, beyond the OpenAI routes: found by reading its source and by running 0.3.2 against a
recording server.

- On registering a worker it calls `GET /health` (its health checks too: every
  --health-check-interval-secs), then `GET /server_info` and `GET /model_info` (falling back to
  `/get_server_info`, `/get_model_info`). Without them the worker's model id is "unknown": the
  router's own `GET /v1/models` then lists "unknown", and a client that sends that name back
  gets a 404 from us.
- Policy power_of_two polls `GET /get_load` (a list with one entry per DP rank; it sums
  `num_tokens`); the router's `GET /get_loads` shows the same numbers.
- `GET /health_generate` (a health check that generates one token) is what SGLang workers
  offer for `--health-check-endpoint /health_generate`.
- The router adds SGLang's extension fields to every body it forwards, at values that change
  nothing (`no_stop_trim: false`, `return_hidden_states: false`, ...; on /generate also
  `model: null`, `log_metrics: true`, ...). `RouterFieldsShim` drops exactly those fields at
  exactly those values, so the API's own checks see the client's request; any other value
  passes through to be honoured or refused by the API like any field.
- Its `POST /flush_cache` (fanned out to every worker) and `GET /engine_metrics` (our
  /metrics) are admin routes; routing itself never calls them. /flush_cache is not offered.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

from fastapi import FastAPI
from fastapi.responses import JSONResponse, Response

from minisgl.core.sampling_params import SamplingParams
from minisgl.message import TokenizeMsg
from minisgl.server.frontend import Frontend

HEALTH_GENERATE_TIMEOUT_S = 20.0

# Per route: the fields sglang-router 0.3.2 adds, and the value at which each changes nothing.
_NEUTRAL_COMMON: dict[str, Any] = {"no_stop_trim": False, "return_hidden_states": False}
ROUTER_NEUTRAL_FIELDS: dict[str, dict[str, Any]] = {
    "/v1/completions": _NEUTRAL_COMMON,
    "/v1/chat/completions": {
        **_NEUTRAL_COMMON,
        "continue_final_message": False,
        # Reasoning-parser switches: without a reasoning parser they do nothing.
        "separate_reasoning": True,
        "stream_reasoning": True,
    },
    "/generate": {
        **_NEUTRAL_COMMON,
        "model": None,
        "return_text_in_logprobs": False,
        "log_metrics": True,
        "background": False,
        "no_logs": False,
        "return_bytes": False,
        "return_entropy": False,
    },
}


def strip_neutral_fields(path: str, body: Any) -> Any:
    """`body` without the router's fields that hold their neutral value (same type and value:
    `0` is not `false`)."""
    neutral = ROUTER_NEUTRAL_FIELDS.get(path)
    if not neutral or not isinstance(body, dict):
        return body
    return {
        k: v for k, v in body.items() if not (k in neutral and type(v) is type(neutral[k]) and v == neutral[k])
    }


class RouterFieldsShim:
    """ASGI middleware: applies `strip_neutral_fields` to JSON bodies of the generation routes.
    Bodies that are not JSON objects pass untouched (the API reports them)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http" or scope["method"] != "POST" or scope["path"] not in ROUTER_NEUTRAL_FIELDS:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                await self.app(scope, _replay([message], receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        parsed = None
        if any(b'"%s"' % k.encode() in body for k in ROUTER_NEUTRAL_FIELDS[scope["path"]]):
            try:  # only bodies naming one of the fields are parsed here (a substring test is cheap)
                parsed = json.loads(body)
            except ValueError:
                pass
        stripped = strip_neutral_fields(scope["path"], parsed)
        if parsed is not None and stripped != parsed:
            body = json.dumps(stripped).encode()
            headers = [(k, v) for k, v in scope["headers"] if k != b"content-length"]
            scope = {**scope, "headers": [*headers, (b"content-length", str(len(body)).encode())]}
        await self.app(scope, _replay([{"type": "http.request", "body": body, "more_body": False}], receive), send)


def _replay(first: list[dict[str, Any]], receive: Any) -> Any:
    """A `receive` that returns `first`, then defers to the real one (disconnect notices)."""
    pending = list(first)

    async def replayed() -> dict[str, Any]:
        return pending.pop(0) if pending else await receive()

    return replayed


def server_info(args: Any, schedulers: list[dict[str, Any]]) -> dict[str, Any]:
    """GET /server_info: SGLang's field names where one fits (the router reads model_path,
    served_model_name, dp_size); `schedulers` are the replicas' ready infos."""
    from minisgl.models.source import resolve_model
    from minisgl.server.api import package_version

    return {
        "model_path": str(resolve_model(args.model).path),
        "tokenizer_path": args.tokenizer,
        "served_model_name": args.served_model_name,
        "dp_size": args.dp,
        "tp_size": args.tp,
        "context_length": min(s["max_model_len"] for s in schedulers),
        "max_total_tokens": min(s["kv_total"] for s in schedulers),  # per replica
        "max_running_requests": args.max_running_requests,
        "page_size": args.page_size,
        "load_balance_method": args.load_balance_method,
        "devices": [s.get("device") for s in schedulers],
        "architectures": [schedulers[0].get("architecture")],
        "version": package_version(),
    }


def add_router_routes(app: FastAPI, frontend: Frontend, info: dict[str, Any]) -> None:
    """The routes above, on the API app (their API key check is the app's)."""
    app.add_middleware(RouterFieldsShim)
    model = {
        "model_path": info["model_path"],
        "tokenizer_path": info["tokenizer_path"] or info["model_path"],
        "is_generation": True,
        "architectures": info["architectures"],
    }

    for path in ("/server_info", "/get_server_info"):
        app.add_api_route(path, lambda: info, methods=["GET"])
    for path in ("/model_info", "/get_model_info"):
        app.add_api_route(path, lambda: model, methods=["GET"])

    @app.get("/get_load")
    async def get_load() -> list[dict[str, int]]:
        latest = sorted(frontend.metrics.replicas.latest.items())
        return [
            {"dp_rank": r, "num_reqs": s.running, "num_waiting_reqs": s.queued, "num_tokens": s.load_tokens}
            for r, s in latest
        ]

    @app.get("/health_generate")
    async def health_generate() -> Response:
        """200 once a one-token generation comes back, 503 if it fails or takes too long."""
        if frontend.dead is not None:
            return JSONResponse({"status": "unhealthy", "reason": frontend.dead}, status_code=503)
        msg = TokenizeMsg([0], input_ids=[0], sampling=SamplingParams(max_tokens=1, temperature=0.0))
        handle = frontend.submit([msg], metered=False)  # submit numbers the uids

        async def finished() -> str | None:
            while not handle.done:
                reply = await frontend.next_reply(handle)
                if reply.error is not None:
                    return reply.error
            return None

        try:
            error = await asyncio.wait_for(finished(), HEALTH_GENERATE_TIMEOUT_S)
        except asyncio.TimeoutError:
            frontend.abort(handle)
            error = f"no token within {HEALTH_GENERATE_TIMEOUT_S:.0f} s"
        if error is not None:
            return JSONResponse({"status": "unhealthy", "reason": error}, status_code=503)
        return JSONResponse({"status": "ok"})
