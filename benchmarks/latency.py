"""Latency against a running server, in one run, through the official `openai` client
(streamed completions):

1. sequential: one request at a time, prompts of 16, 128, 1,024 and 4,096 token ids (and the
   same as text, with --tokenizer): TTFT (request sent -> first streamed token), the first
   non-empty text (later when the first tokens decode to no text yet: special tokens, a UTF-8
   character split across tokens) and TPOT ((end - first token) / (tokens - 1)), medians over
   --requests;
2. Poisson arrivals at 4 and 12 req/s, 512-token-id prompts, 256 output tokens: TTFT, TPOT
   and ITL (gaps between streamed chunks) p50 / p90 / p99, and how late the client's own
   event loop ran (a late loop reads chunks late: ITLs the server did not cause).

Every request asks for `logprobs: 0` (the chosen token's logprob, which the engine computes
anyway), so the server streams one chunk per token even where the text is still empty: the
times are the tokens', not the text's. (Dummy weights can emit several such tokens first;
timing the first text would then count those decode steps as TTFT and shorten TPOT.)

Targets (H100, Qwen3-8B shapes; issue 12) are printed beside the figures.

Where the client's own time goes (sequential table): "client prep" is from the call until the
request leaves the client (httpx's request hook: the openai client transforms and serializes
the parameters first, which for a list of token ids costs a few µs per id), "from send" the
TTFT counted from there. `--client-trace FILE` writes one JSON line per request (its
x-request-id and the client's CLOCK_MONOTONIC times), which `benchmarks/trace_summary.py`
lines up with a server run under MINISGL_TRACE_REQUESTS=1 (which also gives the ITL as the
server emits it). The client's own CPU time can inflate what it measures: the Poisson table
says how late its event loop ran. `--procs N` spreads the Poisson arrivals over N client
processes; `--prompt-in-extra-body` sends the same JSON without the openai client's per-id
parameter transform.

    python benchmarks/latency.py --base-url http://127.0.0.1:8123 --tokenizer qwen3
    python benchmarks/latency.py --parts poisson --rates 4   # one part
"""

from __future__ import annotations

import argparse
import asyncio
import contextvars
import dataclasses
import json
import multiprocessing
import random
import statistics
import time
from dataclasses import dataclass, field
from multiprocessing.connection import Connection

import numpy as np
from openai import AsyncOpenAI, DefaultAsyncHttpxClient

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
    # CLOCK_MONOTONIC seconds: the call, the request leaving the client, the response headers
    # (our server sends them with the first chunk), and the server's x-request-id.
    call: float = float("nan")
    sent: float = float("nan")
    headers: float = float("nan")
    request_id: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.tokens - 1) if self.tokens > 1 else float("nan")


_CURRENT: contextvars.ContextVar[Timing] = contextvars.ContextVar("timing")


async def _on_request(request: object) -> None:  # httpx event hooks run in the caller's task
    if (t := _CURRENT.get(None)) is not None:
        t.sent = time.monotonic()


async def _on_response(response: object) -> None:
    if (t := _CURRENT.get(None)) is not None:
        t.headers = time.monotonic()
        t.request_id = response.headers.get("x-request-id", "")  # type: ignore[attr-defined]


async def stream_one(client: AsyncOpenAI, model: str, prompt: list[int] | str, max_tokens: int,
                     via_extra_body: bool = False) -> Timing:
    """One streamed completion. `via_extra_body`: the prompt goes in extra_body (the same JSON
    body), which the openai client does not transform element by element."""
    t = Timing()
    _CURRENT.set(t)  # each call runs in its own task (or sequentially in one)
    start = last = time.perf_counter()
    t.call = time.monotonic()
    chunks = 0
    try:
        extra: dict = {"ignore_eos": True, **({"prompt": prompt} if via_extra_body else {})}
        stream = await client.completions.create(
            model=model, prompt="" if via_extra_body else prompt, max_tokens=max_tokens, temperature=0.0,
            stream=True, logprobs=0, stream_options={"include_usage": True}, extra_body=extra,
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
    print("| prompt | kind | TTFT p50 ms | TTFT min ms | first text p50 ms | TPOT p50 ms | client prep p50 ms | "
          "TTFT from send p50 ms | target TTFT | |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    kinds = ["ids", "text"] if tok is not None else ["ids"]
    for n in args.lengths:
        for kind in kinds:
            def prompt(n: int = n, kind: str = kind) -> list[int] | str:
                if kind == "ids":
                    return random_ids(rng, n, args.vocab)
                from online import random_prompt  # benchmarks/ is on sys.path

                return random_prompt(tok, args.text_vocab, n, rng)

            x = args.prompt_in_extra_body
            await stream_one(client, model, prompt(), args.seq_output_len, x)  # warm this shape up
            runs = [await stream_one(client, model, prompt(), args.seq_output_len, x) for _ in range(args.requests)]
            ok = [r for r in runs if not r.error]
            write_trace(args, runs, f"sequential {kind} {n}")
            if not ok:
                print(f"| {n} | {kind} | failed: {runs[0].error} | | | | | | | |")
                continue
            ttft = [r.ttft * 1e3 for r in ok]
            text = statistics.median(r.first_text * 1e3 for r in ok)
            tpot = statistics.median(r.tpot * 1e3 for r in ok)
            prep = statistics.median((r.sent - r.call) * 1e3 for r in ok)
            from_send = statistics.median(r.ttft * 1e3 - (r.sent - r.call) * 1e3 for r in ok)
            target = TTFT_TARGET_MS.get(n) if kind == "ids" else None
            verdict = "" if target is None else ("met" if statistics.median(ttft) <= target else "MISSED")
            print(f"| {n} | {kind} | {statistics.median(ttft):.1f} | {min(ttft):.1f} | {text:.1f} | {tpot:.2f} | "
                  f"{prep:.1f} | {from_send:.1f} | {'' if target is None else f'<= {target:.0f}'} | {verdict} |")


def write_trace(args: argparse.Namespace, runs: list[Timing], part: str) -> None:
    """Appends the runs' client-side times to --client-trace (JSON lines), if given."""
    if not args.client_trace:
        return
    with open(args.client_trace, "a") as f:
        for r in runs:
            first = r.call + r.ttft if r.ttft == r.ttft else None
            end = r.call + r.e2e if r.e2e == r.e2e else None
            f.write(json.dumps({"part": part, "request_id": r.request_id, "call": r.call, "sent": r.sent,
                                "headers": r.headers, "first_token": first, "end": end, "error": r.error}) + "\n")


async def poisson(client: AsyncOpenAI, model: str, args: argparse.Namespace) -> None:
    print(f"\n## Poisson arrivals ({args.num_prompts} requests, {args.input_len} in / {args.output_len} out)\n")
    print("| rate req/s | done | TTFT p50 | p90 | p99 | TPOT p50 | p90 | p99 | ITL p50 | p90 | p99 | "
          "ITL p99/p50 | target | client lag p99 / max ms |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    for rate in args.rates:
        rng = random.Random(f"poisson {rate}")  # prompts of their own: not prefix-cache hits of another rate's
        offsets = np.cumsum(np.random.default_rng(2).exponential(1.0 / rate, args.num_prompts)).tolist()
        offsets = [0.0, *offsets[:-1]]  # arrival times (s) from the first request
        prompts = [random_ids(rng, args.input_len, args.vocab) for _ in range(args.num_prompts)]
        if args.procs > 1:
            runs, lags = run_in_processes(args, model, prompts, offsets)
        else:
            runs, lags = await poisson_runs(client, model, args, prompts, offsets, time.monotonic())
        write_trace(args, runs, f"poisson {rate:g}")
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
        lag = f"{np.percentile(lags, 99):.1f} / {max(lags):.1f}" if lags else ""
        print(f"| {rate:g} | {len(ok)}/{len(runs)} | {cells} | {ratio:.2f}x | {verdict} | {lag} |")


async def poisson_runs(client: AsyncOpenAI, model: str, args: argparse.Namespace, prompts: list[list[int]],
                       offsets: list[float], start: float) -> tuple[list[Timing], list[float]]:
    """Each prompt sent at `start` + its offset (CLOCK_MONOTONIC s): (timings, loop lags in ms)."""
    lags: list[float] = []
    watch = asyncio.create_task(loop_lag(lags))
    tasks = []
    for p, offset in zip(prompts, offsets):
        if (delay := start + offset - time.monotonic()) > 0:
            await asyncio.sleep(delay)
        tasks.append(asyncio.create_task(stream_one(client, model, p, args.output_len, args.prompt_in_extra_body)))
    runs = await asyncio.gather(*tasks)
    watch.cancel()
    return list(runs), lags


def _client_process(conn: Connection, args: argparse.Namespace, model: str, prompts: list[list[int]],
                    offsets: list[float]) -> None:
    async def main() -> tuple[list[Timing], list[float]]:
        client = make_client(args)
        conn.send("ready")
        start = conn.recv()
        try:
            return await poisson_runs(client, model, args, prompts, offsets, start)
        finally:
            await client.close()

    runs, lags = asyncio.run(main())
    conn.send(([dataclasses.asdict(r) for r in runs], lags))


def run_in_processes(args: argparse.Namespace, model: str, prompts: list[list[int]],
                     offsets: list[float]) -> tuple[list[Timing], list[float]]:
    """The same arrivals from --procs client processes (request i from process i mod procs),
    so that no one client's event loop must parse every stream's chunks."""
    ctx = multiprocessing.get_context("spawn")
    n = args.procs
    procs, conns = [], []
    for j in range(n):
        parent, child = ctx.Pipe()
        p = ctx.Process(target=_client_process, args=(child, args, model, prompts[j::n], offsets[j::n]), daemon=True)
        p.start()
        procs.append(p)
        conns.append(parent)
    for c in conns:
        c.recv()  # ready: imported and connected
    start = time.monotonic() + 0.2
    for c in conns:
        c.send(start)
    runs: list[Timing] = [Timing()] * len(prompts)
    lags: list[float] = []
    for j, c in enumerate(conns):
        got, lag = c.recv()
        runs[j::n] = [Timing(**r) for r in got]
        lags += lag
    for p in procs:
        p.join()
    return runs, lags


def make_client(args: argparse.Namespace) -> AsyncOpenAI:
    hooks = {"request": [_on_request], "response": [_on_response]}
    return AsyncOpenAI(base_url=args.base_url.rstrip("/") + "/v1", api_key=args.api_key or "none",
                       max_retries=0, timeout=600, http_client=DefaultAsyncHttpxClient(event_hooks=hooks))


async def loop_lag(out: list[float], period: float = 0.001) -> None:
    """How late this client's event loop wakes a 1 ms sleep (ms): its own work (the openai
    client's per-request transform, parsing every stream's chunks) delays when chunks are read,
    which shows in the ITLs as if the server were late."""
    while True:
        t = time.perf_counter()
        await asyncio.sleep(period)
        out.append((time.perf_counter() - t - period) * 1e3)


async def main_async(args: argparse.Namespace) -> None:
    client = make_client(args)
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
    ap.add_argument("--client-trace", default=None, help="append each request's client-side times here (JSON lines)")
    ap.add_argument("--procs", type=int, default=1, help="client processes sharing the Poisson arrivals")
    ap.add_argument("--prompt-in-extra-body", action="store_true",
                    help="send prompts in extra_body (the same JSON, without the client's per-id transform)")
    args = ap.parse_args()
    asyncio.run(main_async(args))


if __name__ == "__main__":
    main()
