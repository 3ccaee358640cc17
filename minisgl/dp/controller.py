"""The DP controller process (`--dp N` > 1): between the tokenizer workers and the replicas.

    tokenizers / detokenizer ──UserMsg, AbortMsg──▶ controller ──▶ replica r's scheduler rank 0
    replica r's scheduler ──StatsMsg(dp_rank=r)──▶ controller ──▶ API server (metrics)

It binds the address scheduler rank 0 binds without DP (`Addresses.scheduler`), so the
tokenizers and the detokenizer need not know that replicas exist. A request goes to the replica
the Dispatcher picks from the replicas' own load reports (which pass through here on their way
to the API server) and its prompt's prefix affinity. Frames are forwarded as received, never
re-encoded.

Aborts (client gone, stop string found) go to every replica: a scheduler ignores uids it does
not hold, so no uid -> replica table has to be kept (or pruned). So does a cache flush (each
replica answers the API server itself); the prefix tables forget what was sent before it. An abort travels on the same
socket as the request it ends, after it, so it can never overtake it.
"""

from __future__ import annotations

from typing import Any

import zmq

from minisgl.dp.dispatch import Dispatcher
from minisgl.logging_setup import get_logger
from minisgl.message import AbortMsg, FlushCacheMsg, Ready, StatsMsg, UserMsg, decode
from minisgl.message.zmq_io import pull_socket, push_socket

log = get_logger("minisgl.dp")


class Controller:
    """Socket-facing loop around a Dispatcher: `handle` takes one raw frame."""

    def __init__(self, dispatcher: Dispatcher, replicas: list[zmq.Socket], to_api: zmq.Socket) -> None:
        self.dispatcher = dispatcher
        self.replicas = replicas
        self.to_api = to_api

    def handle(self, frame: bytes) -> None:
        msg = decode(frame)
        if isinstance(msg, UserMsg):
            self.replicas[self.dispatcher.pick(msg.input_ids)].send(frame, copy=False)
        elif isinstance(msg, StatsMsg):
            self.dispatcher.on_report(msg.dp_rank, msg.load_tokens, msg.received)
            self.to_api.send(frame, copy=False)
        elif isinstance(msg, (AbortMsg, FlushCacheMsg)):
            for sock in self.replicas:
                sock.send(frame, copy=False)
            if isinstance(msg, FlushCacheMsg):
                self.dispatcher.forget_prefixes()
        else:
            log.warning("dp controller: ignoring unexpected %s", type(msg).__name__)


def run_dp_controller(ready: Ready, args: Any, addrs: Any) -> None:
    ctx = zmq.Context()
    inbox = pull_socket(ctx, addrs.scheduler)
    replicas = []
    for addr in addrs.replicas:
        sock = ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 0)  # a burst never blocks dispatch (set before connecting)
        sock.connect(addr)
        replicas.append(sock)
    controller = Controller(
        Dispatcher(len(replicas), args.load_balance_method, args.page_size), replicas, push_socket(ctx, addrs.api)
    )
    ready({"replicas": len(replicas), "method": args.load_balance_method})
    while True:
        controller.handle(inbox.recv(copy=True))
