"""What every route module needs of one server: its chat request model, the builder (second
stage), and the frontend (third), with the two ways a route submits work: `start` a generation
(awaiting its first reply, so that a refusal is the route's 4xx before any byte is sent), or
`tokenize` a prompt. api.py wires OpenAI's and SGLang's routes through it; the Anthropic and
Responses routes (anthropic_api.py, responses_api.py) and embeddings (embeddings.py) too."""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from minisgl.message import DecodeMsg, TokenizeMsg, UserReply
from minisgl.server.build import Builder, Job
from minisgl.server.errors import ApiError, from_validation
from minisgl.server.frontend import Frontend
from minisgl.server.render import ChoiceTracker


@dataclass
class Stages:
    frontend: Frontend
    builder: Builder
    chat_model: Any  # the server's ChatCompletionRequest model (protocol.py)

    @property
    def model_name(self) -> str:
        return self.builder.model_name

    def chat_job(self, body: dict[str, Any], names: dict[str, str]) -> Job:
        """The chat job a body of another API translates to. Its errors (and the later hops') name
        chat fields, which `names` maps back to the other API's."""
        from pydantic import ValidationError

        try:
            req = self.chat_model.model_validate(body)
            job = self.builder.chat(req)
        except ValidationError as e:
            raise _renamed(from_validation([{**err, "loc": ("body", *err["loc"])} for err in e.errors()]), names) from e
        except ApiError as e:
            raise _renamed(e, names) from e
        job.names = {engine: names.get(ours, ours) for engine, ours in job.names.items()}
        return job

    async def start(self, job: Job, request: Any) -> tuple[AsyncIterator[UserReply], ChoiceTracker, str]:
        """Submits `job` and waits for its first reply; returns its replies (from the first), their
        tracker and the request id. Streams learn of a gone client from Starlette cancelling
        them; whole answers poll for it."""
        state = request.scope["state"]
        handle = self.frontend.submit(job.msgs, job.names, received=state.get("received"))  # type: ignore[arg-type]
        first = await self.frontend.first_reply(handle, request)
        rid = state["request_id"]
        if first.trace is not None:  # RequestGuard logs it once the first chunk is written
            state["trace"] = (
                first.trace,
                {
                    "rid": rid,
                    "uid": first.uid,
                    "route": request.url.path,
                    "prompt": first.prompt_tokens,
                    "stream": job.stream,
                },
            )
        tracker = ChoiceTracker(handle.uids, job.n)
        return self.frontend.replies(handle, first, None if job.stream else request), tracker, rid

    async def tokenize(self, msg: TokenizeMsg | DecodeMsg, names: dict[str, str], request: Any) -> UserReply:
        """The prompt's token ids (a `mode="tokenize"` message), or ids' text (a DecodeMsg): one
        reply, unmetered."""
        handle = self.frontend.submit([msg], names, metered=False)
        return await self.frontend.first_reply(handle, request)


def _renamed(err: ApiError, names: dict[str, str]) -> ApiError:
    """`err` with its field (and the message's leading field name) in the other API's words."""
    if err.param is None:
        return err
    head = err.param.split(".", 1)[0].split("[", 1)[0]
    if head not in names:
        return err
    param = names[head] + err.param[len(head) :]
    message = param + err.message[len(err.param) :] if err.message.startswith(err.param) else err.message
    return ApiError(message, param, err.status, err.code, err.kind)
