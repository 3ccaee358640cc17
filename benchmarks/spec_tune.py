"""Writes the speculative draft table (--speculative-draft-table): K per batch size, 0 where
speculation measures slower than a plain decode step, so that it switches itself off there.

For each batch size b of a ladder and K = 1..max: the median time of a plain decode step
(CUDA graph), of a verify step of 1 + K tokens and of the drafter's work, measured here on
the target's shapes (dummy weights); with a per-token acceptance rate a (given, or derived
from a measured mean accepted length L at some K, since L = (1 - a^(K+1)) / (1 - a)), a step
yields E(K) = (1 - a^(K+1)) / (1 - a) tokens, so its speed over plain decoding is
    E(K) x decode(b) / (verify(b, K) + drafting(b, K)).
The table keeps the K with the best speed-up if it beats plain decoding by --margin, else 0.
The acceptance rate is a property of the workload and the drafter: measure L with
benchmarks/spec_ngram.py (n-gram) or a real run, then

    python benchmarks/spec_tune.py --model benchmarks/configs/llama-3.1-8b --algorithm eagle3 \
        --draft-model benchmarks/configs/eagle3-llama-3.1-8b --accept-length 3.08 --at-k 4 \
        --out benchmarks/spec_tables/llama-3.1-8b-eagle3.json
"""

from __future__ import annotations

import argparse
import json
import random
import time
from pathlib import Path

from spec_timing import StepBench

from minisgl.speculative.ngram import NgramDrafter


def rate_from_length(length: float, k: int) -> float:
    """The per-token acceptance rate a with (1 - a^(k+1)) / (1 - a) = length (bisection)."""
    if not 1.0 <= length <= k + 1:
        raise ValueError(f"a mean accepted length at K = {k} lies in [1, {k + 1}], got {length}")
    lo, hi = 0.0, 1.0
    for _ in range(60):
        a = (lo + hi) / 2
        if expected_tokens(a, k) < length:
            lo = a
        else:
            hi = a
    return (lo + hi) / 2


def expected_tokens(a: float, k: int) -> float:
    return float(k + 1) if a >= 1.0 else (1 - a ** (k + 1)) / (1 - a)


def ngram_host_ms(b: int, k: int, context: int) -> float:
    """The n-gram drafter's host time for b requests (random contexts of `context` tokens)."""
    from minisgl.speculative.drafter import DraftRequest

    rng = random.Random(0)
    reqs = [DraftRequest(i, i, [rng.randrange(5000) for _ in range(context)], [], k) for i in range(b)]
    d = NgramDrafter(1, 4)
    d.propose(reqs)
    t0 = time.perf_counter()
    for _ in range(5):
        for r in reqs:
            r.output.append(rng.randrange(5000))
        d.propose(reqs)
    return (time.perf_counter() - t0) / 5 * 1000


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", required=True, help="the target (HF folder or config-only folder; dummy weights)")
    ap.add_argument("--algorithm", choices=("ngram", "draft", "eagle3"), required=True)
    ap.add_argument("--draft-model", default=None)
    ap.add_argument("--accept-rate", type=float, default=None, help="per-token acceptance rate a")
    ap.add_argument("--accept-length", type=float, default=None, help="a measured mean accepted length ...")
    ap.add_argument("--at-k", type=int, default=None, help="... at this K")
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 256])
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--margin", type=float, default=0.03, help="required speed-up over plain decoding")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--out", required=True, help="the JSON table to write")
    args = ap.parse_args()
    if args.accept_rate is None:
        if args.accept_length is None or args.at_k is None:
            ap.error("give --accept-rate, or --accept-length with --at-k")
        args.accept_rate = rate_from_length(args.accept_length, args.at_k)
    a = args.accept_rate
    spec = {"speculative_algorithm": args.algorithm, "speculative_draft_model": args.draft_model,
            "speculative_num_draft_tokens": args.max_k}
    pairs = [(b, k) for b in args.batch for k in range(1, args.max_k + 1)]  # verify graphs, as served
    bench = StepBench(args.model, max(args.batch), args.max_k, args.context, args.dtype, args.device, verify=pairs,
                      **spec)
    table: dict[str, int] = {}
    measured: list[dict] = []
    print(f"model {args.model}, {args.algorithm}, acceptance rate {a:.3f}, context {args.context}")
    print("| batch | decode ms | best K | verify ms | drafting ms | expected tokens | speed-up | table K |")
    print("|---|---|---|---|---|---|---|---|")
    for b in args.batch:
        dec = bench.decode_ms(b)
        best = (1.0, 0, 0.0, 0.0)
        for k in range(1, args.max_k + 1):
            ver = bench.verify_ms(b, k)
            dr = ngram_host_ms(b, k, args.context) if args.algorithm == "ngram" else bench.draft_ms(b, k)
            speed = expected_tokens(a, k) * dec / (ver + dr)
            measured.append({"batch": b, "k": k, "decode_ms": dec, "verify_ms": ver, "draft_ms": dr, "speedup": speed})
            if speed > best[0]:
                best = (speed, k, ver, dr)
        k_table = best[1] if best[0] >= 1.0 + args.margin else 0
        table[str(b)] = k_table
        print(f"| {b} | {dec:.3f} | {best[1]} | {best[2]:.3f} | {best[3]:.3f} | "
              f"{expected_tokens(a, best[1]) if best[1] else 1:.2f} | {best[0]:.2f} | {k_table} |")
    out = {"num_draft_tokens": table, "model": args.model, "algorithm": args.algorithm,
           "accept_rate": a, "context": args.context, "measured": measured}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
