"""Drain on SIGTERM (tiny random model, CPU): readiness off at once, new requests refused,
streams in flight finish (or, past --shutdown-timeout, end with an error event), every process
exits 0 and the IPC sockets go; a second signal stops at once; --dp replicas drain together."""

from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from server_harness import Server, alive, child_pids, metric, wait_for

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))
from raw_http import Reply, request  # noqa: E402

pytestmark = pytest.mark.slow
PROMPTS = [f"stream {i}: tell me about the sea and the mountains" for i in range(16)]


@pytest.fixture(autouse=True)
def one_thread(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")  # the scheduler on one core, the API server and clients beside it
    yield


class Streams:
    """`bodies` streamed in a background thread; `replies` once `join` returns."""

    def __init__(self, url: str, bodies: list[dict]) -> None:
        self.replies: list[Reply] = []

        extra = {"stream": True, "stream_options": {"include_usage": True}}

        async def go() -> None:
            self.replies = list(
                await asyncio.gather(*[request("POST", url, "/v1/completions", {**b, **extra}) for b in bodies])
            )

        self.thread = threading.Thread(target=asyncio.run, args=(go(),), daemon=True)
        self.thread.start()

    def join(self, timeout: float) -> list[Reply]:
        self.thread.join(timeout)
        assert not self.thread.is_alive(), "a stream did not end"
        return self.replies


def events(r: Reply) -> list[dict]:
    assert r.status == 200 and r.events[-1] == "[DONE]", (r.status, r.events[-3:], r.error)
    return [json.loads(e) for e in r.events[:-1]]


def sigterm_and_watch_health(s: Server) -> float:
    """SIGTERM, then /health until it answers 503: the seconds that took, from the signal."""
    http = httpx.Client(base_url=s.url, timeout=5)
    t0 = time.monotonic()
    s.proc.send_signal(signal.SIGTERM)
    while True:
        h = http.get("/health")
        if h.status_code == 503:
            assert h.json()["status"] == "draining" and "draining" in h.json()["reason"]
            return time.monotonic() - t0
        assert time.monotonic() - t0 < 5, "never 503"


def assert_stopped_clean(s: Server, kids: set[int], folder: str, code: int) -> None:
    assert code == 0, s.output[-3000:]
    assert "stopped" in s.output and "each with exit code 0" in s.output, s.output[-2000:]
    assert wait_for(lambda: not any(alive(p) for p in kids), 10)
    assert not Path(folder).exists()


def test_16_streams_finish_during_the_drain(greedy_llama: Path, tmp_path: Path) -> None:
    s = Server("--model", str(greedy_llama), "--num-tokenizers", "1", cwd=tmp_path)
    try:
        http = httpx.Client(base_url=s.url, timeout=60)
        folder = re.search(r"IPC sockets in (\S+)", s.output).group(1)
        kids = child_pids(s.proc.pid)
        bodies = [{"prompt": p, "max_tokens": 120, "ignore_eos": True} for p in PROMPTS]
        reference = [http.post("/v1/completions", json=b).json()["choices"][0]["text"] for b in bodies]
        streams = Streams(s.url, bodies)
        assert wait_for(lambda: metric(http, "minisgl_num_requests_running") == 16, 20)
        assert sigterm_and_watch_health(s) < 0.1
        refused = http.post("/v1/completions", json={"prompt": "late", "max_tokens": 2})
        assert refused.status_code == 503 and refused.headers["retry-after"] == "1"
        assert refused.json()["error"]["code"] == "draining"
        t0 = time.monotonic()
        for r, want in zip(streams.join(60), reference):
            evs = events(r)
            assert "".join(e["choices"][0]["text"] for e in evs if e["choices"]) == want
            assert [e["choices"][0]["finish_reason"] for e in evs if e["choices"]][-1] == "length"
            assert evs[-1]["usage"]["completion_tokens"] == 120
        assert_stopped_clean(s, kids, folder, s.wait_exit(30))
        assert time.monotonic() - t0 < 30  # within --shutdown-timeout (default 30 s)
        assert "drain: every request finished" in s.output
    finally:
        s.stop(signal.SIGKILL)


def per_replica(http: httpx.Client, name: str) -> list[float]:
    """`name` of replicas 0 and 1 (0 before a replica's first report)."""
    text = http.get("/metrics").text
    values = [re.search(rf'^{name}{{dp_rank="{r}"}} (\S+)$', text, re.M) for r in range(2)]
    return [float(m.group(1)) if m else 0.0 for m in values]


def test_dp_replicas_drain_together_and_the_timeout_cuts_with_an_error_event(
    greedy_llama: Path, tmp_path: Path
) -> None:
    s = Server(
        "--model", str(greedy_llama), "--dp", "2", "--num-tokenizers", "0", "--shutdown-timeout", "1", cwd=tmp_path
    )
    try:
        http = httpx.Client(base_url=s.url, timeout=60)
        folder = re.search(r"IPC sockets in (\S+)", s.output).group(1)
        kids = child_pids(s.proc.pid)
        # 8 streams that cannot finish within the second (400 tokens on a CPU), on both replicas,
        # then 8 that can (4 tokens), all in flight at the SIGTERM.
        long = Streams(s.url, [{"prompt": p, "max_tokens": 400, "ignore_eos": True} for p in PROMPTS[:8]])
        assert wait_for(lambda: all(per_replica(http, "minisgl_replica_num_requests_running")), 20)
        short = Streams(s.url, [{"prompt": p, "max_tokens": 4, "ignore_eos": True} for p in PROMPTS[8:]])
        assert wait_for(lambda: sum(per_replica(http, "minisgl_replica_requests_received_total")) == 16, 20)
        t0 = time.monotonic()
        sigterm_and_watch_health(s)
        cut, finished = long.join(30), short.join(30)
        assert_stopped_clean(s, kids, folder, s.wait_exit(30))
        assert time.monotonic() - t0 < 1 + 10  # the timeout, the HTTP server's close, the processes' stop
        for r in finished:
            assert events(r)[-1]["usage"]["completion_tokens"] == 4
        for r in cut:
            evs = events(r)
            assert "error" in evs[-1] and "--shutdown-timeout 1 s" in evs[-1]["error"]["message"]
            assert sum(len(e["choices"][0]["text"]) for e in evs[:-1] if e.get("choices")) > 0
        assert "drain: 8 generations unfinished after 1 s end with an error" in s.output
    finally:
        s.stop(signal.SIGKILL)


def test_a_second_signal_stops_at_once(greedy_llama: Path, tmp_path: Path) -> None:
    s = Server("--model", str(greedy_llama), "--num-tokenizers", "0", "--shutdown-timeout", "120", cwd=tmp_path)
    try:
        http = httpx.Client(base_url=s.url, timeout=60)
        folder = re.search(r"IPC sockets in (\S+)", s.output).group(1)
        kids = child_pids(s.proc.pid)
        streams = Streams(s.url, [{"prompt": p, "max_tokens": 400, "ignore_eos": True} for p in PROMPTS[:4]])
        assert wait_for(lambda: metric(http, "minisgl_num_requests_running") == 4, 20)
        sigterm_and_watch_health(s)
        time.sleep(0.3)
        t0 = time.monotonic()
        os.kill(s.proc.pid, signal.SIGINT)  # Ctrl-C during the drain
        assert_stopped_clean(s, kids, folder, s.wait_exit(15))
        assert time.monotonic() - t0 < 8  # not the 120 s drain: the HTTP server and the processes' stop
        assert "SIGINT: stopping at once; 4 generations in flight end with an error" in s.output
        for r in streams.join(10):  # cut: an error event, or the connection closed under it
            assert r.status == 200 and (r.error or any('"error"' in e for e in r.events))
    finally:
        s.stop(signal.SIGKILL)
