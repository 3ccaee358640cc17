"""Overload benchmark: C clients send at the same moment to any OpenAI-compatible server.

    python benchmarks/overload.py --url http://127.0.0.1:8000 --clients 100 --prompt-tokens 1500 \
        --max-tokens 16 --pid SERVER_PID

Each client sends one /v1/completions request (a prompt of --prompt-tokens random token ids,
different per client so no prefix cache helps; --max-tokens tokens, EOS ignored) and waits for
the whole answer or a refusal. Meanwhile /health is polled every 0.2 s, and with --pid the
resident memory of that process and its descendants is sampled every second. Printed: the
status codes (with the OpenAI error codes of refusals), time to answer and time to refusal
(p50 / p99 / max, from the client's clock), /health latency, and RSS over time. A server that
queues without bound answers everyone late; one with a bounded queue refuses the excess at
once (503 + Retry-After) and answers the rest about as fast as when it is just saturated.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from collections import Counter
from typing import Any

from raw_http import request, spread, tree_rss_mb


async def run(
    url: str,
    clients: int,
    prompt_tokens: int,
    max_tokens: int,
    pid: int | None = None,
    seed: int = 0,
    model: str | None = None,
    timeout: float = 3600.0,
) -> dict[str, Any]:
    rng = random.Random(seed)
    if model is None:
        model = (await request("GET", url, "/v1/models")).json()["data"][0]["id"]
    rss: list[tuple[float, float]] = []
    health: list[tuple[int, float]] = []
    done = asyncio.Event()
    start = time.monotonic()

    async def sample() -> None:
        while not done.is_set():
            if pid is not None:
                rss.append((time.monotonic() - start, tree_rss_mb(pid)))
            try:
                await asyncio.wait_for(done.wait(), 1.0)
            except asyncio.TimeoutError:
                pass

    async def poll_health() -> None:
        while not done.is_set():
            h = await request("GET", url, "/health", timeout=30)
            health.append((h.status, h.t_end))
            await asyncio.sleep(0.2)

    def body() -> dict[str, Any]:
        prompt = [rng.randrange(100, 10000) for _ in range(prompt_tokens)]
        return {"model": model, "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True, "temperature": 0}

    bodies = [body() for _ in range(clients)]
    side = [asyncio.ensure_future(sample()), asyncio.ensure_future(poll_health())]
    replies = await asyncio.gather(*[request("POST", url, "/v1/completions", b, timeout=timeout) for b in bodies])
    done.set()
    await asyncio.gather(*side)
    return summarize(replies, health, rss, time.monotonic() - start)


def summarize(
    replies: list[Any], health: list[tuple[int, float]], rss: list[tuple[float, float]], duration: float
) -> dict[str, Any]:
    statuses = Counter(r.status for r in replies)
    codes = Counter(r.error_code for r in replies if r.status not in (0, 200))
    answered = [r.t_end for r in replies if r.status == 200]
    refused = [r.t_end for r in replies if r.status == 503]

    return {
        "clients": len(replies),
        "duration_s": duration,
        "status": {str(k): v for k, v in sorted(statuses.items())},
        "refusal_codes": dict(codes),
        "errors": [r.error for r in replies if r.error][:5],
        "answered_s": spread(answered),
        "refused_s": spread(refused),
        "retry_after": sorted({r.headers.get("retry-after", "-") for r in replies if r.status == 503}),
        "health_ms": {
            **{k: v * 1000 for k, v in spread([t for _, t in health]).items()},
            "polls": len(health),
            "not_200": sum(s != 200 for s, _ in health),
        },
        "rss_mb": rss,
    }


def print_report(s: dict[str, Any], label: str = "") -> None:
    a, r, h = s["answered_s"], s["refused_s"], s["health_ms"]
    rss = [m for _, m in s["rss_mb"]]
    print(f"\noverload{': ' + label if label else ''}: {s['clients']} clients at once, {s['duration_s']:.1f} s")
    print(
        f"  status codes: {s['status']}  refusals by code: {s['refusal_codes'] or '-'}  "
        f"Retry-After: {', '.join(s['retry_after']) or '-'}"
    )
    print(f"  time to answer  (s): p50 {a['p50']:.2f}  p99 {a['p99']:.2f}  max {a['max']:.2f}")
    print(f"  time to refusal (s): p50 {r['p50']:.3f}  p99 {r['p99']:.3f}  max {r['max']:.3f}")
    print(
        f"  /health (ms): p50 {h['p50']:.1f}  p99 {h['p99']:.1f}  max {h['max']:.1f}  "
        f"({h['polls']} polls, {h['not_200']} not 200)"
    )
    if rss:
        step = max(1, len(rss) // 8)
        series = " ".join(f"{t:.0f}s:{m:.0f}" for t, m in s["rss_mb"][::step])
        print(f"  server RSS (MB): start {rss[0]:.0f}, peak {max(rss):.0f}, end {rss[-1]:.0f}   [{series}]")
    for e in s["errors"]:
        print(f"  client error: {e}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--clients", type=int, default=100, help="clients, each sending one request at the same moment")
    p.add_argument("--prompt-tokens", type=int, default=1500)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--pid", type=int, default=None, help="the server's process id: its tree's RSS is sampled")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--label", default="", help="a name for this run in the report")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args()
    s = asyncio.run(run(args.url, args.clients, args.prompt_tokens, args.max_tokens, args.pid, args.seed, args.model))
    print_report(s, args.label)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
