"""Overload against the real server (tiny random model, CPU, a KV pool for about two requests),
through benchmarks/overload.py and benchmarks/soak.py themselves: refusals come at once and
the rest is served, no client waits past --max-queue-wait-s and a step, memory stays bounded,
the official openai client sees the 503 and honours Retry-After, and a 1,000-request soak with
cancellations leaves nothing behind. The drain on SIGTERM: tests/test_drain.py."""

from __future__ import annotations

import asyncio
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from server_harness import Server, metric, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
import overload  # noqa: E402
import soak  # noqa: E402
from raw_http import request, tree_rss_mb  # noqa: E402

pytestmark = pytest.mark.slow
PROMPT = 400  # tokens: with --num-pages 900 the pool holds two such requests with their answers
POOL = ["--num-pages", "900", "--max-prefill-tokens", "512", "--num-tokenizers", "1"]


@pytest.fixture(scope="module")
def one_thread() -> Iterator[None]:
    # The scheduler's torch takes one core; the API server, tokenizer and clients the other.
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("OMP_NUM_THREADS", "1")
        yield


def bounded_server(model: Path, folder: Path, max_queued: str, max_wait_s: str) -> Server:
    """The small pool with the queue bounded by count (--max-queued-requests) or by wait."""
    return Server("--model", str(model), *POOL, "--max-queued-requests", max_queued, "--max-queued-tokens", "0",
                  "--max-queue-wait-s", max_wait_s, cwd=folder)


@pytest.fixture(scope="module")
def server(greedy_llama: Path, one_thread: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = bounded_server(greedy_llama, tmp_path_factory.mktemp("overload"), "20", "0")
    yield s
    s.stop()


def settled(url: str) -> dict:
    return asyncio.run(soak.settle(url))


def test_200_at_once_20_queued_the_rest_refused_at_once(server: Server) -> None:
    assert "--max-queued-requests 20" in server.output  # the bounds in force are printed at startup
    url, pid = server.url, server.proc.pid
    rss = []
    for seed in range(2):
        s = asyncio.run(overload.run(url, 200, PROMPT, 16, pid=pid, seed=seed))
        overload.print_report(s)
        assert set(s["status"]) <= {"200", "503"}, s["status"]
        assert 170 <= s["status"]["503"] <= 185 and s["refusal_codes"] == {"queue_full": s["status"]["503"]}
        assert s["refused_s"]["max"] < 1.0  # every refusal within 1 s of sending
        assert s["retry_after"] == ["1"] and s["health_ms"]["not_200"] == 0
        assert settled(url) == {"running": 0, "waiting": 0, "kv_used": 0}
        rss.append(tree_rss_mb(pid))
    assert rss[1] - rss[0] < 50, rss  # a second burst costs no more memory than the first left
    http = httpx.Client(base_url=url)
    assert metric(http, "minisgl_requests_refused_total", '{reason="queue_full"}') >= 340


def fill_queue(url: str, n: int, seconds: float) -> threading.Thread:
    """`n` requests in the background, each hanging up after `seconds`."""
    body = {"prompt": "hello", "max_tokens": 8, "stream": True}

    async def go() -> None:
        await asyncio.gather(*[request("POST", url, "/v1/completions", body, cancel_after=seconds) for _ in range(n)])

    t = threading.Thread(target=asyncio.run, args=(go(),), daemon=True)
    t.start()
    return t


def test_openai_client_sees_the_503_and_honours_retry_after(server: Server) -> None:
    # The scheduler is stopped meanwhile, so the queue cannot move: the API refuses on its own.
    scheduler = int(re.search(r"scheduler ready \(pid (\d+)\)", server.output).group(1))
    http = httpx.Client(base_url=server.url)
    os.kill(scheduler, signal.SIGSTOP)
    try:
        filler = fill_queue(server.url, 25, 8.0)
        assert wait_for(lambda: metric(http, "minisgl_queued_generations") == 20, 10)
        bare = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.InternalServerError) as e:
            bare.completions.create(model="m", prompt="hello", max_tokens=2)
        assert e.value.status_code == 503 and e.value.response.headers["retry-after"] == "1"
        assert e.value.body["type"] == "server_overloaded" and e.value.body["code"] == "queue_full"
        sent: list[float] = []
        hooks = {"request": [lambda _: sent.append(time.monotonic())]}
        retrying = openai.OpenAI(
            base_url=f"{server.url}/v1", api_key="unused", max_retries=2, http_client=httpx.Client(event_hooks=hooks)
        )
        with pytest.raises(openai.InternalServerError):
            retrying.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], max_tokens=2)
        # Three tries, each after the server's Retry-After (1 s); without it the client would
        # wait 0.5 s, then 1 s, less its jitter.
        gaps = [b - a for a, b in zip(sent, sent[1:])]
        assert len(sent) == 3 and all(g >= 0.95 for g in gaps), gaps
    finally:
        os.kill(scheduler, signal.SIGCONT)
    filler.join(30)
    assert settled(server.url) == {"running": 0, "waiting": 0, "kv_used": 0}


def test_soak_1000_requests_with_cancellations(server: Server) -> None:
    before = metric(httpx.Client(base_url=server.url), "minisgl_requests_refused_total", '{reason="queue_full"}')
    s = asyncio.run(soak.run(server.url, 1000, 24, seed=1, max_tokens=16, pid=server.proc.pid, temperatures=(0.0,)))
    soak.print_report(s)
    assert soak.problems(s) == []
    assert s["after"] == {"running": 0, "waiting": 0, "kv_used": 0}
    assert s["cancelled"] >= 150  # the client hung up mid-flight on most of the third it meant to
    assert int(s["status"].get("200", 0)) >= 500
    after = metric(httpx.Client(base_url=server.url), "minisgl_requests_refused_total", '{reason="queue_full"}')
    # Every 503 the clients read was a refusal asked for (the queue's bound; problems() checks
    # their codes); a few more went to clients that hung up before reading them.
    assert s["refused_503"] <= after - before <= s["refused_503"] + s["cancelled"]
    assert server.proc.poll() is None


@pytest.fixture(scope="module")
def waiting_server(greedy_llama: Path, one_thread: None, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    s = bounded_server(greedy_llama, tmp_path_factory.mktemp("wait"), "0", "5")
    yield s
    s.stop()


def test_no_client_waits_past_the_queue_wait_bound(waiting_server: Server) -> None:
    # Two run at a time, 300 tokens each: the 60 take far longer than 5 s on any CPU.
    url = waiting_server.url
    body = {"prompt": list(range(100, 164)), "max_tokens": 300, "ignore_eos": True, "stream": True}

    async def go() -> list:
        return await asyncio.gather(
            *[request("POST", url, "/v1/completions", {**body, "prompt": [i, *body["prompt"]]}) for i in range(60)]
        )

    replies = asyncio.run(go())
    served = [r for r in replies if r.status == 200]
    refused = [r for r in replies if r.status == 503]
    assert len(served) + len(refused) == 60 and served and refused, [r.status for r in replies]
    assert all(r.error_code == "queue_timeout" and r.headers["retry-after"] == "1" for r in refused)
    # The answer (a stream's status comes with its first token) or the refusal: within the
    # bound plus a step, which on this model is milliseconds (a margin for a loaded CI machine).
    waits = sorted(r.t_status for r in replies)
    assert waits[-1] < 5.0 + 1.0, waits[-5:]
    assert min(r.t_status for r in refused) > 4.5
    assert all(r.events[-1] == "[DONE]" and '"error"' not in "".join(r.events) for r in served)
    assert settled(url) == {"running": 0, "waiting": 0, "kv_used": 0}
    http = httpx.Client(base_url=url)
    assert metric(http, "minisgl_requests_refused_total", '{reason="queue_timeout"}') == len(refused)
