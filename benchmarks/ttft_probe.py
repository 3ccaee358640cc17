"""Time to first token as the server delivers it, without an HTTP client library in the way.

Sends sequential streaming completions over a raw TCP socket (TCP_NODELAY, the request in one
`sendall`) and times the first SSE chunk (the first token: requests ask for `logprobs: 0`, so
every token gets a chunk even while its text is empty) and the first chunk with text (later
when the first tokens decode to nothing yet: special tokens, or a UTF-8 character split across
tokens, which random dummy weights may well emit). Alongside, it reads the server's own TTFT
metric (`minisgl_time_to_first_token_seconds` in /metrics: submit to first token) for the same
requests. The first token minus the engine's step time (`offline.py`, `graph_designs.py`) is
the HTTP, tokenizer, ZMQ and detokenizer hops. Prompt kinds: `ids` (random token ids), `text`
(the same decoded to text), and `text+usage` (text, with `stream_options.include_usage`). A
case `N:KIND:keep` sends its requests on one kept-alive connection (as an HTTP client
library's pool does) instead of a fresh one each.

    python benchmarks/ttft_probe.py --base-url http://127.0.0.1:8123 --tokenizer <folder> \
        --cases 1024:ids 1024:text 16:text
"""

from __future__ import annotations

import argparse
import contextlib
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


def first_chunk_ms(host: str, port: int, body: bytes, conn: socket.socket | None = None) -> tuple[float, float]:
    """(ms to the first SSE chunk, ms to the first chunk whose text is not empty; NaN: none).
    `conn`: send on this kept-alive connection (read to the end of the response) instead of
    a fresh one per request."""
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\n{'' if conn else 'Connection: close' + chr(13) + chr(10)}\r\n"
    ).encode()
    s = conn or socket.create_connection((host, port))
    with contextlib.nullcontext(s) if conn else s:
        s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        start = time.perf_counter()
        s.sendall(head + body)
        buf, first, text, seen = b"", None, float("nan"), 0
        while True:
            data = s.recv(65536)
            if not data:
                break
            now = (time.perf_counter() - start) * 1e3
            buf += data
            done = conn is not None and buf.endswith(b"\r\n0\r\n\r\n")  # the chunked body's end
            if first is None and b"data: {" in buf:
                first = now
            # Events completed by this read (each is one HTTP chunk: `data: {json}` + blank line).
            while text != text and (start_ev := buf.find(b"data: {", seen)) >= 0:
                end = buf.find(b"\n\n", start_ev)
                if end < 0:
                    break
                seen = end + 2
                if any(c.get("text") for c in json.loads(buf[start_ev + 6 : end]).get("choices", [])):
                    text = now
            if done:
                break
    if first is None:
        raise RuntimeError(f"no SSE chunk in the response: {buf[:300]!r}")
    return first, text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--base-url", default="http://127.0.0.1:8000")
    ap.add_argument("--tokenizer", required=True, help="tokenizer folder (to turn random ids into text)")
    ap.add_argument("--cases", nargs="+", default=["1024:ids", "1024:text", "1024:text+usage", "16:text"])
    ap.add_argument("--requests", type=int, default=6)
    ap.add_argument("--max-tokens", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=100000, help="token ids are drawn from [1000, vocab)")
    ap.add_argument("--seed", type=int, default=0,
                    help="of the random prompts (another run's prompts would be prefix-cache hits)")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(args.tokenizer)
    url = urllib.parse.urlparse(args.base_url)
    model = json.loads(urllib.request.urlopen(args.base_url + "/v1/models").read())["data"][0]["id"]
    rng = random.Random(args.seed)

    def body(n: int, kind: str) -> bytes:
        ids = [rng.randrange(1000, args.vocab) for _ in range(n)]
        req = {"model": model, "prompt": ids if kind == "ids" else tok.decode(ids), "max_tokens": args.max_tokens,
               "stream": True, "ignore_eos": True, "logprobs": 0}
        if kind == "text+usage":
            req["stream_options"] = {"include_usage": True}
        return json.dumps(req).encode()

    print(f"{'prompt':>7} {'kind':<11} {'first token (ms)':<40} {'first text (ms)':<40} server metric mean")
    for case in args.cases:
        n, kind, *how = case.split(":")
        conn = socket.create_connection((url.hostname, url.port)) if how == ["keep"] else None
        first_chunk_ms(url.hostname, url.port, body(int(n), kind), conn)  # warm up this shape
        before = server_ttft(args.base_url)
        times = [first_chunk_ms(url.hostname, url.port, body(int(n), kind), conn) for _ in range(args.requests)]
        after = server_ttft(args.base_url)
        if conn is not None:
            conn.close()
            kind += ":keep"
        mean = (after[0] - before[0]) / max(after[1] - before[1], 1) * 1e3
        token = ", ".join(f"{t:.1f}" for t, _ in times)
        text = ", ".join(f"{t:.1f}" for _, t in times)
        print(f"{n:>7} {kind:<11} {token:<40} {text:<40} {mean:.1f} ms")


if __name__ == "__main__":
    main()
