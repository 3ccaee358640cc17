"""The detokenizer process: token ids in, text deltas out (per request DecodeState, see
minisgl/tokenizer/incremental.py); stop strings it finds abort the request at the scheduler.
Logprobs leave here as text and bytes (tokenizer/token_bytes.py): the API renders them."""

from __future__ import annotations

from typing import Any

import zmq

from minisgl.logging_setup import get_logger, startup_phase
from minisgl.message import (
    AbortMsg,
    DecodeMsg,
    DetokenizeMsg,
    PromptEcho,
    Ready,
    ReplyBatch,
    TokenizeMsg,
    TokenOut,
    UserReply,
    trace,
)
from minisgl.message.zmq_io import pull_socket, push_socket, recv_nowait, send
from minisgl.tokenizer.incremental import DecodeState
from minisgl.tokenizer.load import hide_torch, load_server_tokenizer
from minisgl.tokenizer.token_bytes import TokenTable
from minisgl.tokenizer.worker import TokenizeHandler, tokenizer_facts, wait_inbox

log = get_logger("minisgl.detokenizer")


class Detokenizer:
    """Socket-free core: DetokenizeMsg in, UserReplies out, plus (uid, output tokens to keep)
    of requests whose stop string was found while the scheduler still runs them (the caller
    aborts those; a speculative step may have brought tokens past the stop: they are dropped)."""

    def __init__(self, tokenizer: Any, table: TokenTable | None = None) -> None:
        self.tok = tokenizer
        self.table = table or TokenTable(tokenizer)
        self.states: dict[int, DecodeState] = {}
        self.received: float | None = None  # when the message being processed came in (tracing)

    def process(self, msg: DetokenizeMsg) -> tuple[list[UserReply], list[tuple[int, int]]]:
        replies, stopped = [], []
        self.received = trace.now() if trace.ENABLED else None
        for item in msg.items:
            reply = self._one(item, stopped)
            if reply is not None:
                replies.append(reply)
        return replies, stopped

    def alternatives(self, pairs: list[list]) -> list[list]:
        """[[id, logprob], ...] -> [[id, text, logprob, bytes], ...]."""
        return [[t, self.table.text_of(t), lp, self.table.bytes_of(t)] for t, lp in pairs]

    def _one(self, item: TokenOut, stopped: list[tuple[int, int]]) -> UserReply | None:
        if item.finish_reason == "abort":  # the client left: drop the state, reply to no one
            self.states.pop(item.uid, None)
            return None
        st = self.states.get(item.uid)
        first = st is None
        if st is None:
            if item.init is None:
                return None  # tokens the scheduler made before it saw our stop: dropped
            st = self.states[item.uid] = DecodeState(self.tok, item.init)
        init = st.init
        ids = list(item.token_ids)
        # The scheduler's "stop" is an EOS or stop_token_ids token, the last one: its text is
        # not output unless asked (vLLM's rule); it still counts as a completion token.
        stop_token = item.finish_reason == "stop" and bool(ids) and not init.include_stop_str
        before = len(st.ids)
        cut = st.add_until_stop(ids[:-1] if stop_token else ids)
        if cut is not None:  # a stop string inside a multi-token step: the tokens after it are dropped
            ids, stop_token = ids[: len(st.ids) - before], False
        reason = None
        if cut is None and item.finish_reason is not None:
            st.finalize()
            cut = st.find_stop()
            reason = item.finish_reason
        matched = None
        if cut is not None:
            matched = st.text[cut : st.stop_end]
            st.text = st.text[: st.stop_end if init.include_stop_str else cut]
            reason = "stop"
            if item.finish_reason is None:  # a finished request is already gone from the scheduler
                stopped.append((item.uid, len(st.ids)))
        reply = UserReply(
            uid=item.uid,
            text=st.take(final=reason is not None),
            token_ids=ids,
            finish_reason=reason,
            prompt_tokens=init.prompt_tokens,
            cached_tokens=init.cached_tokens,
            completion_tokens=len(st.ids) + stop_token,
            reasoning_open=first and init.reasoning_open,
            matched_stop=matched,
        )
        if init.logprobs:
            reply.logprobs = list(item.logprobs or [])[: len(ids)]
            reply.token_texts = [self.table.text_of(t) for t in ids]
            reply.token_bytes = [self.table.bytes_of(t) for t in ids]
            if init.top_logprobs:
                reply.top_logprobs = [self.alternatives(alts) for alts in (item.top_logprobs or [])[: len(ids)]]
        if item.trace is not None:
            reply.trace = item.trace
            trace.stamp(reply.trace, "detok_in", self.received)
        if first and init.prompt_ids is not None:
            reply.prompt = self.echo(init.prompt_ids, item.prompt_logprobs if init.prompt_logprobs else None)
        if reason is not None:
            del self.states[item.uid]
        return reply

    def echo(self, ids: list[int], logprobs: list | None) -> PromptEcho:
        rendered = None
        if logprobs is not None:
            rendered = [None if e is None else [e[0], self.alternatives(e[1])] for e in logprobs]
        return PromptEcho(
            self.tok.decode(ids),
            list(ids),
            [self.table.text_of(t) for t in ids],
            [self.table.bytes_of(t) for t in ids],
            rendered,
        )


def run_detokenizer(ready: Ready, args: Any, addrs: Any) -> None:
    hide_torch()  # this process only tokenizes: transformers must not load torch (see there)
    with startup_phase("detokenizer: tokenizer loaded"):
        tok = load_server_tokenizer(args)
    table = TokenTable(tok)
    ctx = zmq.Context()
    inbox = pull_socket(ctx, addrs.detokenizer)
    to_api, to_scheduler = push_socket(ctx, addrs.api), push_socket(ctx, addrs.scheduler)
    detok = Detokenizer(tok, table)
    # With no tokenizer workers, requests and aborts come here too (DESIGN: --num-tokenizers 0).
    tokenizer = TokenizeHandler(tok, to_scheduler, to_api, args.seed * 1009 + 1000, table)
    tokenizer.start(ready(tokenizer_facts(tokenizer)))
    while True:
        wait_inbox(inbox, tokenizer)
        msgs = []
        while (m := recv_nowait(inbox)) is not None:  # one reply batch for all that is ready
            msgs.append(m)
        replies: list[UserReply] = []
        for m in msgs:
            if isinstance(m, DetokenizeMsg):
                out, stopped = detok.process(m)
                replies.extend(out)
                for uid, keep in stopped:
                    send(to_scheduler, AbortMsg(uid, "stop", keep))
            elif isinstance(m, (TokenizeMsg, AbortMsg, DecodeMsg)):
                tokenizer.handle(m)
            else:
                log.warning("detokenizer: ignoring unexpected %s", type(m).__name__)
        if replies:
            at = trace.now()
            for r in replies:
                trace.stamp(r.trace, "detok_out", at)
            send(to_api, ReplyBatch(replies))
