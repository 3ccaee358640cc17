"""Latency against a running server, in one run, through the official `openai` client
(streamed completions):

1. sequential: one request at a time, prompts of 16, 128, 1,024 and 4,096 token ids (and the
   same as text, with --tokenizer): TTFT (request sent -> first streamed token), the first
   non-empty text (later when the first tokens decode to no text yet: special tokens, a UTF-8
   character split across tokens) and TPOT ((end - first token) / (tokens - 1)), medians over
   --requests;
2. Poisson arrivals at 4 and 12 req/s, 512-token-id prompts, 256 output tokens: TTFT, TPOT
   and ITL (gaps between streamed chunks) p50 / p90 / p99.

Every request asks for `logprobs: 0` (the chosen token's logprob, which the engine computes
anyway), so the server streams one chunk per token even where the text is still empty: the
times are the tokens', not the text's. (Dummy weights can emit several such tokens first;
timing the first text would then count those decode steps as TTFT and shorten TPOT.)

Targets (H100, Qwen3-8B shapes; issue 12) are printed beside the figures.

    python benchmarks/latency.py --base-url http://127.0.0.1:8123 --tokenizer qwen3
    python benchmarks/latency.py --parts poisson --rates 4   # one part
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import time
from dataclasses import dataclass, field

import numpy as np
from openai import AsyncOpenAI

TTFT_TARGET_MS = {16: 12.0, 1024: 35.0, 4096: 120.0}  # sequential, token-id prompts
ITL_P99_OVER_P50 = {4.0: 2.0, 12.0: 3.0}  # Poisson rate -> the most ITL p99 / p50 may be


@dataclass
class Timing:
    ttft: float = float("nan")
    first_text: float = float("nan")
    e2e: float = float("nan")
    tokens: int = 0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else float("nan")


async def stream_one(client: AsyncOpenAI, model: str, prompt: list[int] | str, max_tokens: int) -> Timing:
    t = Timing()
    start = last = time.perf_counter()
    chunks = 0
    try:
        stream = await client.completions.create(
            model=model, prompt=prompt, max_tokens=max_tokens, temperature=0.0, stream=True, logprobs=0,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
        )
        async for chunk in stream:
            if chunk.usage is not None:
                t.tokens = chunk.usage.completion_tokens
            if not chunk.choices:
                continue
            choice, now = chunk.choices[0], time.perf_counter()
            if choice.text and t.first_text != t.first_text:  # still NaN
                t.first_text = now - start
            if not (choice.logprobs and choice.logprobs.tokens):
                continue  # no new token (the final usage chunk)
            if chunks == 0:
                t.ttft = now - start
            else:
                t.itl.append(now - last)
            last, chunks = now, chunks + 1
    except Exception as e:  # a failed request is reported, not fatal
        t.error = f"{type(e).__name__}: {e}"
        return t
    t.e2e = last - start
    t.tokens = t.tokens or chunks
    return t


def random_ids(rng: random.Random, n: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab) for _ in range(n)]


async def sequential(client: AsyncOpenAI, model: str, args: argparse.Namespace, tok) -> None:  # noqa: ANN001
    rng = random.Random(0)
    print("\n## sequential (one request at a time)\n")
    print("| prompt | kind | TTFT p50 ms | TTFT min ms | first text p50 ms | TPOT p50 ms | target TTFT | |")
    print("|---|---|---|---|---|---|---|---|")
    kinds = ["ids", "text"] if tok is not None else ["ids"]
    for n in args.lengths:
        for kind in kinds:
            def prompt(n: int = n, kind: str = kind) -> list[int] | str:
                if kind == "ids":
                    return random_ids(rng, n, args.vocab)
                from online import random_prompt  # benchmarks/ is on sys.path

                return random_prompt(tok, args.text_vocab, n, rng)

            await stream_one(client, model, prompt(), args.seq_output_len)  # warm this shape up
            runs = [await stream_one(client, model, prompt(), args.seq_output_len) for _ in range(args.requests)]
            ok = [r for r in runs if not r.error]
            if not ok:
                print(f"| {n} | {kind} | failed: {runs[0].error} | | | | | |")
                continue
            ttft = [r.ttft * 1e3 for r in ok]
            text = statistics.median(r.first_text * 1e3 for r in ok)
            tpot = statistics.median(r.tpot * 1e3 for r in ok)
            target = TTFT_TARGET_MS.get(n) if kind == "ids" else None
            verdict = "" if target is None else ("met" if statistics.median(ttft) <= target else "MISSED")
            print(f"| {n} | {kind} | {statistics.median(ttft):.1f} | {min(ttft):.1f} | {text:.1f} | {tpot:.2f} | "
                  f"{'' if target is None else f'<= {target:.0f}'} | {verdict} |")


async def poisson(client: AsyncOpenAI, model: str, args: argparse.Namespace) -> None:
    print(f"\n## Poisson arrivals ({args.num_prompts} requests, {args.input_len} in / {args.output_len} out)\n")
    print("| rate req/s | done | TTFT p50 | p90 | p99 | TPOT p50 | p90 | p99 | ITL p50 | p90 | p99 | "
          "ITL p99/p50 | target |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate in args.rates:
        rng = random.Random(1)
        arrivals = np.random.default_rng(2)
        prompts = [random_ids(rng, args.input_len, args.vocab) for _ in range(args.num_prompts)]
        tasks = []
        for p in prompts:
            tasks.append(asyncio.create_task(stream_one(client, model, p, args.output_len)))
            await asyncio.sleep(arrivals.exponential(1.0 / rate))
        runs = await asyncio.gather(*tasks)
        ok = [r for r in runs if not r.error]
        if not ok:
            print(f"| {rate:g} | 0 | failed: {runs[0].error} |")
            continue

        def pct(xs: list[float]) -> list[float]:
            return [float(np.percentile(np.asarray(xs) * 1e3, q)) for q in (50, 90, 99)]

        ttft, tpot = pct([r.ttft for r in ok]), pct([r.tpot for r in ok])
        itl = pct([x for r in ok for x in r.itl])
        ratio, limit = itl[2] / itl[0], ITL_P99_OVER_P50.get(rate)
        verdict = "" if limit is None else f"<= {limit:g}x: {'met' if ratio <= limit else 'MISSED'}"
        cells = " | ".join(f"{x:.1f}" for x in ttft + tpot + itl)
        print(f"| {rate:g} | {len(ok)}/{len(runs)} | {cells} | {ratio:.2f}x | {verdict} |")


async def main_async(args: argparse.Namespace) -> None:
    client = AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                         max_retries=0, timeout=600)
    model = args.model or (await client.models.list()).data[0].id
    tok = None
    if args.tokenizer and "sequential" in args.parts:
        from online import load_tokenizer

        tok = load_tokenizer(args.tokenizer)
        special = set(tok.all_special_ids)
        args.text_vocab = [i for i in range(len(tok)) if i not in special]
    if "sequential" in args.parts:
        await sequential(client, model, args, tok)
    if "poisson" in args.parts:
        await poisson(client, model, args)
    await client.close()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--model", default=None, help="model name to send (default: the server's first)")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--tokenizer", default=None,
                    help="for the text prompts: a folder, .gguf or 'qwen3' (else token-id prompts only)")
    ap.add_argument("--parts", nargs="+", choices=("sequential", "poisson"), default=["sequential", "poisson"])
    ap.add_argument("--lengths", type=int, nargs="+", default=[16, 128, 1024, 4096])
    ap.add_argument("--requests", type=int, default=6, help="sequential requests per prompt kind")
    ap.add_argument("--seq-output-len", type=int, default=32, help="tokens per sequential request (TPOT)")
    ap.add_argument("--rates", type=float, nargs="+", default=[4.0, 12.0])
    ap.add_argument("--num-prompts", type=int, default=160, help="requests per Poisson rate")
    ap.add_argument("--input-len", type=int, default=512)
    ap.add_argument("--output-len", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=100000, help="token ids are drawn from [1000, vocab)")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
