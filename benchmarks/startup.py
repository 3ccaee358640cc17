"""Server startup as a user sees it: seconds from `python -m minisgl.serve` to the first 200 of
/health, then to the first completion, and what the server's log says the time went to
(its `startup:` lines, one per phase and process, each stamped with seconds since launch).

    python benchmarks/startup.py [--runs 2] -- --model benchmarks/configs/qwen3-8b --load-format dummy ...

Everything after `--` is passed to the server. The first run of a fresh machine is the cold
start (no Triton cache, no GEMM table); later runs find the caches warm. --cache-dir runs with
MINISGL_CACHE_DIR and TRITON_CACHE_DIR in a fresh folder each run (a cold start on demand).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

PHASE = re.compile(r"startup: (?P<what>.+?) (?P<secs>[\d.]+) s \(at (?P<at>[\d.]+) s\)")


def wait_health(url: str, proc: subprocess.Popen, timeout: float) -> float | None:
    start = time.monotonic()
    while time.monotonic() - start < timeout:
        if proc.poll() is not None:
            return None
        try:
            with urllib.request.urlopen(url, timeout=1) as r:
                if r.status == 200:
                    return time.monotonic()
        except OSError:
            pass
        time.sleep(0.02)
    return None


def first_completion(base: str) -> float:
    with urllib.request.urlopen(f"{base}/v1/models", timeout=10) as r:
        model = json.load(r)["data"][0]["id"]
    body = json.dumps({"model": model, "prompt": "Hello", "max_tokens": 4, "temperature": 0}).encode()
    req = urllib.request.Request(f"{base}/v1/completions", body, {"Content-Type": "application/json"})
    t0 = time.monotonic()
    with urllib.request.urlopen(req, timeout=120) as r:
        r.read()
    return time.monotonic() - t0


def one_run(server_args: list[str], port: int, cold_dir: str | None, log_path: str) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if cold_dir is not None:
        env["MINISGL_CACHE_DIR"] = os.path.join(cold_dir, "minisgl")
        env["TRITON_CACHE_DIR"] = os.path.join(cold_dir, "triton")
    cmd = [sys.executable, "-m", "minisgl.serve", "--port", str(port), *server_args]
    with open(log_path, "w") as log:
        t0 = time.monotonic()
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env)
        try:
            ready = wait_health(f"http://127.0.0.1:{port}/health", proc, 600)
            first = first_completion(f"http://127.0.0.1:{port}") if ready is not None else float("nan")
        finally:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
    if ready is None:
        raise SystemExit(f"the server did not answer /health (log: {log_path}):\n" + open(log_path).read()[-3000:])
    phases = [m.groupdict() for m in PHASE.finditer(open(log_path).read())]
    return {"health_s": ready - t0, "first_completion_s": first, "phases": phases}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--port", type=int, default=8123)
    ap.add_argument("--cold", action="store_true", help="every run with empty minisgl and Triton caches")
    ap.add_argument("--out", default=None, help="folder for the server logs (default: a temp folder)")
    ap.add_argument("server_args", nargs=argparse.REMAINDER)
    args = ap.parse_args()
    server_args = args.server_args[1:] if args.server_args[:1] == ["--"] else args.server_args
    out = args.out or tempfile.mkdtemp(prefix="minisgl-startup-")
    os.makedirs(out, exist_ok=True)
    runs = []
    for i in range(args.runs):
        cold = tempfile.mkdtemp(prefix="cold-") if args.cold else None
        runs.append(one_run(server_args, args.port, cold, os.path.join(out, f"server_{i}.log")))
    print(f"server: {' '.join(server_args) or '(defaults)'}; logs in {out}")
    print("| run | /health (s) | first completion (s) |")
    print("|---|---|---|")
    for i, r in enumerate(runs):
        print(f"| {i} | {r['health_s']:.2f} | {r['first_completion_s']:.3f} |")
    if len(runs) > 1:
        print(f"| median | {statistics.median(r['health_s'] for r in runs):.2f} | "
              f"{statistics.median(r['first_completion_s'] for r in runs):.3f} |")
    last = runs[-1]["phases"]
    if last:
        print("\nphases of the last run (seconds the phase took; when it ended, since launch):")
        print("| phase | seconds | ended at |")
        print("|---|---|---|")
        for p in sorted(last, key=lambda p: float(p["at"])):
            print(f"| {p['what']} | {float(p['secs']):.2f} | {float(p['at']):.2f} |")


if __name__ == "__main__":
    main()
