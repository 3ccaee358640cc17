"""Scheduler rank process: the ZMQ loop around one scheduler object and its engine.

Rank 0 alone talks to the outside: it pulls requests and aborts from the tokenizers (and
stop-string aborts from the detokenizer), steps the scheduler, and pushes new token ids to
the detokenizer and stats/errors to the API server. With tensor parallelism, rank 0 will
publish each received input list to ranks 1..N-1 (see `receive`), so every rank applies the
same inputs in the same order and forms the same batches.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import zmq

from minisgl.engine.engine import Engine
from minisgl.engine.sampling_params import SamplingParams
from minisgl.logging_setup import get_logger
from minisgl.message import (
    AbortMsg,
    DetokenizeMsg,
    DetokInit,
    ReplyBatch,
    StartMsg,
    StatsMsg,
    TokenOut,
    UserMsg,
    UserReply,
)
from minisgl.message.zmq_io import pull_socket, push_socket, recv_nowait, send
from minisgl.scheduler.request import Request
from minisgl.server.child import report_ready

log = get_logger("minisgl.scheduler")
STATS_INTERVAL_S = 0.1

# What the FIFO scheduler can honour among SchedulerConfig options (None: any value).
_FIFO_SUPPORTS: dict[str, Any] = {
    "max_prefill_tokens": None,
    "cache": "naive",
    "overlap": False,
    "cuda_graph": False,
}


def scheduler_builder(options: dict[str, Any]) -> Callable[[Engine], Any]:
    """Checks the scheduler options now (before the model loads) and returns a function that
    builds the scheduler for an engine. The scheduler class is chosen here alone: the
    radix-cache scheduler replaces the FIFO one by changing this function.

    A scheduler offers add(req), step() -> requests that got tokens, finish(req, reason),
    has_work; and for stats either stats() (see `scheduler_stats`) or FIFO's attributes."""
    from minisgl.scheduler.fifo import FifoScheduler

    refused = [
        f"{k}={v!r}"
        for k, v in options.items()
        if k not in _FIFO_SUPPORTS or _FIFO_SUPPORTS[k] not in (None, v)
    ]
    if refused:
        raise ValueError(
            f"the FIFO scheduler does not support {', '.join(refused)} (it has no prefix cache, "
            "overlap or CUDA graphs); drop these flags"
        )
    return lambda engine: FifoScheduler(engine, options.get("max_prefill_tokens", 8192))


def scheduler_stats(sched: Any) -> tuple[int, int, int, int]:
    """(running, queued, kv_used, kv_total): from `stats()` (a dict with running, queued,
    kv_slots_used, kv_slots_total) where the scheduler has it, else from FIFO's fields."""
    if hasattr(sched, "stats"):
        s = sched.stats()
        return s["running"], s["queued"], s["kv_slots_used"], s["kv_slots_total"]
    alloc, page = sched.engine.allocator, sched.engine.cfg.page_size
    used = (alloc.total_pages - alloc.free_pages) * page
    return len(sched.running), len(sched.waiting), used, alloc.total_pages * page


class SchedulerProcess:
    def __init__(self, engine: Engine, sched: Any, addrs: Any, start: StartMsg) -> None:
        self.engine, self.sched = engine, sched
        ctx = zmq.Context()
        self.inbox = pull_socket(ctx, addrs.scheduler)
        self.to_detok = push_socket(ctx, addrs.detokenizer)
        self.to_api = push_socket(ctx, addrs.api)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.eos_ids = frozenset(engine.model_config.eos_token_ids) | frozenset(start.extra_eos_ids)
        self.reqs: dict[int, Request] = {}
        self.inits: dict[int, DetokInit] = {}  # until the request's first TokenOut carries it
        self.sent: dict[int, int] = {}  # output tokens already sent, per uid
        self.want_logprobs: set[int] = set()
        self.prompt_tokens = 0
        self.cache_hit_tokens = 0
        self.last_stats = 0.0

    def receive(self, block: bool) -> list[Any]:
        """Every input waiting now (blocking for the first one when idle). TP seam: rank 0
        will publish this list to the other ranks here; they will receive it instead."""
        if block:
            self.poller.poll()
        msgs = []
        while (m := recv_nowait(self.inbox)) is not None:
            msgs.append(m)
        return msgs

    def apply(self, msg: Any) -> None:
        if isinstance(msg, UserMsg):
            self.add(msg)
        elif isinstance(msg, AbortMsg):
            req = self.reqs.get(msg.uid)
            if req is not None:  # unknown: already finished (requests and aborts are in order)
                self.sched.finish(req, msg.reason)
                self._forget(msg.uid)
        else:
            log.warning("scheduler: ignoring unexpected %s", type(msg).__name__)

    def add(self, msg: UserMsg) -> None:
        try:
            params = SamplingParams(**msg.sampling)
            self.engine.check_prompt(msg.input_ids)
            limit = min(len(msg.input_ids) + params.max_tokens, self.engine.max_model_len)
            req = Request(msg.uid, list(msg.input_ids), params, msg.seed, self.eos_ids, limit)
            self.sched.add(req)
        except ValueError as e:
            # A request the pool can never hold: shorter max_tokens is the user's remedy.
            send(
                self.to_api,
                ReplyBatch([UserReply(msg.uid, error=str(e), error_param="max_tokens")]),
            )
            return
        self.reqs[msg.uid] = req
        self.inits[msg.uid] = msg.detok
        self.sent[msg.uid] = 0
        if msg.detok.logprobs:
            self.want_logprobs.add(msg.uid)
        self.prompt_tokens += len(msg.input_ids)

    def emit(self, stepped: list[Request]) -> None:
        items = []
        for req in stepped:
            uid = req.uid
            if self.reqs.get(uid) is not req:
                continue  # aborted meanwhile
            start = self.sent[uid]
            logprobs = req.logprobs[start:] if uid in self.want_logprobs else None
            init = self.inits.pop(uid, None)
            if init is not None:  # first tokens: the prefill is done, its cache hits known
                self.cache_hit_tokens += getattr(req, "cache_hit_tokens", 0)
            items.append(TokenOut(uid, req.output[start:], logprobs, req.finish_reason, init))
            self.sent[uid] = len(req.output)
            if req.finished:
                self._forget(uid)
        if items:
            send(self.to_detok, DetokenizeMsg(items))

    def _forget(self, uid: int) -> None:
        self.reqs.pop(uid, None)
        self.inits.pop(uid, None)
        self.sent.pop(uid, None)
        self.want_logprobs.discard(uid)

    def send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_stats < STATS_INTERVAL_S:
            return
        self.last_stats = now
        running, queued, used, total = scheduler_stats(self.sched)
        msg = StatsMsg(running, queued, used, total, self.prompt_tokens, self.cache_hit_tokens)
        send(self.to_api, msg)

    def loop(self) -> None:
        while True:
            for msg in self.receive(block=not self.sched.has_work):
                self.apply(msg)
            if self.sched.has_work:
                self.emit(self.sched.step())
            # Idle now: report at once (freed slots must show before we block on the socket).
            self.send_stats(force=not self.sched.has_work)


def run_scheduler(conn: Connection, args: Any, addrs: Any) -> None:
    build = scheduler_builder(args.scheduler_options())
    engine = Engine(args.engine_config(tp_rank=0))
    sched = build(engine)
    kv_total = scheduler_stats(sched)[3]
    mc = engine.model_config
    start = report_ready(
        conn,
        "scheduler",
        {
            "max_model_len": engine.max_model_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "kv_total": kv_total,
        },
    )
    SchedulerProcess(engine, sched, addrs, start).loop()
