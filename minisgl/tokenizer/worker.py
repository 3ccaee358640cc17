"""Tokenizer worker: templates and tokenizes requests, checks them against the context, and
hands them to scheduler rank 0 (or sends the API server a 400-worthy error)."""

from __future__ import annotations

import random
from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl.engine.prompt import check_prompt
from minisgl.engine.sampling_params import SamplingParams
from minisgl.logging_setup import get_logger
from minisgl.message import AbortMsg, DetokInit, ReplyBatch, StartMsg, TokenizeMsg, UserMsg, UserReply
from minisgl.message.zmq_io import pull_socket, push_socket, recv, send
from minisgl.server.child import report_ready

log = get_logger("minisgl.tokenizer")
_SEED_SPACE = 1 << 63


class RequestError(ValueError):
    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def load_server_tokenizer(args: Any) -> Any:
    from minisgl.models.source import resolve_model
    from minisgl.tokenizer.load import load_tokenizer

    return load_tokenizer(resolve_model(args.model), args.chat_template, args.tokenizer)


class TokenizeHandler:
    """Turns TokenizeMsg into UserMsg(s); forwards aborts on the same socket, so an abort can
    never overtake the request it aborts."""

    def __init__(self, tokenizer: Any, to_scheduler: zmq.Socket, to_api: zmq.Socket, seed: int) -> None:
        self.tok = tokenizer
        self.to_scheduler = to_scheduler
        self.to_api = to_api
        # Seeds for requests without one: reproducible per server seed and worker.
        self.rng = random.Random(seed)
        self.max_model_len = 0
        self.vocab_size = 0

    def start(self, start: StartMsg) -> None:
        self.max_model_len = start.max_model_len
        self.vocab_size = start.vocab_size

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortMsg):
            send(self.to_scheduler, msg)
        elif isinstance(msg, TokenizeMsg):
            try:
                for user_msg in self.prepare(msg):
                    send(self.to_scheduler, user_msg)
            except RequestError as e:
                # Every choice (n > 1) gets the error: the API then forgets them all, rather
                # than aborting the others (which would count them as client aborts).
                replies = [UserReply(uid=uid, error=str(e), error_param=e.param) for uid in msg.uids]
                send(self.to_api, ReplyBatch(replies))
        else:
            log.warning("tokenizer: ignoring unexpected %s", type(msg).__name__)

    def prompt_ids(self, msg: TokenizeMsg) -> list[int]:
        if msg.input_ids is not None:
            return list(msg.input_ids)
        if msg.messages is not None:
            return self.tok(self.chat_prompt(msg), add_special_tokens=False).input_ids  # BOS is in the template
        return self.tok(msg.text or "").input_ids

    def chat_prompt(self, msg: TokenizeMsg) -> str:
        kwargs = dict(msg.chat_template_kwargs or {})
        if msg.tools:
            kwargs["tools"] = msg.tools
        try:
            return self.tok.apply_chat_template(msg.messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception as e:  # noqa: BLE001 - jinja raises its own types for bad chats
            raise RequestError(f"messages: the chat template rejected them: {e}", "messages") from e

    def prepare(self, msg: TokenizeMsg) -> list[UserMsg]:
        reasoning_open = False
        sampling = dict(msg.sampling)
        if msg.reasoning and msg.messages is not None:
            from minisgl.tokenizer.reasoning_gate import reasoning_gate

            text = self.chat_prompt(msg)
            try:
                reasoning_open = reasoning_gate(self.tok, msg.reasoning, text, sampling)
            except ValueError as e:
                raise RequestError(str(e), None) from e
            ids = self.tok(text, add_special_tokens=False).input_ids
        else:
            ids = self.prompt_ids(msg)
        field, limit = msg.prompt_field, self.max_model_len
        try:
            check_prompt(ids, limit, self.vocab_size)
        except ValueError as e:
            raise RequestError(f"{field}: {e}", field) from e
        room = limit - len(ids)
        max_tokens = sampling.get("max_tokens")
        if max_tokens is None:
            sampling["max_tokens"] = room
        elif max_tokens > room:
            name = msg.max_tokens_field
            raise RequestError(
                f"{name}: {max_tokens} tokens asked for but the prompt has {len(ids)} tokens "
                f"and the context is {limit}: at most {room} can be generated",
                name,
            )
        try:
            params = SamplingParams(**sampling)
        except (ValueError, TypeError) as e:
            raise RequestError(str(e), str(e).split(" ", 1)[0]) from e
        init = DetokInit(len(ids), params.stop, msg.skip_special_tokens, msg.logprobs, reasoning_open)
        out = []
        for i, uid in enumerate(msg.uids):
            if params.seed is None:
                seed = self.rng.getrandbits(63)
            else:  # choices of one request must differ: offset the seed per choice
                seed = params.seed if i == 0 else (params.seed + i) % _SEED_SPACE
            out.append(UserMsg(uid, ids, {**sampling, "stop": params.stop}, seed, init))
        return out


def run_tokenizer(conn: Connection, args: Any, addrs: Any, index: int) -> None:
    tok = load_server_tokenizer(args)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, addrs.tokenizers[index])
    handler = TokenizeHandler(
        tok, push_socket(ctx, addrs.scheduler), push_socket(ctx, addrs.api), args.seed * 1009 + index
    )
    handler.start(report_ready(conn, f"tokenizer{index}", {"eos_token_id": tok.eos_token_id}))
    while True:
        handler.handle(recv(inbox))
