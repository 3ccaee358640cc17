"""Two minisgl servers behind sglang-router (`pip install sglang-router==0.3.2`), all started
here: traffic through the router, cache-aware routing, a worker removed while traffic flows,
and a worker killed mid-run."""

from __future__ import annotations

import asyncio
import importlib.util
import os
import random
import signal
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from router_harness import Router
from server_harness import Server, alive, child_pids, metric, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(
        importlib.util.find_spec("sglang_router") is None, reason="needs `pip install sglang-router==0.3.2`"
    ),
]
NAME = "tiny"
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper"]


@pytest.fixture(scope="module")
def servers(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> list[Server]:
    args = ["--model", str(tiny_model_path("llama3")), "--served-model-name", NAME, "--num-tokenizers", "0"]
    with pytest.MonkeyPatch.context() as mp:
        # Two hosts' worth of servers on this one machine: each gets one core's thread, as
        # `--dp 2` gives its replicas (minisgl/distributed/placement.py), not a thread per core each.
        mp.setenv("OMP_NUM_THREADS", "1")
        started = [Server(*args, cwd=tmp_path_factory.mktemp(f"worker{i}"), wait_ready=False) for i in range(2)]
    for s in started:
        s.wait_ready(300)
    yield started
    for s in started:
        s.stop()  # a no-op for the one the last test killed


@pytest.fixture(scope="module")
def router(servers: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Router:
    # Health checks every second, and a worker that fails 3 requests is taken out of rotation
    # (circuit breaker): a dead worker stops getting traffic within a second or three.
    r = Router(
        [s.url for s in servers], tmp_path_factory.mktemp("router") / "router.log",
        "--policy", "cache_aware", "--health-check-interval-secs", "1", "--health-failure-threshold", "1",
        "--cb-failure-threshold", "3",
    )
    yield r
    r.stop()


def _received(server: Server) -> float:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        return metric(c, "minisgl_replica_requests_received_total", '{dp_rank="0"}')


def _job(i: int, rng: random.Random) -> tuple[str, dict[str, Any], int]:
    """One request of a route in turn: (route, body, tokens it must generate)."""
    n = rng.randint(1, 5)
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 30)))
    if i % 3 == 0:
        return "/v1/completions", {"model": NAME, "prompt": text, "max_tokens": n}, n
    if i % 3 == 1:
        return "/v1/chat/completions", {"model": NAME, "messages": [{"role": "user", "content": text}],
                                        "max_tokens": n}, n
    return "/generate", {"text": text, "sampling_params": {"max_new_tokens": n, "ignore_eos": True}}, n


def _traffic(url: str, jobs: list, concurrency: int, after: tuple[int, Callable[[], Any]] | None = None) -> list:
    """Runs `jobs` at `concurrency` (the OpenAI routes through the openai client, /generate with
    httpx); `after = (k, action)` calls action once k requests are done. Returns (status,
    generated tokens or the error) per job."""
    done = 0

    async def run() -> list:
        sem = asyncio.Semaphore(concurrency)

        async def send(c: httpx.AsyncClient, oai: openai.AsyncOpenAI, path: str, body: dict) -> tuple[int, Any]:
            if path == "/generate":
                r = await c.post(path, json=body)
                return r.status_code, r.json()["meta_info"]["completion_tokens"] if r.status_code == 200 else r.text
            create = oai.completions.create if path == "/v1/completions" else oai.chat.completions.create
            try:
                out = await create(**body, extra_body={"ignore_eos": True})
            except openai.APIStatusError as e:
                return e.status_code, str(e)
            return 200, out.usage.completion_tokens

        async def one(c: httpx.AsyncClient, oai: openai.AsyncOpenAI, path: str, body: dict) -> tuple[int, Any]:
            nonlocal done
            async with sem:
                result = await send(c, oai, path, body)
            done += 1
            if after is not None and done == after[0]:
                after[1]()
            return result

        async with (
            httpx.AsyncClient(base_url=url, timeout=300) as c,
            openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as oai,
        ):
            return await asyncio.gather(*(one(c, oai, p, b) for p, b, _ in jobs))

    return asyncio.run(run())


def test_router_sees_the_model_name_and_loads(router: Router) -> None:
    assert [m["id"] for m in router.http.get("/v1/models").json()["data"]] == [NAME]  # from our /server_info
    loads = router.http.get("/get_loads").json()["workers"]
    assert len(loads) == 2 and all(w["load"] >= 0 for w in loads)  # from our /get_load (-1: unreadable)


def test_100_requests_through_the_router(router: Router, servers: list[Server]) -> None:
    before = [_received(s) for s in servers]
    rng = random.Random(0)
    jobs = [_job(i, rng) for i in range(100)]
    results = _traffic(router.url, jobs, concurrency=16)
    assert results == [(200, n) for _, _, n in jobs]
    got = [_received(s) - b for s, b in zip(servers, before)]
    assert sum(got) == 100 and min(got) >= 10, got


def test_cache_aware_routing_keeps_a_long_shared_prefix_on_one_server(router: Router, servers: list[Server]) -> None:
    rng = random.Random(1)
    shared = " ".join(rng.choice(WORDS) for _ in range(60))
    before = [_received(s) for s in servers]
    for i in range(6):  # one after another, so the servers' loads stay balanced
        body = {"model": NAME, "prompt": f"{shared} question {i}", "max_tokens": 2}
        r = router.http.post("/v1/completions", json=body)
        assert r.status_code == 200, r.text
    got = [_received(s) - b for s, b in zip(servers, before)]
    assert sorted(got) == [0, 6], got


def test_worker_removed_while_traffic_flows(router: Router, servers: list[Server]) -> None:
    victim = servers[1]
    wid = next(w["id"] for w in router.workers() if w["url"] == victim.url)
    rng = random.Random(2)
    jobs = [_job(i, rng) for i in range(40)]

    def remove() -> None:
        assert httpx.delete(f"{router.url}/workers/{wid}", timeout=30).status_code < 300

    results = _traffic(router.url, jobs, concurrency=8, after=(10, remove))
    assert results == [(200, n) for _, _, n in jobs]
    assert wait_for(lambda: len(router.workers()) == 1, 30)
    before = _received(victim)
    assert _traffic(router.url, jobs[:10], concurrency=4) == [(200, n) for _, _, n in jobs[:10]]
    assert _received(victim) == before  # none reached the removed worker
    # Back in rotation for the next test.
    assert httpx.post(f"{router.url}/workers", json={"url": victim.url}, timeout=30).status_code < 300
    assert router.wait_workers(2, 60)


def test_killed_worker_mid_run_the_router_routes_the_rest_to_the_other(
    router: Router, servers: list[Server]
) -> None:
    victim, survivor = servers[1], servers[0]
    kids = child_pids(victim.proc.pid)
    rng = random.Random(3)
    jobs = [_job(i, rng) for i in range(40)]
    before = _received(survivor)
    results = _traffic(router.url, jobs, concurrency=8, after=(10, lambda: os.kill(victim.proc.pid, signal.SIGKILL)))
    # Requests in flight on the dead worker fail there and are retried on the other.
    assert results == [(200, n) for _, _, n in jobs], router.output[-3000:]
    assert _received(survivor) - before >= 30
    assert wait_for(lambda: not any(alive(p) for p in kids), 15)  # its processes died with it
    assert wait_for(lambda: not next(w for w in router.workers() if w["url"] == victim.url)["is_healthy"], 15)
