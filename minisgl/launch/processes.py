"""The server's child processes: what each runs (one spec per scheduler rank, the DP controller, the
detokenizer and the tokenizers), starting them, waiting for each to report ready, watching for a death
and stopping them all. The launcher (launch/launcher.py) drives these and serves HTTP."""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.launch.args import ServerArgs
from minisgl.launch.child import STOP_SIGNAL, child_main
from minisgl.logging_setup import get_logger, log_phase
from minisgl.message import ReadyMsg, StartMsg, decode
from minisgl.message.addresses import Addresses

log = get_logger("minisgl.server")

class ChildFailed(Exception):
    pass


@dataclass
class Child:
    name: str
    process: BaseProcess
    conn: Connection
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return f"the {self.name} process (pid {self.process.pid}, exit code {self.process.exitcode})"


def scheduler_name(dp: int, dp_rank: int, tp_rank: int = 0) -> str:
    """How logs name a scheduler process: "scheduler" ("scheduler rank 1" with TP), and with
    data parallelism "replica 1 scheduler" ("replica 1 scheduler rank 1")."""
    name = "scheduler" if tp_rank == 0 else f"scheduler rank {tp_rank}"
    return name if dp == 1 else f"replica {dp_rank} {name}"


def replica_dist_addrs(args: ServerArgs) -> list[str | None]:
    """Each replica's TP rendezvous: --dist-init-addr HOST:PORT serves replica r at PORT + r;
    without it, one machine picks free local ports."""
    if args.tp == 1:
        return [None] * args.dp
    if args.dist_init_addr is not None:
        host, port = args.dist_init_addr.rsplit(":", 1)
        return [f"{host}:{int(port) + r}" for r in range(args.dp)]
    out = []
    for _ in range(args.dp):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            out.append(f"127.0.0.1:{s.getsockname()[1]}")
    return out


# Each child's work as "module:function", imported in the child (launch/child.py): importing the
# scheduler here to name its function would load the engine and torch into the launcher, which
# is also the API server's process.
RUN_SCHEDULER = "minisgl.scheduler.process:run_scheduler"
RUN_SCHEDULER_RANK = "minisgl.scheduler.process:run_scheduler_rank"
RUN_DP_CONTROLLER = "minisgl.dp.controller:run_dp_controller"
RUN_DETOKENIZER = "minisgl.tokenizer.detokenizer:run_detokenizer"
RUN_TOKENIZER = "minisgl.tokenizer.worker:run_tokenizer"


def children_spec(args: ServerArgs, addrs: Addresses) -> list[tuple[str, str, tuple]]:
    specs: list[tuple[str, str, tuple]] = []
    for dp_rank, dist_addr in enumerate(replica_dist_addrs(args)):
        rargs = dataclasses.replace(args, dist_init_addr=dist_addr)
        # Scheduler ranks > 0 of this machine (with TP); rank 0 lives on node 0 only.
        ranks = [r for r in args.local_ranks if r > 0]
        specs += [(scheduler_name(args.dp, dp_rank, r), RUN_SCHEDULER_RANK, (rargs, r, dp_rank)) for r in ranks]
        if args.node_rank == 0:
            raddrs = addrs.for_replica(dp_rank)
            specs.append((scheduler_name(args.dp, dp_rank), RUN_SCHEDULER, (rargs, raddrs, dp_rank)))
    if args.node_rank > 0:
        return specs
    if args.dp > 1:
        specs.append(("dp controller", RUN_DP_CONTROLLER, (args, addrs)))
    specs.append(("detokenizer", RUN_DETOKENIZER, (args, addrs)))
    specs += [(f"tokenizer{i}", RUN_TOKENIZER, (args, addrs, i)) for i in range(args.num_tokenizers)]
    return specs


def start_children(args: ServerArgs, addrs: Addresses, children: list[Child]) -> None:
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state
    specs = children_spec(args, addrs)
    log.info("starting %d processes: %s", len(specs), ", ".join(name for name, _, _ in specs))
    t0 = time.perf_counter()
    for name, target, targs in specs:
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(
            target=child_main, args=(name, target, child_end, *targs), name=f"minisgl-{name}", daemon=True
        )
        proc.start()
        child_end.close()
        children.append(Child(name, proc, parent_end))
    log_phase(f"launcher: {len(specs)} processes spawned", time.perf_counter() - t0)


def wait_ready(children: list[Child]) -> StartMsg:
    t0 = time.perf_counter()
    pending = {c.conn: c for c in children}
    by_sentinel = {c.process.sentinel: c for c in children}
    while pending:
        for obj in wait([*pending, *by_sentinel]):
            if obj in by_sentinel:
                c = by_sentinel[obj]
                if c.conn in pending and c.conn.poll():
                    continue  # its last words are in the pipe: read below
                raise ChildFailed(f"{c.describe()} exited while starting")
            c = pending.pop(obj)
            try:
                msg: ReadyMsg = decode(c.conn.recv_bytes())
            except EOFError:
                raise ChildFailed(f"{c.describe()} exited while starting") from None
            if msg.error is not None:
                raise ChildFailed(f"{c.name} failed to start: {msg.error}")
            c.info = msg.info
            log.info("%s ready (pid %d)", c.name, c.process.pid)
            log_phase(f"launcher: {c.name} ready", time.perf_counter() - t0)
    infos = [c.info for c in children if c.name.endswith("scheduler")]  # each replica's rank 0
    if not infos:  # a worker-only node (--node-rank > 0)
        return StartMsg(0, 0, [])
    info = infos[0]
    tok_eos = next(c.info for c in children if c.name == "detokenizer").get("eos_token_id")
    extra = [] if tok_eos is None or tok_eos in info["eos_token_ids"] else [tok_eos]
    # Replicas load the same model; a request must fit whichever one it lands on.
    return StartMsg(min(i["max_model_len"] for i in infos), info["vocab_size"], extra)


def stop_children(children: list[Child]) -> None:
    for c in children:
        if c.process.is_alive():
            os.kill(c.process.pid, STOP_SIGNAL)  # it exits 0 (launch/child.py)
    deadline = time.monotonic() + 5.0
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))
        if c.process.is_alive():
            log.warning("%s did not stop within 5 s; killing it", c.name)
            c.process.kill()
            c.process.join(2.0)
        c.conn.close()
    codes = {c.name: c.process.exitcode for c in children}
    if children and all(code == 0 for code in codes.values()):
        log.info("stopped %d processes, each with exit code 0", len(children))
    elif children:
        log.info("stopped %d processes; exit codes: %s", len(children), codes)


def watch(children: list[Child], stop: threading.Event, on_death: Callable[[Child], None]) -> None:
    by_sentinel = {c.process.sentinel: c for c in children}
    while not stop.is_set():
        dead = wait(list(by_sentinel), timeout=0.5)
        if dead and not stop.is_set():
            c = by_sentinel[dead[0]]
            c.process.join(1.0)  # reap it, so its exit code can be reported
            on_death(c)
            return
