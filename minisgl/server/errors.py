"""The one error type of the API layer and its wire shapes.

Every 4xx/5xx the server sends is `{"error": {"message", "type", "param", "code"}}`, whichever
layer refused: validation, the ASGI gates (auth, body size), the tokenizer or the scheduler;
under /v1/messages (Anthropic's API) it is Anthropic's `{"type": "error", "error": {"type",
"message"}}` instead, chosen by the path wherever the error is sent.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse


class ApiError(Exception):
    def __init__(
        self,
        message: str,
        param: str | None = None,
        status: int = 400,
        code: str | None = None,
        kind: str = "invalid_request_error",
    ) -> None:
        super().__init__(message)
        self.message, self.param, self.status, self.code, self.kind = message, param, status, code, kind

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}

    def anthropic_body(self) -> dict[str, Any]:
        kind = ANTHROPIC_ERROR_TYPES.get(self.status, "api_error" if self.status >= 500 else "invalid_request_error")
        return {"type": "error", "error": {"type": kind, "message": self.message}}

    def response(self, headers: dict[str, str] | None = None, path: str | None = None) -> JSONResponse:
        """The error as the route at `path` speaks (OpenAI's shape unless it is Anthropic's)."""
        body = self.anthropic_body() if is_anthropic(path) else self.body()
        return JSONResponse(body, status_code=self.status, headers=headers)


ANTHROPIC_PREFIX = "/v1/messages"  # /v1/messages and /v1/messages/count_tokens
ANTHROPIC_ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    500: "api_error",
    503: "overloaded_error",
}


def is_anthropic(path: str | None) -> bool:
    return path is not None and (path == ANTHROPIC_PREFIX or path.startswith(ANTHROPIC_PREFIX + "/"))


def internal_error(request_id: str) -> ApiError:
    return ApiError(
        f"internal server error (request id {request_id}); the server logged the details and keeps serving",
        None,
        500,
        kind="internal_error",
    )


def _is_type_tag(part: Any) -> bool:
    # pydantic names union members in error locations ("str", "list[TextPart]",
    # "function-after[...]"); they are not fields.
    # dict keys (logit_bias's token ids) are kept.
    return isinstance(part, str) and (part in ("str", "int", "float", "bool") or "[" in part or "-" in part)


def param_of(loc: tuple[Any, ...]) -> str | None:
    """("body", "messages", 0, "role") -> "messages[0].role"."""
    out = ""
    for part in loc[1:] if loc and loc[0] == "body" else loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif not _is_type_tag(part):
            out += f".{part}" if out else str(part)
    return out or None


def from_validation(errors: list[dict[str, Any]]) -> ApiError:
    """The 400 of a body that failed validation, naming the most specific field at fault."""
    # Deepest: a union's real culprit; of equals, one that is not "wrong type" (the member whose
    # type matched says what is wrong with the value).
    err = max(errors, key=lambda e: (len(e.get("loc", ())), not str(e.get("type", "")).endswith("_type")))
    kind, msg = err.get("type"), str(err.get("msg", "")).removeprefix("Value error, ")
    if kind == "json_invalid":
        return ApiError(f"the request body is not valid JSON: {err.get('ctx', {}).get('error', '')}")
    param = param_of(tuple(err.get("loc", ())))
    if param is None:
        if kind == "missing":
            return ApiError("the request body is missing: send a JSON object (Content-Type: application/json)")
        if kind in ("model_attributes_type", "dict_type", "model_type"):
            return ApiError(f"the request body must be a JSON object (Content-Type: application/json): {msg}")
        return ApiError(msg)
    if kind == "extra_forbidden":
        return ApiError(
            f"{param}: unknown field; the server refuses fields it does not implement rather than ignore them",
            param,
        )
    return ApiError(f"{param}: {msg}", param)
