"""Time to first token as the server delivers it, without an HTTP client library in the way.

Sends sequential streaming completions over a raw TCP socket (TCP_NODELAY, the request in one
`sendall`) and times the first SSE chunk. Alongside, it reads the server's own TTFT metric
(`minisgl_time_to_first_token_seconds` in /metrics: submit to first token) for the same
requests. Prompt kinds: `ids` (random token ids), `text` (the same decoded to text), and
`text+usage` (text, with `stream_options.include_usage`).

    python benchmarks/ttft_probe.py --base-url http://127.0.0.1:8123 --tokenizer <folder> \
        --cases 1024:ids 1024:text 16:text
"""

from __future__ import annotations

import argparse
import json
import random
import socket
import time
import urllib.parse
import urllib.request


def server_ttft(base: str) -> tuple[float, float]:
    """(sum of seconds, count) of the server's TTFT histogram."""
    total = count = 0.0
    for line in urllib.request.urlopen(base + "/metrics").read().decode().splitlines():
        if line.startswith("minisgl_time_to_first_token_seconds_sum"):
            total = float(line.split()[1])
        elif line.startswith("minisgl_time_to_first_token_seconds_count"):
            count = float(line.split()[1])
    return total, count


def first_chunk_ms(host: str, port: int, body: bytes) -> float:
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    ).encode()
    with socket.create_connection((host, port)) as s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        s.sendall(head + body)
        buf, first = b"", None
        while True:
            data = s.recv(65536)
            if not data:
                break
            buf += data
            if first is None and b"data: {" in buf:
                first = (time.perf_counter() - start) * 1e3
    if first is None:
        raise RuntimeError(f"no SSE chunk in the response: {buf[:300]!r}")
    return first


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder (to turn random ids into text)")
    ap.add_argument("--cases", nargs="+", default=["1024:ids", "1024:text", "1024:text+usage", "16:text"])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    url = urllib.parse.urlparse(args.base_url)
    model = json.loads(urllib.request.urlopen(args.base_url + "/v1/models").read())["data"][0]["id"]
    rng = random.Random(0)

    def body(n: int, kind: str) -> bytes:
        ids = [rng.randrange(1000, 100000) for _ in range(n)]
        req = {"model": model, "prompt": ids if kind == "ids" else tok.decode(ids), "max_tokens": args.max_tokens,
               "stream": True, "ignore_eos": True}
        if kind == "text+usage":
            req["stream_options"] = {"include_usage": True}
        return json.dumps(req).encode()

    print(f"{'prompt':>7} {'kind':<11} {'client first chunk (ms)':<40} server metric mean")
    for case in args.cases:
        n, kind = case.split(":")
        first_chunk_ms(url.hostname, url.port, body(int(n), kind))  # warm up this shape
        before = server_ttft(args.base_url)
        times = [first_chunk_ms(url.hostname, url.port, body(int(n), kind)) for _ in range(args.requests)]
        after = server_ttft(args.base_url)
        mean = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
        shown = ", ".join(f"{t:.1f}" for t in times)
        print(f"{n:>7} {kind:<11} {shown:<40} {mean:.1f} ms")


if __name__ == "__main__":
    main()
