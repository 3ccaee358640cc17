"""Two minisgl servers behind the SGLang model gateway (SMG, `pip install smg`), as
tests/test_router.py runs them behind sglang-router 0.3.2: SMG registers them as SGLang HTTP
workers and reads their loads, routes traffic with its cache-aware and power-of-two policies,
and fans /flush_cache out to them."""

from __future__ import annotations

import asyncio
import importlib.util
import random
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
from router_harness import Router
from server_harness import Server, metric, wait_for

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("smg") is None, reason="needs `pip install smg` (1.13 or newer)"),
]
NAME = "tiny"
WORDS = ["alpha", "beta", "gamma", "delta", "river", "stone", "cloud", "paper"]
SMG = "smg.launch_router"


@pytest.fixture(scope="module")
def servers(tiny_model_path: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory) -> list[Server]:
    args = [
        "--model",
        str(tiny_model_path("llama3")),
        "--served-model-name",
        NAME,
        "--num-tokenizers",
        "0",
        "--page-size",
        "4",
    ]
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")  # two hosts' worth of servers on one machine (see test_router.py)
        started = [Server(*args, cwd=tmp_path_factory.mktemp(f"worker{i}"), wait_ready=False) for i in range(2)]
    for s in started:
        s.wait_ready(300)
    yield started
    for s in started:
        s.stop()


def _router(servers: list[Server], tmp: pytest.TempPathFactory, policy: str, *extra: str) -> Router:
    # Loads polled every second (SMG's default is 10 s): the power-of-two test waits for them.
    return Router(
        [s.url for s in servers],
        tmp.mktemp(policy) / "smg.log",
        "--policy",
        policy,
        "--load-monitor-interval",
        "1",
        *extra,
        module=SMG,
    )


@pytest.fixture(scope="module")
def cache_aware(servers: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Router:
    r = _router(servers, tmp_path_factory, "cache_aware")
    yield r
    r.stop()


@pytest.fixture(scope="module")
def power_of_two(servers: list[Server], tmp_path_factory: pytest.TempPathFactory) -> Router:
    r = _router(servers, tmp_path_factory, "power_of_two")
    yield r
    r.stop()


def _received(server: Server) -> float:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        return metric(c, "minisgl_replica_requests_received_total", '{dp_rank="0"}')


def _idle(server: Server) -> bool:
    with httpx.Client(base_url=server.url, timeout=30) as c:
        return c.get("/v1/loads").json()["loads"][0]["num_total_reqs"] == 0


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _traffic(url: str, bodies: list[dict], concurrency: int) -> list[tuple[int, int]]:
    """Each body through the openai client (completions), `concurrency` at a time: (status,
    completion tokens or 0)."""

    async def run() -> list[tuple[int, int]]:
        sem = asyncio.Semaphore(concurrency)
        async with openai.AsyncOpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=300) as oai:

            async def one(body: dict) -> tuple[int, int]:
                async with sem:
                    try:
                        out = await oai.completions.create(**body, extra_body={"ignore_eos": True})
                    except openai.APIStatusError as e:
                        return e.status_code, 0
                    return 200, out.usage.completion_tokens

            return await asyncio.gather(*(one(b) for b in bodies))

    return asyncio.run(run())


def test_smg_registers_sglang_workers_and_reads_their_loads(cache_aware: Router, servers: list[Server]) -> None:
    workers = cache_aware.workers()
    assert sorted(w["url"] for w in workers) == sorted(s.url for s in servers)
    for w in workers:
        # /v1/models owned_by "sglang" makes it an SGLang HTTP worker, /server_info names the model.
        assert (w["runtime_type"], w["model_id"], w["connection_mode"]) == ("sglang", NAME, "http"), w
    assert [m["id"] for m in cache_aware.http.get("/v1/models").json()["data"]] == [NAME]

    def loads_read() -> bool:  # its load monitor has polled both servers' /v1/loads
        loads = cache_aware.http.get("/get_loads").json()["loads"]
        return len(loads) == 2 and all(e["max_total_num_tokens"] > 0 for e in loads)

    assert wait_for(loads_read, 30), cache_aware.http.get("/get_loads").text


@pytest.mark.parametrize("policy", ["cache_aware", "power_of_two"])
def test_traffic_through_each_policy(policy: str, request: pytest.FixtureRequest, servers: list[Server]) -> None:
    router: Router = request.getfixturevalue(policy)
    rng = random.Random(policy)
    bodies = [
        {"model": NAME, "prompt": _text(rng, rng.randint(2, 30)), "max_tokens": rng.randint(1, 5)} for _ in range(60)
    ]
    before = [_received(s) for s in servers]
    results = _traffic(router.url, bodies, concurrency=12)
    assert results == [(200, b["max_tokens"]) for b in bodies]
    got = [_received(s) - b for s, b in zip(servers, before)]
    assert sum(got) == 60 and min(got) >= 5, got


def test_cache_aware_keeps_a_long_shared_prefix_on_one_server(cache_aware: Router, servers: list[Server]) -> None:
    shared = _text(random.Random(1), 60)
    before = [_received(s) for s in servers]
    for i in range(6):  # one after another, so the servers' loads stay balanced
        r = cache_aware.http.post("/v1/completions", json={"model": NAME, "prompt": f"{shared} q{i}", "max_tokens": 2})
        assert r.status_code == 200, r.text
    got = [_received(s) - b for s, b in zip(servers, before)]
    assert sorted(got) == [0, 6], got


def test_power_of_two_avoids_the_loaded_server(power_of_two: Router, servers: list[Server]) -> None:
    """Server 0 decodes twelve long requests sent to it directly; once SMG's monitor has read that from
    its /v1/loads, every request through the power-of-two router goes to server 1."""
    busy, idle = servers
    streams = [
        openai.OpenAI(base_url=f"{busy.url}/v1", api_key="x", max_retries=0).completions.create(
            model=NAME, prompt=_text(random.Random(i), 40), max_tokens=400, stream=True, extra_body={"ignore_eos": True}
        )
        for i in range(12)
    ]
    for s in streams:
        next(iter(s))

    def seen_busy() -> bool:
        loads = {e["worker"]: e for e in power_of_two.http.get("/get_loads").json()["loads"]}
        return loads[busy.url]["num_running_reqs"] >= 12 and loads[idle.url]["num_running_reqs"] == 0

    assert wait_for(seen_busy, 30), power_of_two.http.get("/get_loads").text
    before = [_received(s) for s in servers]
    for i in range(8):
        r = power_of_two.http.post("/v1/completions", json={"model": NAME, "prompt": f"short {i}", "max_tokens": 2})
        assert r.status_code == 200, r.text
    assert [_received(s) - b for s, b in zip(servers, before)] == [0, 8]
    for s in streams:
        s.close()  # the server aborts them once it sees the connections close
    assert wait_for(lambda: _idle(busy), 30)


def test_flush_cache_through_smg(cache_aware: Router, servers: list[Server]) -> None:
    """SMG fans the flush out to both servers; it reports success only if both said 200."""
    assert wait_for(lambda: all(_idle(s) for s in servers), 30)  # a running request would hold cached pages
    r = cache_aware.http.post("/flush_cache")
    assert r.status_code == 200 and r.json()["workers_flushed"] == 2, r.text + servers[0].output[-3000:]
    prompt = _text(random.Random(7), 30)
    with httpx.Client(base_url=servers[0].url, timeout=60) as c:
        body = {"model": NAME, "prompt": prompt, "max_tokens": 1}
        c.post("/v1/completions", json=body)
        assert c.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
        assert cache_aware.http.post("/flush_cache").status_code == 200
        assert c.post("/v1/completions", json=body).json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
