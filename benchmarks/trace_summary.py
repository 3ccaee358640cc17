"""Where the time to first token goes: a server log written under MINISGL_TRACE_REQUESTS=1
(request lines `trace ...` and step lines `step N ...`, see minisgl/message/trace.py and
minisgl/scheduler/step_trace.py), optionally lined up with the client's own times
(`latency.py --client-trace FILE`, matched by x-request-id; both clocks are CLOCK_MONOTONIC of
one host).

Prints, per group of requests (the client's parts, e.g. "sequential ids 16", or the prompt
length without a client trace), the median of every hop (ms since the previous hop), the
server's total (gate to first chunk written), the first-token step's GPU time, and with the
client trace: prep (call -> request leaves the client: the openai client's own work),
wire in (request leaves the client -> the server's gate), wire out (first chunk written ->
the client parsed its first token; "headers" = -> the client had the response headers, which
our server sends together with the first chunk) and the client's TTFT. Then the steps by
kind: count, median host launch, ready and GPU ms, and every reason a step ran eagerly; with
the client trace, the ITL as the server emits it per part (gaps between consecutive steps'
tokens, once per continuing request) and which steps make its slowest 1%.

    python benchmarks/trace_summary.py server.log --client client_trace.jsonl
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from minisgl.message.trace import HOPS, parse_request_line  # noqa: E402

STEP = re.compile(r"step (\d+) (\w+) reqs=(\d+) tokens=(\d+) (graph=\d+|eager=\"[^\"]*\") host=([\d.]+) "
                  r"ready=([\d.]+)(?: gpu=([\d.]+))?(?: decodes=(\d+) at=([\d.]+))?(?: built=([\d.]+))?")


def median(xs: list[float]) -> str:
    return f"{statistics.median(xs):.2f}" if xs else ""


def read_log(path: str) -> tuple[list[dict[str, str]], dict[int, dict[str, str]]]:
    requests, steps = [], {}
    for line in open(path, errors="replace"):
        if (fields := parse_request_line(line)) is not None:
            requests.append(fields)
        elif m := STEP.search(line):
            steps[int(m[1])] = {"mode": m[2], "reqs": m[3], "tokens": m[4], "how": m[5], "host": m[6],
                                "ready": m[7], "gpu": m[8] or "", "decodes": m[9] or "0", "at": m[10] or "",
                                "built": m[11] or ""}
    return requests, steps


def request_table(requests: list[dict[str, str]], steps: dict[int, dict[str, str]],
                  client: dict[str, dict] | None) -> None:
    groups: dict[str, list[dict[str, str]]] = defaultdict(list)
    order: list[str] = []
    for r in requests:
        c = client.get(r.get("rid", "")) if client is not None else None
        if client is not None and c is None:
            continue  # not one of the client's requests (warm-ups are, as their part's first)
        key = c["part"] if c is not None else f"prompt {r.get('prompt')}"
        if key not in groups:
            order.append(key)
        groups[key].append(r)
    hops = [h for h in HOPS if h != "http"]
    cols = ["group", "n", "prompt", *hops, "server total", "step gpu"]
    if client is not None:
        cols += ["prep", "wire in", "headers", "wire out", "client TTFT"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for key in order:
        rs = groups[key]
        cells = [key, str(len(rs)), median([float(r.get("prompt", "nan")) for r in rs])]
        cells += [median([float(r[h].lstrip("+")) for r in rs if h in r]) for h in hops]
        cells.append(median([float(r["total"]) for r in rs]))
        gpu = [float(steps[int(float(r["step"]))]["gpu"]) for r in rs
               if "step" in r and int(float(r["step"])) in steps and steps[int(float(r["step"]))]["gpu"]]
        cells.append(median(gpu))
        if client is not None:
            cs = [(r, client[r["rid"]]) for r in rs]
            sent_at = [float(r["t0"]) + float(r["total"]) / 1e3 for r, _ in cs]  # server wrote the first chunk
            cells += [
                median([(c["sent"] - c["call"]) * 1e3 for _, c in cs]),
                median([(float(r["t0"]) - c["sent"]) * 1e3 for r, c in cs]),
                median([(c["headers"] - s) * 1e3 for (_, c), s in zip(cs, sent_at)]),
                median([(c["first_token"] - s) * 1e3 for (_, c), s in zip(cs, sent_at) if c["first_token"]]),
                median([(c["first_token"] - c["call"]) * 1e3 for _, c in cs if c["first_token"]]),
            ]
        print("| " + " | ".join(cells) + " |")


def step_table(steps: dict[int, dict[str, str]]) -> None:
    kinds: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    for s in steps.values():
        kinds[(s["mode"], "graph" if s["how"].startswith("graph") else "eager")].append(s)
    print("\n| step kind | how | count | tokens p50 | batch built p50 ms | host launch p50 ms | ready p50 ms | "
          "gpu p50 ms | gpu max ms |")
    print("|---|---|---|---|---|---|---|---|---|")
    for (mode, how), ss in sorted(kinds.items()):
        gpu = [float(s["gpu"]) for s in ss if s["gpu"]]
        print(f"| {mode} | {how} | {len(ss)} | {median([float(s['tokens']) for s in ss])} | "
              f"{median([float(s['built']) for s in ss if s['built']])} | "
              f"{median([float(s['host']) for s in ss])} | {median([float(s['ready']) for s in ss])} | "
              f"{median(gpu)} | {max(gpu) if gpu else ''} |")
    buckets: dict[tuple[str, str], list[dict[str, str]]] = defaultdict(list)
    for s in steps.values():
        if s["mode"] != "decode" and s["how"].startswith("graph") and s["gpu"]:
            buckets[(s["mode"], s["how"].removeprefix("graph="))].append(s)
    if buckets:  # what a prefill or mixed step costs per graph bucket (the mixed-chunk budget's data)
        print("\n| step kind | graph bucket (tokens) | count | reqs p50 | gpu p50 ms | gpu p90 ms |")
        print("|---|---|---|---|---|---|")
        for (mode, bucket), ss in sorted(buckets.items(), key=lambda kv: (kv[0][0], int(kv[0][1]))):
            gpu = sorted(float(s["gpu"]) for s in ss)
            print(f"| {mode} | {bucket} | {len(ss)} | {median([float(s['reqs']) for s in ss])} | "
                  f"{median(gpu)} | {gpu[int(0.9 * (len(gpu) - 1))]:.2f} |")
    reasons = sorted({s["how"] for s in steps.values() if s["how"].startswith("eager")})
    for why in reasons:
        print(f"eager steps: {why}")


def server_itl(steps: dict[int, dict[str, str]], client: dict[str, dict]) -> None:
    """The inter-token gaps as the server emits them, per client part: between consecutive
    steps' `at` (tokens on the host), once per request that continues in the later step.
    Which steps make the slowest 1%: the kind (and graph) of the step whose tokens arrive
    late, and of the step launched just before they were read (overlap)."""
    timed = sorted((float(s["at"]), n) for n, s in steps.items() if s["at"])
    if not timed:
        return
    parts: dict[str, list[float]] = defaultdict(list)
    for c in client.values():
        if c.get("end"):
            parts[c["part"]] += [c["call"], c["end"]]
    print("\n| part | server ITL p50 ms | p90 | p99 | p99/p50 | slowest 1%: late step / step launched before: count |")
    print("|---|---|---|---|---|---|")
    for part, ts in parts.items():
        lo, hi = min(ts), max(ts)
        window = [(t, n) for t, n in timed if lo <= t <= hi]
        gaps: list[tuple[float, int, int]] = []  # (ms, step, next step)
        for (t0, _), (t1, n), nxt in zip(window, window[1:], [*window[2:], (0.0, -1)]):
            gaps += [((t1 - t0) * 1e3, n, nxt[1])] * int(steps[n]["decodes"])
        if not gaps:
            continue
        ms = sorted(g[0] for g in gaps)
        p50, p90, p99 = (ms[int(q * (len(ms) - 1))] for q in (0.5, 0.9, 0.99))
        slow: dict[str, int] = defaultdict(int)
        for g, n, nxt in gaps:
            if g >= p99:
                after = steps[nxt]["mode"] + f" ({steps[nxt]['how']})" if nxt in steps else "-"
                slow[f"{steps[n]['mode']} ({steps[n]['how']}) / {after}"] += 1
        top = "; ".join(f"{k}: {v}" for k, v in sorted(slow.items(), key=lambda kv: -kv[1])[:4])
        print(f"| {part} | {p50:.2f} | {p90:.2f} | {p99:.2f} | {p99 / p50:.2f}x | {top} |")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="the server's log (MINISGL_TRACE_REQUESTS=1)")
    ap.add_argument("--client", default=None, help="latency.py --client-trace output")
    ap.add_argument("--parts", nargs="*", default=None, help="only client parts starting with these (e.g. sequential)")
    args = ap.parse_args()
    requests, steps = read_log(args.log)
    client = None
    if args.client:
        client = {}
        for line in open(args.client):
            c = json.loads(line)
            if c.get("request_id") and not c.get("error"):
                if args.parts is None or any(c["part"].startswith(p) for p in args.parts):
                    client[c["request_id"]] = c
    print(f"{len(requests)} traced requests, {len(steps)} steps in {args.log}\n")
    request_table(requests, steps, client)
    step_table(steps)
    if client:
        server_itl(steps, client)


if __name__ == "__main__":
    main()
