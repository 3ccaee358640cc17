"""The API process alone: the real app and Frontend, with the tokenizer/scheduler/detokenizer
replaced by a scripted stand-in that answers each message at once. Tests of the HTTP
contract (errors, schema, response shapes) run in-process through it, in milliseconds."""

from __future__ import annotations

from typing import Any

from fastapi.testclient import TestClient

from minisgl.core.grammar_fields import grammar_spec
from minisgl.message import DecodeMsg, PromptEcho, TokenizeMsg, UserReply, decode
from minisgl.message.addresses import Addresses
from minisgl.server.api import ServerInfo, build_app
from minisgl.server.chat_request import ChatFeatures
from minisgl.server.frontend import Frontend
from minisgl.server.metrics import Metrics
from minisgl.server.protocol_types import Limits

VOCAB, CONTEXT = 1000, 64
SAY = "say:"  # a last message "say:TEXT" makes the stand-in output TEXT (tool calls, reasoning)
OPEN = "</think>"  # ... and when TEXT holds this, the reply says the prompt opened a think block
REJECT = "REJECT"  # a grammar holding this does not compile (the scheduler's error, engine field named)
OUTPUT = [10, 11, 12]  # every generation: these tokens, then "length"
TEXTS = {10: "ab", 11: "\ufffd", 12: "c"}
BYTES = {10: b"ab", 11: b"\xe2\x82", 12: b"c"}  # a partial character in the middle


def alts(k: int, base: int = 100) -> list[list]:
    return [[base + j, f"t{base + j}", -1.0 - j, f"t{base + j}".encode()] for j in range(k)]


class ScriptedBackend:
    """Stands in for the push sockets of the Frontend: decodes what the API sends and
    dispatches the replies a real backend would (synchronously)."""

    def __init__(self, frontend: Frontend) -> None:
        self.frontend = frontend
        self.seen: list[Any] = []

    def send(self, data: bytes, *_: Any) -> None:
        msg = decode(data)
        self.seen.append(msg)
        for reply in self.answer(msg):
            self.frontend._dispatch(reply)

    def answer(self, msg: Any) -> list[UserReply]:
        if isinstance(msg, DecodeMsg):
            return [UserReply(msg.uid, text="".join(TEXTS.get(t, "?") for t in msg.token_ids), finish_reason="stop")]
        if not isinstance(msg, TokenizeMsg):
            return []  # aborts
        text = msg.text or (msg.messages and msg.messages[-1]["content"]) or ""
        if text == "boom":
            raise RuntimeError("a bug in the backend stand-in")
        if text == "refuse":
            return [UserReply(u, error="prompt: refused by the worker", error_param="prompt") for u in msg.uids]
        spec = grammar_spec(msg.sampling)
        if spec is not None and REJECT in spec.text:  # as the scheduler's grammar compiler refuses one
            error = f"{spec.kind}: invalid (the stand-in rejects it)"
            return [UserReply(u, error=error, error_param=spec.kind) for u in msg.uids]
        prompt = list(msg.input_ids or [7, 8])
        if msg.mode == "tokenize":
            return [UserReply(msg.uids[0], token_ids=prompt, prompt_tokens=len(prompt), finish_reason="stop",
                              token_texts=["p"] * len(prompt) if msg.return_prompt else None)]
        if text.startswith(SAY):  # the output is the rest (up to a stop string), in three pieces, then "stop"
            said = text[len(SAY):]
            matched = min((s for s in msg.sampling.stop or [] if s in said), key=said.index, default=None)
            said = said[: said.index(matched)] if matched else said
            cuts = [0, len(said) // 3, 2 * len(said) // 3, len(said)]
            return [UserReply(uid, said[a:b], [10], prompt_tokens=2, completion_tokens=i + 1,
                              finish_reason="stop" if i == 2 else None, reasoning_open=i == 0 and OPEN in said,
                              matched_stop=matched if i == 2 else None)
                    for uid in msg.uids for i, (a, b) in enumerate(zip(cuts, cuts[1:]))]
        k = msg.sampling.top_logprobs
        pk = msg.sampling.prompt_logprobs
        out = []
        for uid in msg.uids:
            for i, t in enumerate(OUTPUT):
                r = UserReply(uid, TEXTS[t], [t], prompt_tokens=len(prompt), completion_tokens=i + 1)
                if msg.logprobs:
                    r.logprobs, r.token_texts, r.token_bytes = [-0.5 * (i + 1)], [TEXTS[t]], [BYTES[t]]
                    r.top_logprobs = [alts(k)] if k else None
                if i == 0 and msg.return_prompt:
                    lps = None if pk is None else [None] + [[-2.0, alts(pk, 200)] for _ in prompt[1:]]
                    r.prompt = PromptEcho("PROMPT", prompt, ["P"] * len(prompt), [b"P"] * len(prompt), lps)
                if i == len(OUTPUT) - 1:
                    r.finish_reason = "length"
                out.append(r)
        return out


def make_client(
    api_key: str | None = None, defaults: dict[str, Any] | None = None, features: ChatFeatures | None = None
) -> tuple[TestClient, Any]:
    frontend = Frontend(Addresses("ipc://unused", "ipc://unused", "ipc://unused", ["ipc://unused"]), 1, Metrics())
    backend = ScriptedBackend(frontend)
    frontend._push = [backend]
    info = ServerInfo("tiny", Limits(VOCAB, CONTEXT), defaults or {}, 4096, api_key,
                      features=features or ChatFeatures())
    # The client must not raise the app's exceptions: the point is what the server answers.
    return TestClient(build_app(frontend, info), raise_server_exceptions=False), backend
