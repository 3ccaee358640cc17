"""Anthropic's Messages API: POST /v1/messages (whole or streamed) and /v1/messages/count_tokens,
wired through the chat stages (anthropic_build.py translates, anthropic_render.py answers).
Errors under these paths are Anthropic's error object (errors.py); the API key may come as
`x-api-key` (gates.py).

No `from __future__ import annotations`: FastAPI reads the route annotations as objects.
"""

from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl.message import TokenizeMsg
from minisgl.server import openapi_doc
from minisgl.server.anthropic_build import NAMES, chat_body
from minisgl.server.anthropic_protocol import AnthropicErrorResponse, AnthropicProtocol
from minisgl.server.anthropic_render import anthropic_stream, message, message_events
from minisgl.server.stages import Stages


def add_anthropic_routes(app: FastAPI, stages: Stages, protocol: AnthropicProtocol) -> None:
    errors = {c: {**r, "model": AnthropicErrorResponse} for c, r in openapi_doc.errors(400, 404, 503).items()}
    streams = openapi_doc.streams(
        "An Anthropic message, or with stream: true its events (message_start, "
        "content_block_start / _delta / _stop, message_delta, message_stop, ping)"
    )

    @app.post("/v1/messages", responses={**streams, **errors})
    async def messages(req: protocol.messages, request: Request) -> Response:  # type: ignore[valid-type]
        """Anthropic's Messages API over the served model's chat template."""
        stages.builder.check_model(req.model)
        job = stages.chat_job(chat_body(req), NAMES)
        replies, tracker, rid = await stages.start(job, request)
        if job.stream:
            return anthropic_stream(message_events(job, replies, tracker, stages.model_name), rid)
        return JSONResponse(await message(job, replies, tracker, stages.model_name))

    @app.post("/v1/messages/count_tokens", responses=errors)
    async def count_tokens(req: protocol.count_tokens, request: Request) -> dict[str, Any]:  # type: ignore[valid-type]
        """`{input_tokens}`: the prompt a Messages request with these fields would take."""
        stages.builder.check_model(req.model)
        msg = stages.chat_job(chat_body(req, max_tokens=1), NAMES).msgs[0]
        tok = TokenizeMsg(
            [0], messages=msg.messages, tools=msg.tools, chat_template_kwargs=msg.chat_template_kwargs, mode="tokenize"
        )
        reply = await stages.tokenize(tok, {"prompt": "messages"}, request)
        return {"input_tokens": len(reply.token_ids)}
