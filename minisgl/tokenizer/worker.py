"""Tokenizer worker: templates and tokenizes requests, checks them against the context, and
hands them to scheduler rank 0 (or sends the API server a 400-worthy error). Also answers
POST /tokenize and /detokenize.

Small inputs are tokenized inline; inputs over LARGE_INPUT_BYTES in a forked child (see
large_inputs.py), so they never hold up the small ones; text whose length proves it cannot
fit the context is refused before tokenizing (see length_bound.py).
"""

from __future__ import annotations

import random
from typing import Any

import zmq

from minisgl.core.prompt import check_prompt
from minisgl.core.sampling_params import RequestError
from minisgl.logging_setup import get_logger, startup_phase
from minisgl.message import (
    AbortMsg,
    DecodeMsg,
    DetokInit,
    Ready,
    ReplyBatch,
    StartMsg,
    TokenizeMsg,
    UserMsg,
    UserReply,
    trace,
)
from minisgl.message.zmq_io import pull_socket, push_socket, recv_nowait, send
from minisgl.parsers.tool_formats import detect_tool_format
from minisgl.tokenizer.large_inputs import LARGE_INPUT_BYTES, Job, LargeInputs, release_free_memory
from minisgl.tokenizer.length_bound import bytes_per_token_bound, min_tokens
from minisgl.tokenizer.load import hide_torch, load_server_tokenizer
from minisgl.tokenizer.reasoning_gate import reasoning_gate
from minisgl.tokenizer.token_bytes import TokenTable

log = get_logger("minisgl.tokenizer")
_SEED_SPACE = 1 << 63
_REASONING_TAIL_TOKENS = 8


def tokenizer_facts(handler: TokenizeHandler) -> dict[str, Any]:
    """What the launcher learns from a tokenizer process when it reports ready."""
    template = getattr(handler.tok, "chat_template", None)
    return {
        "eos_token_id": handler.tok.eos_token_id,
        "bytes_per_token": handler.bytes_per_token,
        "tool_format": detect_tool_format(template if isinstance(template, str) else None),
    }


class TokenizeHandler:
    """Turns TokenizeMsg into UserMsg(s); forwards aborts on the same socket, so an abort can
    never overtake the request it aborts (one whose input is still being tokenized in a
    child is dropped here instead)."""

    def __init__(
        self, tokenizer: Any, to_scheduler: zmq.Socket, to_api: zmq.Socket, seed: int, table: TokenTable | None = None
    ) -> None:
        self.tok = tokenizer
        self.table = table or TokenTable(tokenizer)
        self.to_scheduler = to_scheduler
        self.to_api = to_api
        # Seeds for requests without one: reproducible per server seed and worker.
        self.rng = random.Random(seed)
        self.max_model_len = 0
        self.vocab_size = 0
        self.bytes_per_token = bytes_per_token_bound(self.table.spec, self.table.max_token_bytes())
        self.large = LargeInputs(tokenizer, self._large_done)
        self.pending: dict[int, TokenizeMsg] = {}  # uid -> request being tokenized in a child

    def start(self, start: StartMsg) -> None:
        self.max_model_len = start.max_model_len
        self.vocab_size = start.vocab_size

    def handle(self, msg: Any) -> None:
        if isinstance(msg, AbortMsg):
            pending = self.pending.get(msg.uid)
            if pending is None:
                send(self.to_scheduler, msg)
            elif self.large.cancel(pending):  # the scheduler never saw it
                for uid in pending.uids:
                    self.pending.pop(uid, None)
        elif isinstance(msg, TokenizeMsg):
            trace.stamp(msg.trace, "tok_in")
            chars = len(msg.text or "") + sum(len(str(m.get("content") or "")) for m in msg.messages or [])
            large = chars > LARGE_INPUT_BYTES
            try:
                self.submit(msg)
            except RequestError as e:
                self.refuse(msg, e)
            if large:  # refused, or handed to a child: its text is garbage now
                release_free_memory()
        elif isinstance(msg, DecodeMsg):
            reply = UserReply(msg.uid, text=self.tok.decode(msg.token_ids), finish_reason="stop")
            send(self.to_api, ReplyBatch([reply]))
        else:
            log.warning("tokenizer: ignoring unexpected %s", type(msg).__name__)

    def refuse(self, msg: TokenizeMsg, e: RequestError) -> None:
        # Every choice (n > 1) gets the error: the API then forgets them all, rather than
        # aborting the others (which would count them as client aborts).
        send(self.to_api, ReplyBatch([UserReply(uid=uid, error=str(e), error_param=e.param) for uid in msg.uids]))

    def prompt_text(self, msg: TokenizeMsg) -> str:
        if msg.messages is None:
            return msg.text or ""
        kwargs = dict(msg.chat_template_kwargs or {})  # names the template reserves: refused by the API
        if msg.tools:
            kwargs["tools"] = msg.tools
        try:
            return self.tok.apply_chat_template(
                msg.messages, tokenize=False, add_generation_prompt=msg.add_generation_prompt, **kwargs
            )
        except Exception as e:  # noqa: BLE001 - jinja raises its own types for bad chats
            raise RequestError(f"prompt: the chat template rejected the messages: {e}", "prompt") from e

    def _add_special(self, msg: TokenizeMsg) -> bool:
        # A template already holds BOS and the like.
        return msg.add_special_tokens if msg.add_special_tokens is not None else msg.messages is None

    def submit(self, msg: TokenizeMsg) -> None:
        if msg.input_ids is not None:
            self.finish(msg, list(msg.input_ids))
            return
        text = self.prompt_text(msg)
        size = len(text.encode())
        least = min_tokens(size, self.bytes_per_token)
        if msg.mode == "generate" and least >= self.max_model_len:
            raise RequestError(
                f"prompt: its {size} bytes are at least {least} tokens (at most {self.bytes_per_token:g} bytes "
                f"per token for this tokenizer), but the context is {self.max_model_len} tokens",
                "prompt",
            )
        if size <= LARGE_INPUT_BYTES:
            self.finish(msg, self.tok(text, add_special_tokens=self._add_special(msg)).input_ids)
            return
        keep = self.max_model_len if msg.mode == "generate" else 1 << 62
        job = Job(msg, text, self._add_special(msg), keep)
        msg.text = msg.messages = None  # the child holds the text; do not keep a copy here
        del text
        for uid in msg.uids:
            self.pending[uid] = msg
        self.large.submit(job)

    def _large_done(self, msg: TokenizeMsg, result: list[int] | int | None) -> None:
        for uid in msg.uids:
            self.pending.pop(uid, None)
        try:
            if result is None:
                raise RequestError("prompt: tokenizing it failed (too large for this server's memory?)", "prompt")
            if isinstance(result, int):  # only the count came back: it cannot fit
                raise RequestError(
                    f"prompt: prompt has {result} tokens but the context is {self.max_model_len} tokens", "prompt"
                )
            self.finish(msg, result)
        except RequestError as e:
            self.refuse(msg, e)

    def finish(self, msg: TokenizeMsg, ids: list[int]) -> None:
        if msg.mode == "tokenize":
            reply = UserReply(msg.uids[0], token_ids=ids, prompt_tokens=len(ids), finish_reason="stop")
            if msg.return_prompt:
                reply.token_texts = [self.table.text_of(t) for t in ids]
            send(self.to_api, ReplyBatch([reply]))
            return
        for user_msg in self.prepare(msg, ids):
            send(self.to_scheduler, user_msg)

    def prompt_ids(self, msg: TokenizeMsg) -> list[int]:
        if msg.input_ids is not None:
            return list(msg.input_ids)
        return self.tok(self.prompt_text(msg), add_special_tokens=self._add_special(msg)).input_ids

    def prepare(self, msg: TokenizeMsg, ids: list[int] | None = None) -> list[UserMsg]:
        """The scheduler's messages for a request (tokenized inline when `ids` is None)."""
        ids = self.prompt_ids(msg) if ids is None else ids
        limit = self.max_model_len
        embedding = msg.pooling is not None  # it generates nothing: its prompt may fill the context
        try:
            check_prompt(ids, limit, self.vocab_size, generates=not embedding)
        except ValueError as e:
            raise RequestError(f"prompt: {e}", "prompt") from e
        # The API process validated the sampling fields (decoding does not rerun it): what is
        # left to check here is what needs the prompt's length.
        params = msg.sampling
        room = limit - len(ids)
        if not embedding and params.max_tokens is not None and params.max_tokens > room:
            raise RequestError(
                f"max_tokens: {params.max_tokens} tokens asked for but the prompt has {len(ids)} tokens "
                f"and the context is {limit}: at most {room} can be generated",
                "max_tokens",
            )
        try:
            params.resolve_max_tokens(room)
        except ValueError as e:
            raise RequestError(str(e), "min_tokens") from e
        reasoning_open = False
        if msg.reasoning and msg.messages is not None:
            # The gate reads the prompt's end only: a few tokens hold any block marker.
            tail = self.tok.decode(ids[-_REASONING_TAIL_TOKENS:])
            try:
                reasoning_open = reasoning_gate(self.tok, msg.reasoning, tail, params)
            except ValueError as e:
                raise RequestError(str(e), None) from e
        echo = msg.return_prompt or params.prompt_logprobs is not None
        init = DetokInit(
            len(ids),
            params.stop,
            msg.skip_special_tokens,
            msg.logprobs,
            msg.spaces_between_special_tokens,
            msg.include_stop_str,
            params.top_logprobs,
            list(ids) if echo else None,
            params.prompt_logprobs is not None,
            reasoning_open,
        )
        out = []
        trace.stamp(msg.trace, "tok_out")
        for i, uid in enumerate(msg.uids):
            if params.seed is None:
                seed = self.rng.getrandbits(63)
            else:  # choices of one request must differ: offset the seed per choice
                seed = params.seed if i == 0 else (params.seed + i) % _SEED_SPACE
            hops = None if msg.trace is None else dict(msg.trace)
            out.append(UserMsg(uid, ids, params, seed, init, hops, admit_by=msg.admit_by, pooling=msg.pooling))
        return out


def wait_inbox(inbox: zmq.Socket, handler: TokenizeHandler) -> None:
    """Blocks until `inbox` has a message, finishing large-input jobs meanwhile."""
    while True:
        poller = zmq.Poller()
        poller.register(inbox, zmq.POLLIN)
        for fd in handler.large.fds:
            poller.register(fd, zmq.POLLIN)
        events = dict(poller.poll())
        handler.large.poll([fd for fd in events if isinstance(fd, int)])
        if inbox in events:
            return


def run_tokenizer(ready: Ready, args: Any, addrs: Any, index: int) -> None:
    hide_torch()  # this process only tokenizes: transformers must not load torch (see there)
    with startup_phase(f"tokenizer{index}: tokenizer loaded"):
        tok = load_server_tokenizer(args)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, addrs.tokenizers[index])
    handler = TokenizeHandler(
        tok, push_socket(ctx, addrs.scheduler), push_socket(ctx, addrs.api), args.seed * 1009 + index
    )
    handler.start(ready(tokenizer_facts(handler)))
    while True:
        wait_inbox(inbox, handler)
        while (m := recv_nowait(inbox)) is not None:
            handler.handle(m)
