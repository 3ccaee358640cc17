"""Scheduler rank process: the ZMQ loop around one scheduler object and its engine.

Rank 0 alone talks to the outside: it pulls requests and aborts from the tokenizers (and
stop-string aborts from the detokenizer), steps the scheduler, and pushes new token ids to
the detokenizer and stats/errors to the API server. With tensor parallelism, rank 0
broadcasts each step's inputs to ranks 1..N-1 (scheduler/tp_sync.py), so every rank applies
the same inputs in the same order and forms the same batches.

KV-cache events (--kv-events-config): rank 0's radix cache records what it stores and drops
(kvcache/events.py); after every step, and after a flush, the loop publishes what was recorded
as one batch (message/kv_events.py).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import zmq

from minisgl.core.grammar_fields import grammar_spec
from minisgl.distributed.placement import share_cpu
from minisgl.engine.engine import Engine
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.kvcache.events import CacheEvents
from minisgl.kvcache.host_tier import HostKVTier
from minisgl.logging_setup import get_logger
from minisgl.message import (
    AbortMsg,
    DetokenizeMsg,
    DetokInit,
    FlushCacheMsg,
    FlushCacheReply,
    Ready,
    ReplyBatch,
    StartMsg,
    StatsMsg,
    TokenOut,
    UserMsg,
    UserReply,
    trace,
)
from minisgl.message.kv_events import KVEventPublisher, parse_kv_events_config
from minisgl.message.zmq_io import pull_socket, push_socket, recv_nowait, send
from minisgl.scheduler.config import SchedulerConfig, scheduler_config
from minisgl.scheduler.queue_bounds import QUEUE_TIMEOUT, TIMEOUT_MESSAGE, QueueBounds
from minisgl.scheduler.request import Request
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.tp_sync import Input, InputSync, apply_inputs

log = get_logger("minisgl.scheduler")
STATS_INTERVAL_S = 0.1
GRAMMAR_POLL_MS = 2  # how often an idle rank 0 checks for finished grammar compiles
# With TP, idle rank 0 still broadcasts (an empty input list) this often, so the other ranks'
# collectives never wait long enough to time out.
TP_IDLE_POLL_MS = 1000


def logprob_extras(req: Request, start: int, first: bool) -> tuple[list | None, list | None]:
    """TokenOut's (top_logprobs, prompt_logprobs) for the tokens from `start` on, as msgpack
    lists; None where the request did not ask (prompt logprobs: first TokenOut only)."""
    top = None
    if req.params.top_logprobs:
        top = [[[t, lp] for t, lp in alts] for alts in req.top_logprobs[start:]]
    prompt = None
    if first and req.prompt_logprobs is not None:
        prompt = [None if e is None else [e[0], [[t, lp] for t, lp in e[1]]] for e in req.prompt_logprobs]
    return top, prompt


def scheduler_builder(options: dict[str, Any], args: Any = None) -> Callable[..., Scheduler]:
    """Checks the scheduler options now (before the model loads) and returns a function that
    builds the scheduler for an engine (with a grammar compiler that loads the server's
    tokenizer the first time a request has a grammar)."""
    fields = set(SchedulerConfig.__dataclass_fields__)
    unknown = sorted(set(options) - fields)
    if unknown:
        raise ValueError(f"unknown scheduler option(s): {', '.join(unknown)}")
    SchedulerConfig(**options)  # validates the values

    def build(engine: Engine, events: CacheEvents | None = None) -> Scheduler:
        grammars = None
        if args is not None:
            from minisgl.tokenizer.load import load_server_tokenizer

            grammars = GrammarCompiler(lambda: load_server_tokenizer(args), engine.model_config.vocab_size)
        return Scheduler(engine, scheduler_config(options, engine.attn.name, engine.device.type), grammars, events)

    return build


def scheduler_stats(sched: Scheduler) -> tuple[int, int, int, int]:
    """(running, queued, kv_used, kv_total)."""
    s = sched.stats()
    return s["running"], s["queued"], s["kv_slots_used"], s["kv_slots_total"]


def load_tokens(sched: Scheduler) -> int:
    """The replica's load as the DP controller weighs it: the tokens (prompt + generated so
    far) of every running and waiting request."""
    active = [*sched.running, *sched.waiting, *([sched.prefilling] if sched.prefilling else [])]
    return sum(r.total_len for r in active)


class SchedulerProcess:
    def __init__(
        self,
        engine: Engine,
        sched: Any,
        addrs: Any,
        start: StartMsg,
        dp_rank: int = 0,
        events: tuple[CacheEvents, KVEventPublisher] | None = None,
        max_queued_tokens: int = 0,
    ) -> None:
        self.engine, self.sched, self.dp_rank, self.events = engine, sched, dp_rank, events
        self.bounds = QueueBounds(max_queued_tokens)
        # Requests whose grammar compiles on the worker thread: added once it is ready, so a
        # compile never stalls the batch (the other ranks start compiling at the same time).
        self.compiling: list[tuple[Request, Any]] = []
        ctx = zmq.Context()
        self.inbox = pull_socket(ctx, addrs.scheduler)
        self.to_detok = push_socket(ctx, addrs.detokenizer)
        self.to_api = push_socket(ctx, addrs.api)
        # Load reports: to the API server, or with DP to the controller (which forwards them).
        self.to_stats = self.to_api if addrs.stats is None else push_socket(ctx, addrs.stats)
        self.received = 0  # UserMsgs received, refused ones included (see StatsMsg.received)
        self.poller = zmq.Poller()
        self.poller.register(self.inbox, zmq.POLLIN)
        self.eos_ids = frozenset(engine.model_config.eos_token_ids) | frozenset(start.extra_eos_ids)
        self.reqs: dict[int, Request] = {}
        self.inits: dict[int, DetokInit] = {}  # until the request's first TokenOut carries it
        self.sent: dict[int, int] = {}  # output tokens already sent, per uid
        self.sync = InputSync(engine.tp.rank, engine.tp.size, engine.cpu_group)
        self.inputs: list[Input] = []  # this step's inputs, applied on every rank in lockstep
        self.synced: dict[int, Request] = {}  # the uid -> request map apply_inputs keeps
        self.prompt_tokens = 0
        self.cache_hit_tokens = 0
        self.last_stats = 0.0

    def receive(self, block: bool) -> list[Any]:
        """Every input waiting now (blocking for the first one when idle; with TP at most
        TP_IDLE_POLL_MS, see there)."""
        if block:
            timeout = GRAMMAR_POLL_MS if self.compiling else (TP_IDLE_POLL_MS if self.sync.size > 1 else None)
            self.poller.poll(timeout)
        msgs = []
        while (m := recv_nowait(self.inbox)) is not None:
            msgs.append(m)
        if trace.ENABLED and msgs:
            at = trace.now()
            for m in msgs:
                trace.stamp(getattr(m, "trace", None), "sched_in", at)
        return msgs

    def apply(self, msg: Any) -> None:
        if isinstance(msg, UserMsg):
            self.received += 1
            self.add(msg)
        elif isinstance(msg, FlushCacheMsg):
            self.inputs.append(("flush", msg.request_id))  # in lockstep: every TP rank empties its cache
        elif isinstance(msg, AbortMsg):
            req = self.reqs.get(msg.uid)
            if req is not None:  # unknown: already finished (requests and aborts are in order)
                self.inputs.append(("finish", msg.uid, msg.reason, msg.keep_tokens))
                if msg.reason == "abort" and msg.uid not in self.inits:
                    # The detokenizer holds its decode state (it saw tokens): let it drop it.
                    send(self.to_detok, DetokenizeMsg([TokenOut(msg.uid, [], None, "abort")]))
                self._forget(msg.uid)
        else:
            log.warning("scheduler: ignoring unexpected %s", type(msg).__name__)

    def add(self, msg: UserMsg) -> None:
        # The API process validated the sampling fields (logit_bias ids against the vocabulary
        # too) and the tokenizer the prompt and max_tokens against the context; decoding does
        # not validate again. What is left to refuse is a request the KV pool could never hold
        # (then fewer max_tokens would fit, so that is the field to blame).
        params = msg.sampling
        limit = min(len(msg.input_ids) + params.max_tokens, self.engine.max_model_len)
        if msg.pooling is not None:  # an embedding generates nothing
            limit = len(msg.input_ids)
        req = Request(msg.uid, list(msg.input_ids), params, msg.seed, self.eos_ids, limit)
        req.report_logprobs = bool(msg.detok.logprobs)
        req.trace = msg.trace
        req.pooling = msg.pooling
        try:
            self.sched.add_check(req)
        except ValueError as e:
            param = getattr(e, "param", None) or "max_tokens"  # the KV pool's fit, unless it names its field
            send(self.to_api, ReplyBatch([UserReply(msg.uid, error=str(e), error_param=param)]))
            return
        refused = self.bounds.refuse(self.sched.waiting, len(msg.input_ids), msg.admit_by, time.monotonic())
        if refused is not None:
            send(self.to_api, ReplyBatch([UserReply(msg.uid, error=refused[1], error_code=refused[0])]))
            return
        self.bounds.track(msg.uid, msg.admit_by)
        spec = grammar_spec(params)
        if spec is not None and self.sched.grammar.compiler is not None:
            self.compiling.append((req, self.sched.grammar.compiler.prefetch(spec)))
            self.inputs.append(("grammar", spec))
        else:
            self.inputs.append(("add", req))  # added on every rank at the next exchange
        self.reqs[msg.uid] = req
        self.inits[msg.uid] = msg.detok
        self.sent[msg.uid] = 0
        self.prompt_tokens += len(msg.input_ids)

    def admit_compiled(self) -> None:
        """Requests whose grammar is ready join the lockstep input stream; a grammar that does
        not compile fails its request with xgrammar's reason."""
        waiting = []
        for req, fut in self.compiling:
            if self.reqs.get(req.uid) is not req:
                continue  # aborted while compiling
            if not fut.done():
                waiting.append((req, fut))
            elif fut.exception() is not None:
                err = UserReply(req.uid, error=str(fut.exception()), error_param=grammar_spec(req.params).kind)
                send(self.to_api, ReplyBatch([err]))
                self._forget(req.uid)
            else:
                self.inputs.append(("add", req))
        self.compiling = waiting

    def emit(self, stepped: list[Request]) -> None:
        items, embeddings = [], []
        for req in stepped:
            uid = req.uid
            if self.reqs.get(uid) is not req:
                continue  # aborted meanwhile
            if req.pooling is not None:  # done: its embedding goes to the API (nothing to detokenize)
                vector = req.pooled.numpy().astype("<f4").tobytes()
                embeddings.append(UserReply(uid, finish_reason="stop", prompt_tokens=len(req.prompt), embedding=vector))
                self._forget(uid)
                self.synced.pop(uid, None)
                continue
            start = self.sent[uid]
            logprobs = req.logprobs[start:] if req.report_logprobs else None
            init = self.inits.pop(uid, None)
            if init is not None:  # first tokens: the prefill is done, its cache hits known
                self.cache_hit_tokens += req.cache_hit_tokens
                init.cached_tokens = req.cache_hit_tokens  # the reply's usage.prompt_tokens_details
            hops = None
            if init is not None and req.trace is not None:  # its trace rides on the first TokenOut only
                hops, req.trace = req.trace, None
                trace.stamp(hops, "emit")
            items.append(
                TokenOut(
                    uid,
                    req.output[start:],
                    logprobs,
                    req.finish_reason,
                    init,
                    *logprob_extras(req, start, first=init is not None),
                    hops,
                )
            )
            self.sent[uid] = len(req.output)
            if req.finished:
                self._forget(uid)
                self.synced.pop(uid, None)
        if items:
            send(self.to_detok, DetokenizeMsg(items))
        if embeddings:
            send(self.to_api, ReplyBatch(embeddings))

    def expire(self) -> None:
        """Waiting requests past their admission deadline leave the queue (on every rank, with
        the next inputs) and their clients get the 503 (scheduler/queue_bounds.py)."""
        expired = self.bounds.expired(self.sched.waiting, time.monotonic())  # only requests it tracks
        if not expired:
            return
        for req in expired:
            self.inputs.append(("finish", req.uid, "abort"))
            self._forget(req.uid)
        send(
            self.to_api,
            ReplyBatch([UserReply(r.uid, error=TIMEOUT_MESSAGE, error_code=QUEUE_TIMEOUT) for r in expired]),
        )

    def _forget(self, uid: int) -> None:
        self.bounds.forget(uid)
        self.reqs.pop(uid, None)
        self.inits.pop(uid, None)
        self.sent.pop(uid, None)

    def send_stats(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self.last_stats < STATS_INTERVAL_S:
            return
        self.last_stats = now
        running, queued, used, total = scheduler_stats(self.sched)
        st = self.sched.stats()
        msg = StatsMsg(
            running,
            queued,
            used,
            total,
            self.prompt_tokens,
            self.cache_hit_tokens,
            self.dp_rank,
            load_tokens(self.sched),
            self.received,
            st.get("spec_proposed", 0),
            st.get("spec_accepted", 0),
            st.get("spec_verified", 0),
            st.get("kv_swa_slots_used", 0),
            st.get("kv_swa_slots_total", 0),
            *host_tier_stats(self.sched.kv.tier),
            state_used=st.get("state_slots_used", 0),
            state_total=st.get("state_slots_total", 0),
            state_snapshots=st.get("state_snapshots", 0),
            state_snapshots_total=st.get("state_snapshots_total", 0),
        )
        send(self.to_stats, msg)

    def loop(self) -> None:
        self.send_stats(force=True)  # every replica shows in /metrics (and to the DP controller) from the start
        while True:
            self.bounds.new_batch()
            for msg in self.receive(block=not self.sched.has_work):
                self.apply(msg)
            self.expire()
            if self.compiling:
                self.admit_compiled()
            inputs, self.inputs = self.inputs, []
            flushed: list[tuple[int, str | None]] = []
            apply_inputs(self.sched, self.sync.exchange(inputs), self.synced, flushed)
            for request_id, refused in flushed:
                send(self.to_api, FlushCacheReply(request_id, self.dp_rank, refused))
            if self.sched.has_work:
                self.emit(self.sched.step())
            if self.events is not None:
                self.events[1].publish(self.events[0].drain())
            # Idle now: report at once (freed slots must show before we block on the socket).
            self.send_stats(force=not self.sched.has_work)


def run_scheduler_rank(ready: Ready, args: Any, rank: int, dp_rank: int = 0) -> None:
    """A tensor-parallel rank > 0: no sockets; it steps on what rank 0 broadcasts."""
    from minisgl.scheduler.tp_worker import run_tp_worker

    scheduler_builder(args.scheduler_options())  # the same checks as rank 0
    share_cpu(args.device, args.dp * args.tp if args.dp > 1 else 1)
    run_tp_worker(
        args.engine_config(tp_rank=rank, dp_rank=dp_rank),
        {**args.scheduler_options(), "tokenizer": args.tokenizer},
        on_ready=lambda: ready(None),
    )


def run_scheduler(ready: Ready, args: Any, addrs: Any, dp_rank: int = 0) -> None:
    """Scheduler rank 0 of replica `dp_rank` (`addrs` is that replica's view of the server)."""
    build = scheduler_builder(args.scheduler_options(), args)
    share_cpu(args.device, args.dp * args.tp if args.dp > 1 else 1)
    engine = Engine(args.engine_config(tp_rank=0, dp_rank=dp_rank))
    events_cfg = parse_kv_events_config(args.kv_events_config)
    events = None
    if events_cfg is not None:  # the sockets bind now: a taken port fails the start, naming it
        events = (
            CacheEvents(engine.cfg.page_size, events_cfg.hash_seed),
            KVEventPublisher(events_cfg, engine.cfg.page_size, dp_rank),
        )
    sched = build(engine, events[0] if events else None)
    kv_total = scheduler_stats(sched)[3]
    mc = engine.model_config
    # --max-queued-tokens: by default one KV pool of prompts may wait (the launcher prints it).
    max_queued_tokens = kv_total if args.max_queued_tokens is None else args.max_queued_tokens
    start = ready(
        {
            "max_model_len": engine.max_model_len,
            "vocab_size": mc.vocab_size,
            "eos_token_ids": list(mc.eos_token_ids),
            "kv_total": kv_total,
            "architecture": mc.architecture,
            "device": str(engine.device),
            "max_queued_tokens": max_queued_tokens,
        },
    )
    SchedulerProcess(engine, sched, addrs, start, dp_rank, events, max_queued_tokens).loop()


def host_tier_stats(tier: HostKVTier | None) -> tuple[int, int, int, float]:
    if tier is None:
        return 0, 0, 0, 0.0
    return tier.bytes_used, tier.hits, tier.tokens_loaded, tier.load_seconds
