"""Starts the server's processes, waits until each reports ready, then opens the HTTP port
(or the shell); stops them all on Ctrl-C / SIGTERM, and exits non-zero when one dies."""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import tempfile
import threading
import time
from collections.abc import Callable
from multiprocessing.connection import wait
from typing import Any

from minisgl.launch.args import ServerArgs
from minisgl.launch.processes import Child, ChildFailed, start_children, stop_children, wait_ready, watch
from minisgl.logging_setup import get_logger, log_phase, since_launch, startup_phase
from minisgl.message import StartMsg, encode
from minisgl.message.addresses import Addresses

log = get_logger("minisgl.server")


class Shutdown(SystemExit):
    """SIGTERM: unwinds like Ctrl-C (asyncio lets SystemExit through), then exit code 0."""


def _bind(host: str, port: int) -> socket.socket:
    """Bound now (a taken port fails before any model loads), listening only once ready.

    Its connections must have TCP_NODELAY. asyncio sets it on each accepted connection only
    when the socket's protocol is IPPROTO_TCP, not 0 (what a bare socket.socket() gets);
    without it, Nagle holds a stream's first chunk after the headers until the client's
    delayed ACK (~40 ms on Linux) on every kept-alive connection (issue 12's TTFT). Set on
    the listener too, which accepted sockets inherit (any event loop)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    try:
        sock.bind((host, port))
    except OSError as e:
        sock.close()
        raise ChildFailed(f"cannot listen on {host}:{port}: {e}") from e
    return sock


def chat_features(args: ServerArgs, tok_info: dict[str, Any]) -> Any:
    """--tool-call-parser and --reasoning-parser (auto: from the chat template) as the API uses them."""
    from minisgl.parsers.tool_formats import tool_format
    from minisgl.server.chat_request import ChatFeatures

    name = tok_info.get("tool_format") if args.tool_call_parser == "auto" else args.tool_call_parser
    if args.tool_call_parser == "auto":
        log.info("tool-call parser: %s (from the chat template)", name or "none found")
    fmt = tool_format(name) if name and name != "none" else None
    reasoning, harmony = args.reasoning_parser, fmt is not None and fmt.name == "gpt-oss"
    # Harmony is channels all through: the gpt-oss parser takes the reasoning with the calls.
    if reasoning == "auto" or (reasoning is None and harmony):
        reasoning = "gpt-oss" if harmony or tok_info.get("tool_format") == "gpt-oss" else None
        why = "from the chat template" if args.reasoning_parser == "auto" else "harmony output, with --tool-call-parser"
        log.info("reasoning parser: %s (%s)", reasoning or "none", why)
    return ChatFeatures(fmt, reasoning)


def _queue_limits(args: ServerArgs, children: list[Child]) -> Any:
    """The queue's bounds with their defaults resolved (README: Overload and draining), printed."""
    from minisgl.server.admission import QueueLimits

    n = args.max_running_requests * args.dp if args.max_queued_requests is None else args.max_queued_requests
    tokens = sorted({c.info.get("max_queued_tokens", 0) for c in children if c.name.endswith("scheduler")})
    log.info(
        "queue bounds (503 + Retry-After past them): --max-queued-requests %s, --max-queued-tokens %s per replica, "
        "--max-queue-wait-s %s; on SIGTERM, drain for up to --shutdown-timeout %g s",
        n or "none",
        "/".join(str(t) for t in tokens) if any(tokens) else "none",
        f"{args.max_queue_wait_s:g}" if args.max_queue_wait_s else "none",
        args.shutdown_timeout,
    )
    return QueueLimits(n, args.max_queue_wait_s)


def _server_info(args: ServerArgs, start: StartMsg, children: list[Child]) -> Any:
    from minisgl.models.embedding_config import embedding_config, resolve_task
    from minisgl.models.sampling_defaults import describe, model_sampling_defaults
    from minisgl.models.source import resolve_model
    from minisgl.server.api import ServerInfo
    from minisgl.server.gates import default_max_request_bytes
    from minisgl.server.protocol_types import Limits

    source = resolve_model(args.model)
    defaults = {} if args.sampling_defaults == "openai" else model_sampling_defaults(source)
    embedding = embedding_config(source) if resolve_task(source, args.task) == "embed" else None
    if embedding is not None:
        log.info("task: embeddings (%s pooling, %d dimensions) on POST /v1/embeddings", embedding.pooling,
                 embedding.dimensions)
    limit = args.max_request_bytes or default_max_request_bytes(start.max_model_len)
    bound = next((c.info.get("bytes_per_token") for c in children if "bytes_per_token" in c.info), None)
    log.info("sampling defaults (--sampling-defaults %s): %s", args.sampling_defaults, describe(defaults))
    log.info(
        "max request body %d bytes; prompts refused before tokenizing above %s bytes",
        limit,
        "(no bound for this tokenizer)" if bound is None else f"{int(bound * start.max_model_len)}",
    )
    return ServerInfo(
        args.served_model_name,
        Limits(start.vocab_size, start.max_model_len),
        defaults,
        limit,
        args.api_key,
        time.time(),
        lambda: all(c.process.is_alive() for c in children),
        features=chat_features(args, next(c.info for c in children if c.name == "detokenizer")),
        embedding=embedding,
    )


async def _serve(
    args: ServerArgs, addrs: Addresses, children: list[Child], listener: socket.socket | None, start: StartMsg
) -> int:
    import uvicorn

    from minisgl.launch.drain import DrainingServer
    from minisgl.launch.shell import run_shell
    from minisgl.server.api import build_app
    from minisgl.server.frontend import Frontend
    from minisgl.server.gateway import add_gateway_routes
    from minisgl.server.metrics import Metrics
    from minisgl.server.router_compat import add_router_routes, server_info

    loop = asyncio.get_running_loop()
    info = _server_info(args, start, children)
    frontend = Frontend(addrs, args.num_tokenizers, Metrics(), _queue_limits(args, children))
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
        target=watch, args=(children, stop_watch, lambda c: loop.call_soon_threadsafe(on_death, c)), daemon=True
    ).start()
    try:
        if args.shell:
            task = asyncio.create_task(run_shell(frontend, args.served_model_name, info.sampling_defaults))
            stoppers.append(task.cancel)
            try:
                await task
            except asyncio.CancelledError:
                if not failed:
                    raise
        else:
            assert listener is not None
            app = build_app(frontend, info)
            schedulers = [c.info for c in children if c.name.endswith("scheduler")]  # each replica's rank 0
            router_info = server_info(args, schedulers)
            add_router_routes(app, frontend, router_info)
            add_gateway_routes(app, frontend, router_info)  # SMG's /v1/loads, /flush_cache; llm-d's gauges
            server = DrainingServer(
                uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=3),
                frontend,
                args.shutdown_timeout,
            )
            stoppers.append(lambda: setattr(server, "should_exit", True))
            await _first_reports(frontend, args.dp, failed)
            if failed:  # a child died before reporting: never open the port (on_death said why)
                return 1
            task = asyncio.create_task(server.serve(sockets=[listener]))
            while not server.started and not task.done():
                await asyncio.sleep(0.02)
            if server.started:
                log_phase("launcher: HTTP serving", since_launch())
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


FIRST_REPORT_TIMEOUT_S = 30.0


async def _first_reports(frontend: Any, replicas: int, failed: list[str]) -> None:
    """Hold the port closed until every replica's first stats report is in. Each replica sends one
    as its loop starts, on a channel of its own that may deliver it after the start message; before
    it, /metrics lists the per-replica and vLLM-profile families with no samples, and a router that
    scrapes a fresh pod reads it as empty (a CI run of the thirtieth session did). It takes
    milliseconds; past FIRST_REPORT_TIMEOUT_S the server opens anyway, said in the log."""
    deadline = time.monotonic() + FIRST_REPORT_TIMEOUT_S
    while len(frontend.metrics.replicas.latest) < replicas and not failed:
        if time.monotonic() > deadline:
            have = sorted(frontend.metrics.replicas.latest)
            log.warning("serving before every replica's first stats report (in after %.0f s: dp ranks %s of %d); "
                        "/metrics has no samples for the others until theirs arrive",
                        FIRST_REPORT_TIMEOUT_S, have, replicas)
            return
        await asyncio.sleep(0.005)


def _run_worker_node(children: list[Child]) -> int:
    """A node > 0 serves nothing itself: it waits until a rank dies (1) or it is stopped."""
    print(f"minisgl: node ranks {[c.name for c in children]} joined; serving from node 0", flush=True)
    wait([c.process.sentinel for c in children])
    dead = next(c for c in children if not c.process.is_alive())
    log.error("%s died; shutting down", dead.describe())
    return 1


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Shutdown(0)


def _import_api() -> None:
    """The API server's modules (FastAPI, pydantic models, uvicorn: ~0.5 s of imports), loaded
    while the children start rather than after they are ready."""
    with startup_phase("launcher: API server modules imported"):
        import uvicorn  # noqa: F401

        import minisgl.launch.drain  # noqa: F401
        import minisgl.server.api  # noqa: F401
        import minisgl.server.gateway  # noqa: F401
        import minisgl.server.router_compat  # noqa: F401


def launch(args: ServerArgs) -> int:
    """Runs the server until Ctrl-C / SIGTERM (0) or until a process dies (1)."""
    folder = tempfile.mkdtemp(prefix="minisgl-")
    addrs = Addresses.ipc(folder, args.num_tokenizers, args.dp)
    log.info("IPC sockets in %s", folder)
    children: list[Child] = []
    listener: socket.socket | None = None
    previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        listener = None if args.shell or args.node_rank > 0 else _bind(args.host, args.port)
        start_children(args, addrs, children)
        if args.node_rank == 0:
            _import_api()
        start = wait_ready(children)
        for c in children:
            c.conn.send_bytes(encode(start))
        if args.node_rank > 0:
            return _run_worker_node(children)
        return asyncio.run(_serve(args, addrs, children, listener, start))
    except ChildFailed as e:
        log.error("%s; shutting down", e)
        return 1
    except (KeyboardInterrupt, Shutdown):
        return 0
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a second SIGTERM must not cut cleanup short
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        stop_children(children)
        if listener is not None:
            listener.close()
        shutil.rmtree(folder, ignore_errors=True)  # the ipc:// socket files live here
        signal.signal(signal.SIGTERM, previous)
        signal.signal(signal.SIGINT, signal.default_int_handler)
