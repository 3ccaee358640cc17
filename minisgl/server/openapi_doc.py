"""/openapi.json as the server behaves: every error is the OpenAI error object (never FastAPI's
422 shape), each route lists the statuses it can answer, streams are text/event-stream,
and the API key is a bearer scheme when one is set."""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from minisgl.server.errors import is_anthropic
from minisgl.server.gates import PUBLIC_PATHS
from minisgl.server.protocol import ErrorResponse

_ERROR_TEXT = {
    400: "Bad request: the error names the field (`param`)",
    401: "Missing or wrong API key",
    404: "Unknown model name",
    413: "The body is over --max-request-bytes",
    500: "Internal error (`type: internal_error`; the server logged it and keeps serving)",
    503: "A server process died: the server is shutting down",
}


# OpenAPI 3.1 reads a text/event-stream schema as that of one event.
_SSE_EVENT = {
    "type": "object",
    "description": "one Server-Sent Event: `data` is a JSON chunk (or an error object), and `[DONE]` last",
    "properties": {"data": {"type": "string"}, "event": {"type": "string"}},
    "required": ["data"],
}


def errors(*codes: int) -> dict[int | str, dict[str, Any]]:
    """FastAPI `responses=` entries for these error statuses (plus the 413 and 500 any route
    can answer)."""
    return {c: {"model": ErrorResponse, "description": _ERROR_TEXT[c]} for c in sorted({*codes, 413, 500})}


def streams(description: str) -> dict[int | str, dict[str, Any]]:
    """A 200 that is JSON, or with `stream: true` Server-Sent Events."""
    return {
        200: {
            "description": description,
            "content": {"text/event-stream": {"schema": _SSE_EVENT}},
        }
    }


def install(app: FastAPI, api_key: bool, version: str, hidden: tuple[str, ...] = ()) -> None:
    """Replaces app.openapi with the generator of the schema described above; `hidden` paths are
    left out (routes this server refuses whatever the body: an embedding server's generate routes)."""

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = get_openapi(
            title="minisgl",
            version=version,
            description="OpenAI-compatible API of minisgl. Every 4xx/5xx body is "
            '`{"error": {"message", "type", "param", "code"}}`.',
            routes=app.routes,
        )
        for path in hidden:
            schema.get("paths", {}).pop(path, None)
        comps = schema.setdefault("components", {})
        for name in ("HTTPValidationError", "ValidationError"):
            comps.get("schemas", {}).pop(name, None)
        if api_key:  # either header: a bearer token, or Anthropic's x-api-key
            comps["securitySchemes"] = {
                "bearer": {"type": "http", "scheme": "bearer"},
                "apiKey": {"type": "apiKey", "in": "header", "name": "x-api-key"},
            }
        for path, ops in schema.get("paths", {}).items():
            shape = "AnthropicErrorResponse" if is_anthropic(path) else "ErrorResponse"
            error_content = {"application/json": {"schema": {"$ref": f"#/components/schemas/{shape}"}}}
            for op in ops.values():
                responses = op.setdefault("responses", {})
                responses.pop("422", None)
                if api_key and path not in PUBLIC_PATHS:
                    op["security"] = [{"bearer": []}, {"apiKey": []}]
                    responses["401"] = {"description": _ERROR_TEXT[401]}
                for code, resp in responses.items():
                    if int(code) >= 400 and path != "/health":  # errors are JSON whatever the route's 200 is
                        resp["content"] = error_content
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
