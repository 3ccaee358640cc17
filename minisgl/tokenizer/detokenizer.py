"""Detokenizer: incremental, UTF-8-safe text deltas with stop strings, per request.

Text is decoded over a sliding window of tokens (as vLLM and SGLang do): `decode(ids[p:])`
minus `decode(ids[p:r])`, where ids[p:r] last decoded cleanly. A window whose text ends in
U+FFFD holds a character still split across tokens, so it is held until the rest arrives.
Stop strings are searched in the decoded text; while the text ends with the beginning of
a stop string, that tail is held back, so a stop string is never partly sent. At finish,
the whole output is decoded once more and everything not yet sent is sent: nothing is held.
"""

from __future__ import annotations

from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl.logging_setup import get_logger
from minisgl.message import AbortMsg, DetokenizeMsg, DetokInit, ReplyBatch, TokenizeMsg, TokenOut, UserReply
from minisgl.message.zmq_io import pull_socket, push_socket, recv, recv_nowait, send
from minisgl.server.child import report_ready
from minisgl.tokenizer.worker import TokenizeHandler, load_server_tokenizer

log = get_logger("minisgl.detokenizer")
_REPLACEMENT = "\ufffd"


class DecodeState:
    def __init__(self, tokenizer: Any, init: DetokInit) -> None:
        self.tok = tokenizer
        self.init = init
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (complete characters only until finish)
        self.sent = 0  # characters of `text` already sent
        self.searched = 0  # characters of `text` already searched for stop strings
        self.stops = init.stop or []
        self.max_stop = max((len(s) for s in self.stops), default=0)

    def _decode(self, ids: list[int]) -> str:
        return self.tok.decode(ids, skip_special_tokens=self.init.skip_special_tokens)

    def add(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(_REPLACEMENT):
            self.text += window[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def find_stop(self) -> int | None:
        """Index in `text` where the first stop string starts, if one is complete now."""
        if not self.stops:
            return None
        # A match must end in the part not yet searched (earlier ones were found then).
        start = max(0, self.searched - self.max_stop + 1)
        self.searched = len(self.text)
        hits = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        return min(hits) if hits else None

    def finalize(self) -> None:
        """The request ended: decode everything, including a trailing partial character."""
        full = self._decode(self.ids)
        if full.startswith(self.text[: self.sent]):
            self.text = full  # the offline LLM's text exactly
        else:  # window and full decode disagree: finish the client's version instead
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.searched = min(self.searched, self.sent)

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        for k in range(min(self.max_stop - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta


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
    tokenizer.start(report_ready(conn, "detokenizer", {"eos_token_id": tok.eos_token_id}))
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
