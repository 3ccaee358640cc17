"""Soak: N random requests against any OpenAI-compatible server, then nothing may be left behind.

    python benchmarks/soak.py --url http://127.0.0.1:8000 --requests 10000 --concurrency 32 --pid SERVER_PID

The requests: chat and completions, streamed and not, random prompts, max_tokens, n and
temperature; --cancel-share of them (a third by default) are cancelled (the client hangs up
after a random share of a typical request's time, or a stream after its first events), at
any point of their life: tokenizing, queued, generating. --concurrency clients keep that
many in flight (a refused one waits as its Retry-After says). Afterwards the server must
report 0 running and 0 waiting requests and no KV slot held by a request (the prefix cache
may keep what it caches), read from /metrics (minisgl's names, else vLLM's or SGLang's where
they exist), and no 5xx but the 503 refusals for load (`server_overloaded`). Exit status 1
if anything is left behind or any other 5xx or connection error came.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import re
import sys
import time
from collections import Counter
from typing import Any

from raw_http import Reply, percentile, request, spread, tree_rss_mb

WORDS = (
    "the river runs past an old mill where seven cats sleep in the warm light of a slow autumn "
    "afternoon while engineers debate queues caches and the price of bread"
).split()
# What each server calls the numbers a soak must see at zero: running, waiting, KV used by requests.
GAUGES = {
    "running": ("minisgl_num_requests_running", "vllm:num_requests_running", "sglang:num_running_reqs"),
    "waiting": ("minisgl_num_requests_waiting", "vllm:num_requests_waiting", "sglang:num_queue_reqs"),
    "kv_used": ("minisgl_kv_slots_used", "vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc", "sglang:token_usage"),
}


def make_request(
    rng: random.Random, model: str, max_tokens: int, temperatures: tuple[float, ...], cancel_share: float = 1 / 3
) -> tuple[str, dict[str, Any], dict[str, Any]]:
    """(path, body, how the client behaves): one random request."""
    text = " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 60)))
    stream = rng.random() < 0.5
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": rng.randint(1, max_tokens),
        "stream": stream,
        "temperature": rng.choice(temperatures),
        "n": rng.choice((1, 1, 1, 2)),
    }
    if rng.random() < 0.5:
        path, body["messages"] = "/v1/chat/completions", [{"role": "user", "content": text}]
    else:
        path, body["prompt"] = "/v1/completions", text
    how: dict[str, Any] = {}
    if rng.random() < cancel_share:  # cancelled: somewhere between sending and the end
        if stream and rng.random() < 0.5:
            how["cancel_events"] = rng.randint(1, 3)
        else:  # a share of a typical request's time (see `run`), so that it lands mid-flight
            how["cancel_share"] = rng.uniform(0.0, 1.0)
    return path, body, how


async def metrics(url: str) -> dict[str, float | None]:
    text = (await request("GET", url, "/metrics", timeout=30)).body.decode(errors="replace")
    out: dict[str, float | None] = {}
    for key, names in GAUGES.items():
        out[key] = None
        for name in names:
            m = re.search(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M)
            if m:
                out[key] = float(m.group(1))
                break
    return out


async def settle(url: str, timeout: float = 30.0) -> dict[str, float | None]:
    """The gauges once running, waiting and KV used all read 0 (or what they read at `timeout`)."""
    deadline = time.monotonic() + timeout
    while True:
        g = await metrics(url)
        if all(not v for v in g.values()) or time.monotonic() > deadline:
            return g
        await asyncio.sleep(0.2)


async def run(
    url: str,
    requests: int,
    concurrency: int,
    seed: int = 0,
    max_tokens: int = 32,
    pid: int | None = None,
    model: str | None = None,
    progress: bool = False,
    temperatures: tuple[float, ...] = (0.0, 0.7),
    cancel_share: float = 1 / 3,
) -> dict[str, Any]:
    rng = random.Random(seed)
    if model is None:
        model = (await request("GET", url, "/v1/models")).json()["data"][0]["id"]
    plan = [make_request(rng, model, max_tokens, temperatures, cancel_share) for _ in range(requests)]
    results: list[tuple[dict[str, Any], Reply]] = []
    rss: list[tuple[float, float]] = []
    start = time.monotonic()
    todo = iter(plan)

    typical: list[float] = [0.2]  # the latest whole requests' times (s)

    async def client() -> None:
        for path, body, how in todo:
            kw = dict(how)
            if "cancel_share" in kw:
                kw["cancel_after"] = kw.pop("cancel_share") * percentile(typical[-50:], 50)
            reply = await request("POST", url, path, body, timeout=600, **kw)
            results.append((how, reply))
            if not how and reply.status == 200:
                typical.append(reply.t_end)
            if reply.status in (429, 503):  # as a well-behaved client does (the openai client, too)
                await asyncio.sleep(min(5.0, float(reply.headers.get("retry-after", 1))))
            if progress and len(results) % 1000 == 0:
                print(f"  {len(results)} requests, {time.monotonic() - start:.0f} s", file=sys.stderr)
            if pid is not None and len(results) % 100 == 0:
                rss.append((time.monotonic() - start, tree_rss_mb(pid)))

    if pid is not None:
        rss.append((0.0, tree_rss_mb(pid)))
    await asyncio.gather(*[client() for _ in range(concurrency)])
    duration = time.monotonic() - start
    after = await settle(url)
    if pid is not None:
        rss.append((time.monotonic() - start, tree_rss_mb(pid)))
    return summarize(results, after, rss, duration)


def summarize(
    results: list[tuple[dict[str, Any], Reply]],
    after: dict[str, float | None],
    rss: list[tuple[float, float]],
    duration: float,
) -> dict[str, Any]:
    cancelled = [r for how, r in results if how]
    whole = [r for how, r in results if not how]

    def refused(r: Reply) -> bool:  # minisgl's codes; another server's 503 with the same type
        return r.status == 503 and r.error_code in ("queue_full", "queue_tokens", "queue_timeout", "server_overloaded")

    overloaded = [r for _, r in results if refused(r)]
    # A 5xx whose body the client did not wait for (it hung up) cannot be told apart: not counted.
    unexpected = [r for _, r in results if r.status >= 500 and r.complete and not refused(r)]
    stream_errors = [r for _, r in results if r.status == 200 and any('"error"' in e for e in r.events)]
    return {
        "requests": len(results),
        "duration_s": duration,
        "cancel_asked": len(cancelled),
        "cancelled": sum(r.cancelled for r in cancelled),
        "status": {str(k): v for k, v in sorted(Counter(r.status for _, r in results).items())},
        "refused_503": len(overloaded),
        "unexpected_5xx": len(unexpected) + len(stream_errors),
        "client_errors": [r.error for _, r in results if r.error][:5],
        "num_client_errors": sum(bool(r.error) for _, r in results),
        "first_unexpected": (unexpected + stream_errors)[0].body.decode(errors="replace")[:300]
        if unexpected or stream_errors
        else None,
        "e2e_s": spread([r.t_end for r in whole if r.status == 200]),
        # Streams only: a stream's first event is its first token (the status line may come first).
        "ttft_s": spread([r.t_first_event for r in whole if r.status == 200 and r.t_first_event]),
        "after": after,
        "rss_mb": rss,
    }


def problems(s: dict[str, Any]) -> list[str]:
    out = []
    for key, value in s["after"].items():
        if value:
            out.append(f"{key} is {value:g} after the soak, not 0")
    if s["unexpected_5xx"]:
        out.append(f"{s['unexpected_5xx']} answers were 5xx other than 503 refusals: {s['first_unexpected']}")
    if s["num_client_errors"]:
        out.append(f"{s['num_client_errors']} connection errors: {s['client_errors']}")
    return out


def print_report(s: dict[str, Any]) -> None:
    rss = [m for _, m in s["rss_mb"]]
    print(f"\nsoak: {s['requests']} requests in {s['duration_s']:.1f} s ({s['requests'] / s['duration_s']:.1f} req/s)")
    print(f"  status codes: {s['status']}  (0: hung up before the status line)")
    print(f"  cancellations asked {s['cancel_asked']}, the client hung up on {s['cancelled']} (the others ended first)")
    print(
        f"  503 refusals for load {s['refused_503']}, other 5xx or error events {s['unexpected_5xx']}, "
        f"connection errors {s['num_client_errors']}"
    )
    e2e, ttft = s["e2e_s"], s["ttft_s"]
    print(
        f"  whole requests answered: e2e p50 {e2e['p50']:.2f} s, p99 {e2e['p99']:.2f} s; "
        f"streams' TTFT p50 {ttft['p50']:.2f} s, p99 {ttft['p99']:.2f} s"
    )
    print("  after: " + ", ".join(f"{k} {'n/a' if v is None else f'{v:g}'}" for k, v in s["after"].items()))
    if rss:
        print(f"  server RSS (MB): start {rss[0]:.0f}, peak {max(rss):.0f}, end {rss[-1]:.0f}")
    for p in problems(s):
        print(f"  PROBLEM: {p}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--requests", type=int, default=1000)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--max-tokens", type=int, default=32, help="each request asks for 1 to this many tokens")
    p.add_argument("--pid", type=int, default=None, help="the server's process id: its tree's RSS is sampled")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--temperatures", type=float, nargs="+", default=[0.0, 0.7], help="each request takes one of these")
    p.add_argument("--cancel-share", type=float, default=1 / 3, help="share of the requests the client cancels")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args()
    if not 0 <= args.cancel_share <= 1:
        p.error(f"--cancel-share must be between 0 and 1, got {args.cancel_share}")
    s = asyncio.run(
        run(
            args.url,
            args.requests,
            args.concurrency,
            args.seed,
            args.max_tokens,
            args.pid,
            args.model,
            progress=True,
            temperatures=tuple(args.temperatures),
            cancel_share=args.cancel_share,
        )
    )
    print_report(s)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)
    sys.exit(1 if problems(s) else 0)


if __name__ == "__main__":
    main()
