"""What cluster routers read from a server beyond the OpenAI routes: the SGLang model gateway's
(SMG, PyPI `smg`) HTTP worker contract and llm-d's model-server metrics.

SMG, found by reading its source (1.9-1.13) and by running 1.13 against this server:
- On registering a worker it reads `GET /v1/models` and takes `owned_by: "sglang"` for an
  SGLang HTTP worker (api.py answers so); then `/server_info` and `/model_info`
  (router_compat.py) for the served name, context and limits.
- Its load monitor (policies power_of_two and least_load, `/get_loads`, `--engine-metrics`)
  polls `GET /v1/loads?include=core,disagg,queues,memory`: per DP rank, running and waiting
  requests and KV tokens used of the total (`token_usage` = used / total).
- `POST /flush_cache` on the gateway is fanned out to every worker; any 2xx counts as done.
  Here it empties every replica's radix cache when no running request holds a cached page
  (200), else nothing changes and a 409 says which replica refused and why.
llm-d's endpoint picker reads the vLLM-profile gauges of /metrics (vllm_metrics.py).
"""

from __future__ import annotations

import asyncio
import itertools
from datetime import datetime, timezone
from typing import Any

import zmq
from fastapi import FastAPI, Query

from minisgl.message import FlushCacheMsg, FlushCacheReply, encode
from minisgl.server import openapi_doc
from minisgl.server.errors import ApiError
from minisgl.server.frontend import Frontend
from minisgl.server.protocol import ErrorResponse
from minisgl.server.vllm_metrics import VllmProfile

# SGLang's sections of /v1/loads; this server has the core one (the others describe features
# it lacks: disaggregation, LoRA, speculative and memory detail), so those are left out.
LOAD_SECTIONS = ("core", "memory", "spec", "lora", "disagg", "queues", "all")
FLUSH_TIMEOUT_S = 30.0


def load_entries(frontend: Frontend, max_running: int, sections: set[str]) -> list[dict[str, Any]]:
    """One /v1/loads entry per replica, from its latest report."""
    out = []
    for rank, s in sorted(frontend.metrics.replicas.latest.items()):
        entry: dict[str, Any] = {"dp_rank": rank}
        if sections & {"core", "all"}:
            entry.update(
                num_running_reqs=s.running,
                num_waiting_reqs=s.queued,
                num_total_reqs=s.running + s.queued,
                num_used_tokens=s.kv_used,
                max_total_num_tokens=s.kv_total,
                token_usage=s.kv_usage,
                cache_hit_rate=s.cache_hit_rate,
                max_running_requests=max_running,
            )
        out.append(entry)
    return out


class CacheFlusher:
    """Sends FlushCacheMsg to the schedulers (the DP controller forwards it to every replica)
    and gathers one FlushCacheReply per replica."""

    def __init__(self, frontend: Frontend, replicas: int) -> None:
        self.frontend, self.replicas = frontend, replicas
        self._ids = itertools.count()
        self._waiting: dict[int, tuple[asyncio.Future, list[FlushCacheReply]]] = {}
        self._sock: zmq.Socket | None = None
        frontend.handlers[FlushCacheReply] = self._on_reply

    def _on_reply(self, reply: FlushCacheReply) -> None:
        entry = self._waiting.get(reply.request_id)
        if entry is None:
            return  # its caller timed out
        fut, replies = entry
        replies.append(reply)
        if len(replies) == self.replicas and not fut.done():
            fut.set_result(replies)

    async def flush(self) -> list[FlushCacheReply]:
        if self._sock is None:
            self._sock = zmq.Context.instance().socket(zmq.PUSH)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self.frontend.addrs.scheduler)
        rid = next(self._ids)
        fut = asyncio.get_running_loop().create_future()
        self._waiting[rid] = (fut, [])
        try:
            self._sock.send(encode(FlushCacheMsg(rid)), zmq.NOBLOCK)
            return await asyncio.wait_for(fut, FLUSH_TIMEOUT_S)
        except (asyncio.TimeoutError, zmq.Again):
            raise ApiError(
                f"the schedulers did not answer within {FLUSH_TIMEOUT_S:.0f} s", None, 503, kind="server_error"
            ) from None
        finally:
            del self._waiting[rid]


def add_gateway_routes(app: FastAPI, frontend: Frontend, info: dict[str, Any]) -> None:
    """/v1/loads, /flush_cache and the vLLM-profile gauges (`info`: server_info's dict)."""
    frontend.metrics.registry.register(
        VllmProfile(frontend.metrics.replicas, info["served_model_name"], info["page_size"])
    )
    flusher = CacheFlusher(frontend, info["dp_size"])

    @app.get("/v1/loads", responses=openapi_doc.errors(400))
    async def loads(
        include: str = Query("all", description=f"sections, comma-separated: {', '.join(LOAD_SECTIONS)}"),
    ) -> dict[str, Any]:
        """SGLang's per-replica load report (the core section: the rest describe features this
        server does not have)."""
        sections = {p.strip() for p in include.split(",") if p.strip()}
        unknown = sorted(sections - set(LOAD_SECTIONS))
        if unknown:
            raise ApiError(
                f"include: unknown section(s) {', '.join(unknown)}; known: {', '.join(LOAD_SECTIONS)}", "include"
            )
        entries = load_entries(frontend, info["max_running_requests"], sections)
        return {"timestamp": datetime.now(timezone.utc).isoformat(), "dp_rank_count": len(entries), "loads": entries}

    refused = {"model": ErrorResponse, "description": "A running request holds cached pages: nothing flushed there"}

    @app.post("/flush_cache", responses={**openapi_doc.errors(503), 409: refused})
    async def flush_cache() -> dict[str, Any]:
        """Empties every replica's prefix cache; 409 (nothing flushed where refused) while a
        running request holds cached pages."""
        if frontend.dead is not None:
            raise ApiError(frontend.dead, None, 503, kind="server_error")
        replies = sorted(await flusher.flush(), key=lambda r: r.dp_rank)
        refused = [f"replica {r.dp_rank}: {r.refused}" for r in replies if r.refused is not None]
        if refused:
            done = [str(r.dp_rank) for r in replies if r.refused is None]
            flushed = f" (flushed: replica {', '.join(done)})" if done else ""
            raise ApiError(f"cache not flushed: {'; '.join(refused)}{flushed}", None, 409, "cache_in_use")
        return {"status": "ok", "message": f"prefix cache flushed on {len(replies)} replica(s)"}
