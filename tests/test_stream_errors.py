"""An error after a stream's status went out is reported in-band, in the route API's own shape
(server/stream.py guarded_stream): OpenAI's data event then [DONE]; Anthropic's `error` event;
the Responses `error` event numbered after the events sent. Internal errors name the request id."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator

import pytest

from minisgl.server.anthropic_render import anthropic_stream
from minisgl.server.errors import ApiError
from minisgl.server.responses_render import responses_stream
from minisgl.server.stream import event_stream


def body(error: Exception) -> AsyncIterator[str]:
    async def gen() -> AsyncIterator[str]:
        yield "first\n\n"
        yield "second\n\n"
        raise error

    return gen()


def collect(resp) -> list[str]:  # noqa: ANN001
    async def run() -> list[str]:
        return [c if isinstance(c, str) else c.decode() async for c in resp.body_iterator]

    return asyncio.run(run())


def data(event: str) -> dict:
    return json.loads(event.split("data: ", 1)[1])


def test_openai_stream_reports_then_done() -> None:
    out = collect(event_stream(body(ApiError("max_tokens: too many", "max_tokens")), "rid-1"))
    assert out[:2] == ["first\n\n", "second\n\n"] and out[-1] == "data: [DONE]\n\n" and len(out) == 4
    assert data(out[2])["error"]["param"] == "max_tokens" and "too many" in data(out[2])["error"]["message"]


def test_anthropic_stream_error_event() -> None:
    out = collect(anthropic_stream(body(RuntimeError("boom")), "rid-2"))
    assert len(out) == 3 and out[2].startswith("event: error\n")
    err = data(out[2])
    assert err["type"] == "error" and set(err["error"]) == {"type", "message"} and "rid-2" in err["error"]["message"]


@pytest.mark.parametrize("error", [ApiError("stop: bad", "stop"), RuntimeError("boom")], ids=["api", "internal"])
def test_responses_stream_error_is_numbered(error: Exception) -> None:
    out = collect(responses_stream(body(error), "rid-3"))
    assert len(out) == 3 and out[2].startswith("event: error\n")
    err = data(out[2])
    assert err["type"] == "error" and err["sequence_number"] == 2  # after events 0 and 1
    if isinstance(error, ApiError):
        assert err["param"] == "stop" and "bad" in err["message"]
    else:
        assert "rid-3" in err["message"]
