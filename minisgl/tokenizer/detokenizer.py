"""The detokenizer process: token ids in, text deltas out (per request DecodeState, see
minisgl/tokenizer/incremental.py); stop strings it finds abort the request at the scheduler."""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl.logging_setup import get_logger
from minisgl.message import AbortMsg, DetokenizeMsg, ReplyBatch, TokenizeMsg, TokenOut, UserReply
from minisgl.message.zmq_io import pull_socket, push_socket, recv, recv_nowait, send
from minisgl.server.child import report_ready
from minisgl.tokenizer.incremental import DecodeState
from minisgl.tokenizer.worker import TokenizeHandler, load_server_tokenizer

log = get_logger("minisgl.detokenizer")


class Detokenizer:
    """Socket-free core: DetokenizeMsg in, UserReplies out, plus uids whose stop string was
    found while the scheduler still runs them (the caller aborts those)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tok = tokenizer
        self.states: dict[int, DecodeState] = {}

    def process(self, msg: DetokenizeMsg) -> tuple[list[UserReply], list[int]]:
        replies, stopped = [], []
        for item in msg.items:
            reply = self._one(item, stopped)
            if reply is not None:
                replies.append(reply)
        return replies, stopped

    def _one(self, item: TokenOut, stopped: list[int]) -> UserReply | None:
        if item.finish_reason == "abort":  # the client left: drop the state, reply to no one
            self.states.pop(item.uid, None)
            return None
        st = self.states.get(item.uid)
        if st is None:
            if item.init is None:
                return None  # tokens the scheduler made before it saw our stop: dropped
            st = self.states[item.uid] = DecodeState(self.tok, item.init)
        st.add(item.token_ids)
        reason = None
        cut = st.find_stop()
        if cut is None and item.finish_reason is not None:
            st.finalize()
            cut = st.find_stop()
            reason = item.finish_reason
        if cut is not None:
            st.text = st.text[:cut]
            reason = "stop"
            if item.finish_reason is None:
                stopped.append(item.uid)
        reply = UserReply(
            uid=item.uid,
            text=st.take(final=reason is not None),
            token_ids=list(item.token_ids),
            finish_reason=reason,
            prompt_tokens=st.init.prompt_tokens,
            completion_tokens=len(st.ids),
            reasoning_open=st.init.reasoning_open,
        )
        if st.init.logprobs:
            reply.logprobs = list(item.logprobs or [])
            reply.token_texts = [self.tok.decode([t]) for t in item.token_ids]
        if reason is not None:
            del self.states[item.uid]
        return reply


def run_detokenizer(conn: Connection, args: Any, addrs: Any) -> None:
    tok = load_server_tokenizer(args)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, addrs.detokenizer)
    to_api, to_scheduler = push_socket(ctx, addrs.api), push_socket(ctx, addrs.scheduler)
    detok = Detokenizer(tok)
    # With no tokenizer workers, requests and aborts come here too (DESIGN: --num-tokenizers 0).
    tokenizer = TokenizeHandler(tok, to_scheduler, to_api, args.seed * 1009 + 1000)
    from minisgl.parsers.tool_formats import detect_tool_format

    info = {"eos_token_id": tok.eos_token_id, "tool_format": detect_tool_format(getattr(tok, "chat_template", None))}
    tokenizer.start(report_ready(conn, "detokenizer", info))
    while True:
        msgs = [recv(inbox)]
        while (m := recv_nowait(inbox)) is not None:  # one reply batch for all that is ready
            msgs.append(m)
        replies: list[UserReply] = []
        for m in msgs:
            if isinstance(m, DetokenizeMsg):
                out, stopped = detok.process(m)
                replies.extend(out)
                for uid in stopped:
                    send(to_scheduler, AbortMsg(uid, "stop"))
            elif isinstance(m, (TokenizeMsg, AbortMsg)):
                tokenizer.handle(m)
            else:
                log.warning("detokenizer: ignoring unexpected %s", type(m).__name__)
        if replies:
            send(to_api, ReplyBatch(replies))
