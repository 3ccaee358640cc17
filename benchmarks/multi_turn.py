"""Multi-turn chat benchmark for the host KV tier (issue 40): conversations that resend their
growing history, against a running server's SGLang-style /generate (token-id prompts).

    # Qwen3-8B shapes: 144 KiB of bf16 KV per token; 64 conversations end near 4,000 tokens
    # each (256k tokens, about 38 GB), so 64,000 pages of 1 token hold about a quarter.
    # Two servers, one at a time on the GPU, same pool cap, tier off and on:
    python -m minisgl.serve --model benchmarks/configs/qwen3-8b --load-format dummy \
        --tokenizer QWEN3_TOKENIZER --num-pages 64000 --port 8000
    python -m minisgl.serve ... --num-pages 64000 --host-kv-cache-gb 48 --port 8001
    python benchmarks/multi_turn.py --base-url http://127.0.0.1:8000 --label off
    python benchmarks/multi_turn.py --base-url http://127.0.0.1:8001 --label on --pcie

Each of --conversations users runs --turns turns: the prompt is the whole history plus
--user-tokens new random tokens, the server generates --output-tokens (greedy, ignore_eos), and
both join the history; then the user thinks for an exponential --think-time (mean, seconds)
before the next turn. Reported: TTFT p50/p99 (client clock, request sent -> first streamed
chunk), output throughput, prompt tokens served from the prefix cache (meta_info.cached_tokens:
either tier; the host tier's own hit count is not exported yet), and with --pcie the
host-to-device copy ceiling of this machine (one pinned cudaMemcpy of --pcie-gb GB).
Working set: conversations * turns * (user + output) tokens * the model's KV bytes per token.
(Written without a GPU; not yet run: see README "Host KV tier".)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from typing import Any

import httpx
import numpy as np


async def turn(client: httpx.AsyncClient, ids: list[int], out_len: int) -> dict[str, Any]:
    body = {"input_ids": ids, "stream": True,
            "sampling_params": {"max_new_tokens": out_len, "temperature": 0.0, "ignore_eos": True}}
    start = time.perf_counter()
    ttft, last = None, None
    async with client.stream("POST", "/generate", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode()[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            data = json.loads(line[6:])
            if ttft is None and data.get("output_ids"):
                ttft = time.perf_counter() - start
            last = data
    if last is None or ttft is None:
        raise RuntimeError("the stream ended without tokens")
    return {"ttft": ttft, "output_ids": last["output_ids"], "cached": last["meta_info"]["cached_tokens"],
            "prompt": len(ids)}


async def conversation(client: httpx.AsyncClient, args: argparse.Namespace, seed: int) -> list[dict[str, Any]]:
    rng = random.Random(seed)
    history: list[int] = []
    out = []
    await asyncio.sleep(rng.uniform(0, args.think_time))  # users do not start at once
    for _ in range(args.turns):
        history += [rng.randrange(1000, args.vocab) for _ in range(args.user_tokens)]
        res = await turn(client, history, args.output_tokens)
        history += res["output_ids"]
        out.append(res)
        await asyncio.sleep(rng.expovariate(1.0 / args.think_time))
    return out


def pcie_ceiling(gb: float) -> float:
    import torch

    n = int(gb * 2**30)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    dev.copy_(host, non_blocking=True)  # warm-up
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(5):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize()
    return 5 * n / (time.perf_counter() - t0) / 1e9


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, timeout=None, limits=limits) as client:
        start = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, args, args.seed + i) for i in range(args.conversations)))
        duration = time.perf_counter() - start
    turns = [t for c in convs for t in c]
    later = [t for c in convs for t in c[1:]]  # turns that could reuse a history
    ttft = np.array([t["ttft"] for t in turns]) * 1000
    ttft_later = np.array([t["ttft"] for t in later]) * 1000
    return {
        "label": args.label, "turns": len(turns), "duration_s": round(duration, 2),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "later_turns_ttft_ms_p50": round(float(np.percentile(ttft_later, 50)), 1) if len(later) else None,
        "output_tok_s": round(sum(len(t["output_ids"]) for t in turns) / duration, 1),
        "cached_share": round(sum(t["cached"] for t in turns) / sum(t["prompt"] for t in turns), 3),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument("--label", default="")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--think-time", type=float, default=2.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--vocab", type=int, default=150000, help="random user tokens are drawn below this id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pcie", action="store_true", help="also measure the pinned host-to-device copy ceiling")
    p.add_argument("--pcie-gb", type=float, default=1.0)
    args = p.parse_args()
    result = asyncio.run(main_async(args))
    if args.pcie:
        result["pcie_h2d_gb_s"] = round(pcie_ceiling(args.pcie_gb), 1)
    print(json.dumps(result))


if __name__ == "__main__":
    main()
