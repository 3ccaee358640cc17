"""Starts the server's processes, waits until each reports ready, then opens the HTTP port
(or the shell); stops them all on Ctrl-C / SIGTERM, and exits non-zero when one dies."""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing as mp
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from multiprocessing.process import BaseProcess
from typing import Any

from minisgl.logging_setup import get_logger
from minisgl.message import ReadyMsg, StartMsg, decode, encode
from minisgl.server.args import Addresses, ServerArgs
from minisgl.server.child import child_main

log = get_logger("minisgl.server")


class ChildFailed(Exception):
    pass


class Shutdown(SystemExit):
    """SIGTERM: unwinds like Ctrl-C (asyncio lets SystemExit through), then exit code 0."""


@dataclass
class Child:
    name: str
    process: BaseProcess
    conn: Connection
    info: dict[str, Any] = field(default_factory=dict)

    def describe(self) -> str:
        return f"the {self.name} process (pid {self.process.pid}, exit code {self.process.exitcode})"


def _children_spec(args: ServerArgs, addrs: Addresses) -> list[tuple[str, Callable[..., None], tuple]]:
    from minisgl.scheduler.process import run_scheduler, run_scheduler_rank
    from minisgl.tokenizer.detokenizer import run_detokenizer
    from minisgl.tokenizer.worker import run_tokenizer

    # Scheduler ranks > 0 of this machine (with TP); rank 0 lives on node 0 only.
    ranks = [r for r in args.local_ranks if r > 0]
    specs: list[tuple[str, Callable[..., None], tuple]] = [
        (f"scheduler rank {r}", run_scheduler_rank, (args, r)) for r in ranks
    ]
    if args.node_rank > 0:
        return specs
    specs += [
        ("scheduler", run_scheduler, (args, addrs)),
        ("detokenizer", run_detokenizer, (args, addrs)),
    ]
    specs += [(f"tokenizer{i}", run_tokenizer, (args, addrs, i)) for i in range(args.num_tokenizers)]
    return specs


def _start_children(args: ServerArgs, addrs: Addresses, children: list[Child]) -> None:
    ctx = mp.get_context("spawn")  # never fork a process that may hold CUDA state
    for name, target, targs in _children_spec(args, addrs):
        parent_end, child_end = ctx.Pipe()
        proc = ctx.Process(
            target=child_main, args=(name, target, child_end, *targs), name=f"minisgl-{name}", daemon=True
        )
        proc.start()
        child_end.close()
        children.append(Child(name, proc, parent_end))


def _wait_ready(children: list[Child]) -> StartMsg:
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
    if not any(c.name == "scheduler" for c in children):  # a worker-only node (--node-rank > 0)
        return StartMsg(0, 0, [])
    info = next(c.info for c in children if c.name == "scheduler")
    tok_eos = next(c.info for c in children if c.name == "detokenizer").get("eos_token_id")
    extra = [] if tok_eos is None or tok_eos in info["eos_token_ids"] else [tok_eos]
    return StartMsg(info["max_model_len"], info["vocab_size"], extra)


def chat_features(args: ServerArgs, detok_info: dict[str, Any]) -> Any:
    """--tool-call-parser (auto: what the detokenizer found in the chat template) and
    --reasoning-parser, as the API's output parsing uses them."""
    from minisgl.parsers.tool_formats import tool_format
    from minisgl.server.openai_serving import ChatFeatures

    name = detok_info.get("tool_format") if args.tool_call_parser == "auto" else args.tool_call_parser
    if args.tool_call_parser == "auto":
        log.info("tool-call parser: %s (from the chat template)", name or "none found")
    fmt = tool_format(name) if name and name != "none" else None
    return ChatFeatures(fmt, args.reasoning_parser)


def _stop_children(children: list[Child]) -> None:
    for c in children:
        if c.process.is_alive():
            c.process.terminate()
    deadline = time.monotonic() + 5.0
    for c in children:
        c.process.join(max(0.0, deadline - time.monotonic()))
        if c.process.is_alive():
            log.warning("%s ignored SIGTERM; killing it", c.name)
            c.process.kill()
            c.process.join(2.0)
        c.conn.close()


def _bind(host: str, port: int) -> socket.socket:
    """Bound now (a taken port fails before any model loads), listening only once ready."""
    sock = socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ChildFailed(f"cannot listen on {host}:{port}: {e}") from e
    return sock


def _watch(children: list[Child], stop: threading.Event, on_death: Callable[[Child], None]) -> None:
    by_sentinel = {c.process.sentinel: c for c in children}
    while not stop.is_set():
        dead = wait(list(by_sentinel), timeout=0.5)
        if dead and not stop.is_set():
            c = by_sentinel[dead[0]]
            c.process.join(1.0)  # reap it, so its exit code can be reported
            on_death(c)
            return


async def _serve(args: ServerArgs, addrs: Addresses, children: list[Child], listener: socket.socket | None) -> int:
    import uvicorn

    from minisgl.server.api import build_app
    from minisgl.server.frontend import Frontend
    from minisgl.server.metrics import Metrics
    from minisgl.server.shell import run_shell

    loop = asyncio.get_running_loop()
    frontend = Frontend(addrs, args.num_tokenizers, Metrics())
    frontend.open()
    receiver = asyncio.create_task(frontend.run())
    failed: list[str] = []
    stoppers: list[Callable[[], Any]] = []

    def on_death(c: Child) -> None:  # on the event loop
        why = f"{c.describe()} died"
        log.error("%s; shutting down", why)
        failed.append(why)
        frontend.fail_all(f"server error: {why}")
        for stopper in stoppers:
            stopper()

    stop_watch = threading.Event()
    threading.Thread(
        target=_watch, args=(children, stop_watch, lambda c: loop.call_soon_threadsafe(on_death, c)), daemon=True
    ).start()
    try:
        if args.shell:
            task = asyncio.create_task(run_shell(frontend, args.served_model_name))
            stoppers.append(task.cancel)
            try:
                await task
            except asyncio.CancelledError:
                if not failed:
                    raise
        else:
            assert listener is not None
            app = build_app(
                frontend, args.served_model_name, args.api_key, lambda: all(c.process.is_alive() for c in children),
                chat_features(args, next(c.info for c in children if c.name == "detokenizer")),
            )
            server = uvicorn.Server(
                uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=3)
            )
            stoppers.append(lambda: setattr(server, "should_exit", True))
            task = asyncio.create_task(server.serve(sockets=[listener]))
            while not server.started and not task.done():
                await asyncio.sleep(0.02)
            if server.started:
                host, port = listener.getsockname()[:2]
                host = f"[{host}]" if ":" in host else host  # IPv6 literals go in brackets in URLs
                print(
                    f"minisgl: serving {args.served_model_name} at http://{host}:{port} (OpenAI API under /v1)",
                    flush=True,
                )
            await task
    finally:
        stop_watch.set()
        receiver.cancel()
        frontend.close()
    return 1 if failed else 0


def _run_worker_node(children: list[Child]) -> int:
    """A node > 0 serves nothing itself: it waits until a rank dies (1) or it is stopped."""
    print(f"minisgl: node ranks {[c.name for c in children]} joined; serving from node 0", flush=True)
    wait([c.process.sentinel for c in children])
    dead = next(c for c in children if not c.process.is_alive())
    log.error("%s died; shutting down", dead.describe())
    return 1


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Shutdown(0)


def launch(args: ServerArgs) -> int:
    """Runs the server until Ctrl-C / SIGTERM (0) or until a process dies (1)."""
    if args.tp > 1 and args.dist_init_addr is None:
        with socket.socket() as s:  # one machine: rendezvous on a free local port
            s.bind(("127.0.0.1", 0))
            args = dataclasses.replace(args, dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}")
    folder = tempfile.mkdtemp(prefix="minisgl-")
    addrs = Addresses.ipc(folder, args.num_tokenizers)
    log.info("starting %d processes; IPC sockets in %s", args.num_tokenizers + 2, folder)
    children: list[Child] = []
    listener: socket.socket | None = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        listener = None if args.shell or args.node_rank > 0 else _bind(args.host, args.port)
        _start_children(args, addrs, children)
        start = _wait_ready(children)
        for c in children:
            c.conn.send_bytes(encode(start))
        if args.node_rank > 0:
            return _run_worker_node(children)
        return asyncio.run(_serve(args, addrs, children, listener))
    except ChildFailed as e:
        log.error("%s; shutting down", e)
        return 1
    except (KeyboardInterrupt, Shutdown):
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        _stop_children(children)
        if listener is not None:
            listener.close()
        shutil.rmtree(folder, ignore_errors=True)  # the ipc:// socket files live here
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
