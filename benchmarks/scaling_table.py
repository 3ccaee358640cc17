"""Tables of the two-GPU runs (benchmarks/gpu_suite.sh --two-gpu) from their JSON summaries.

    python benchmarks/scaling_table.py OUT_DIR

Offline: output tok/s of `benchmarks/offline.py --dp 2` against `--dp 1` in the same run (the
baseline), on the standard 256-request workload (target >= 1.9x) and on twice that workload
(512 requests: each replica as busy as the one replica was). Online: latency and throughput
of one server, two servers behind sglang-router and one `--dp 2` server under the same
Poisson load (benchmarks/online.py).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

TARGET = 1.9


def _load(path: Path) -> dict | None:
    return json.loads(path.read_text()) if path.exists() else None


def offline(out: Path) -> None:
    base = _load(out / "offline_dp1.json")
    print("| run | requests | output tokens | time (s) | output tok/s | vs --dp 1 |")
    print("|---|---|---|---|---|---|")
    for name, label in (("offline_dp1", "--dp 1 (baseline)"), ("offline_dp2", "--dp 2"),
                        ("offline_dp2_x2", "--dp 2, 512 requests")):
        r = _load(out / f"{name}.json")
        if r is None:
            print(f"| {label} | missing | | | | |")
            continue
        ratio = f"{r['output_tok_s'] / base['output_tok_s']:.2f}x" if base else "n/a"
        print(f"| {label} | {r['requests']} | {r['output_tokens']:,} | {r['time_s']:.2f} | "
              f"{r['output_tok_s']:,.0f} | {ratio} |")
    two = _load(out / "offline_dp2.json")
    if base and two:
        ratio = two["output_tok_s"] / base["output_tok_s"]
        print(f"\n--dp 2 on the standard workload: {ratio:.2f}x one replica "
              f"({'meets' if ratio >= TARGET else 'misses'} the {TARGET}x target)")


def online(out: Path) -> None:
    rows = [("online_one", "one server, GPU 0 (baseline)"), ("online_router", "two servers + sglang-router"),
            ("online_dp2", "one server --dp 2")]
    print("\n| setup | completed | req/s | output tok/s | TTFT p50 | TTFT p99 | TPOT p50 | E2E p50 (ms) |")
    print("|---|---|---|---|---|---|---|---|")
    for name, label in rows:
        r = _load(out / f"{name}.json")
        if r is None:
            print(f"| {label} | not run | | | | | | |")
            continue
        r = r["summary"]
        ttft, tpot, e2e = r.get("TTFT", {}), r.get("TPOT", {}), r.get("E2E", {})
        print(f"| {label} | {r['completed']}/{r['completed'] + r['failed']} | {r['request_s']:.2f} | "
              f"{r['output_tok_s']:,.0f} | {ttft.get('p50', 0):.1f} | {ttft.get('p99', 0):.1f} | "
              f"{tpot.get('p50', 0):.2f} | {e2e.get('p50', 0):.0f} |")


if __name__ == "__main__":
    folder = Path(sys.argv[1] if len(sys.argv) > 1 else "/tmp/minisgl-bench")
    offline(folder)
    online(folder)
