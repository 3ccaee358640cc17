"""Request hop tracing (MINISGL_TRACE_REQUESTS=1) and what it found: the trace line and its
parser, the messages carrying a trace, the scheduler's hops and step lines (graph bucket, or
why a step ran eagerly, logged once per reason), and the HTTP listener's TCP_NODELAY."""

from __future__ import annotations

import asyncio
import logging
import socket

import pytest
from test_graph_replay_cpu import graph_llm

from minisgl import SamplingParams
from minisgl.launch.launcher import _bind
from minisgl.message import DetokInit, TokenizeMsg, TokenOut, UserMsg, UserReply, decode, encode, trace
from minisgl.message.trace import HOPS, parse_request_line, request_line


@pytest.fixture
def log_lines():
    """Records what the `minisgl` logger says (it does not propagate to the root)."""
    lines: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    handler, logger = Keep(level=logging.INFO), logging.getLogger("minisgl")
    logger.addHandler(handler)
    yield lines
    logger.removeHandler(handler)


def test_trace_line_has_deltas_in_hop_order_and_parses_back() -> None:
    hops: dict[str, float] = {}
    trace.stamp(hops, "http", 100.0)
    trace.stamp(hops, "tok_out", 100.0042)
    trace.stamp(hops, "submit", 100.001)  # stamped out of order: the line follows HOPS
    trace.stamp(hops, "tok_out", 200.0, first=True)  # kept: already stamped
    trace.stamp(None, "http")  # untraced: nothing to do
    hops["step"] = 7
    line = request_line(hops, {"rid": "abc", "prompt": 16})
    fields = parse_request_line("[2026 INFO minisgl.server] " + line)
    assert fields is not None and fields["rid"] == "abc" and fields["prompt"] == "16"
    assert fields["http"] == "+0.000" and fields["submit"] == "+1.000" and fields["tok_out"] == "+3.200"
    assert "tok_in" not in fields  # a hop the request did not pass
    assert float(fields["total"]) == pytest.approx(4.2) and fields["step"] == "7"
    assert float(fields["t0"]) == pytest.approx(100.0)
    assert line.index("submit=") < line.index("tok_out=")
    assert parse_request_line("step 3 decode reqs=1") is None


def test_messages_carry_the_trace() -> None:
    hops = {h: float(i) for i, h in enumerate(HOPS[:4])}
    init = DetokInit(3)
    for msg in (TokenizeMsg([1], input_ids=[5, 6], trace=hops), UserMsg(1, [5, 6], SamplingParams(), 9, init, hops),
                TokenOut(1, [7], None, None, init, trace=hops), UserReply(1, "x", trace=hops)):
        assert decode(encode(msg)).trace == hops
        msg.trace = None
        assert decode(encode(msg)).trace is None


def test_scheduler_stamps_hops_and_logs_steps(tiny_model_path, monkeypatch, log_lines) -> None:
    monkeypatch.setattr(trace, "ENABLED", True)
    llm = graph_llm(str(tiny_model_path("qwen3")), True, max_prefill_tokens=48, max_running_requests=4)
    sched = llm.scheduler

    def run(prompt: list[int], **params) -> dict[str, float]:
        req = llm._make_request(prompt, SamplingParams(max_tokens=3, temperature=0.0, ignore_eos=True, **params))
        req.trace = {"sched_in": trace.now()}
        sched.add(req)
        while sched.has_work:
            sched.step()
        return req.trace

    hops = run(list(range(300, 320)))
    assert hops["sched_in"] <= hops["admit"] <= hops["launched"] <= hops["ready"]
    step = [x for x in log_lines if x.startswith(f"step {int(hops['step'])} ")]
    assert len(step) == 1 and " extend reqs=1 tokens=20 graph=32 " in step[0], step
    assert any(" decode reqs=1 tokens=1 graph=1 " in x for x in log_lines)
    assert not any("runs eagerly" in x for x in log_lines)

    run(list(range(400, 460)))  # 60 tokens: chunked by max_prefill_tokens, every chunk in a graph
    assert not any("runs eagerly" in x for x in log_lines)
    for _ in range(2):  # prompt logprobs: logits at more rows than a graph keeps, said once
        run(list(range(500, 510)), prompt_logprobs=1)
    eager = [x for x in log_lines if "runs eagerly" in x]
    assert len(eager) == 1 and "prompt logprobs" in eager[0], eager
    assert any(' extend reqs=1 tokens=10 eager="prompt logprobs' in x for x in log_lines)


def test_too_large_step_says_why_it_runs_eagerly(tiny_model_path, log_lines) -> None:
    llm = graph_llm(str(tiny_model_path("qwen3")), True, max_prefill_tokens=48, max_running_requests=4)
    eng = llm.engine
    row = eng.table.allocate_row()
    pages = eng.allocator.allocate(60)
    eng.write_slots([row] * 60, list(range(60)), eng.allocator.slot_ids(pages))
    batch = eng.build_batch("extend", [row], [0], [list(range(700, 760))])
    assert batch.graph is None and eng.steps.eager_reason == "no captured extend graph fits 60 tokens of 1 requests"
    eng.build_batch("extend", [row], [0], [list(range(700, 759))])
    assert len([x for x in log_lines if "runs eagerly" in x]) == 1


def test_http_connections_get_tcp_nodelay() -> None:
    """The listener the server hands uvicorn: every accepted connection must have TCP_NODELAY,
    or Nagle holds a stream's first chunk until the client's delayed ACK (~40 ms)."""
    listener = _bind("127.0.0.1", 0)
    listener.listen()
    seen: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:  # type: ignore[override]
            seen.append(transport.get_extra_info("socket").getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        server = await asyncio.get_running_loop().create_server(Probe, sock=listener)
        port = listener.getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        for _ in range(200):
            if seen:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()

    asyncio.run(main())
    assert seen and seen[0] != 0
