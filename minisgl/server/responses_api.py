"""OpenAI's Responses API: POST /v1/responses (whole or streamed), stateless, wired through the
chat stages (responses_build.py translates, responses_render.py answers). Its errors are the
OpenAI error object, as on every other OpenAI route.

No `from __future__ import annotations`: FastAPI reads the route annotations as objects.
"""

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from minisgl.server import openapi_doc
from minisgl.server.responses_build import NAMES, chat_body
from minisgl.server.responses_protocol import ResponsesProtocol
from minisgl.server.responses_render import respond, response_events, responses_stream
from minisgl.server.stages import Stages


def add_responses_routes(app: FastAPI, stages: Stages, protocol: ResponsesProtocol) -> None:
    streams = openapi_doc.streams(
        "A response, or with stream: true its events (response.created, "
        "response.output_item.added, response.output_text.delta, ..., response.completed)"
    )

    @app.post("/v1/responses", responses={**streams, **openapi_doc.errors(400, 404, 503)})
    async def responses(req: protocol.responses, request: Request) -> Response:  # type: ignore[valid-type]
        """OpenAI's Responses API over the served model's chat template (stateless)."""
        stages.builder.check_model(req.model)
        job = stages.chat_job(chat_body(req), NAMES)
        tools = [t.model_dump(exclude_none=True) for t in req.tools or []]
        replies, tracker, rid = await stages.start(job, request)
        if job.stream:
            return responses_stream(response_events(job, req, replies, tracker, stages.model_name, tools), rid)
        return JSONResponse(await respond(job, req, replies, tracker, stages.model_name, tools))
