"""The bounded queue without processes: the API's admission (through the real app and a
scripted backend) and scheduler rank 0's bounds (a SchedulerProcess on fakes). The real
server under overload and its drain: tests/test_overload.py."""

from __future__ import annotations

import time
from collections import deque
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from api_fake import ScriptedBackend, make_client

from minisgl.core.sampling_params import SamplingParams
from minisgl.message import DetokInit, StartMsg, TokenizeMsg, UserMsg, UserReply, decode
from minisgl.message.addresses import Addresses
from minisgl.scheduler.process import SchedulerProcess
from minisgl.scheduler.queue_bounds import QUEUE_TIMEOUT, QUEUE_TOKENS, QueueBounds
from minisgl.scheduler.request import Request
from minisgl.server.admission import RETRY_AFTER_S, QueueLimits

COMPLETION = {"prompt": "hi", "max_tokens": 3}
OVERLOAD = "overload:"  # a prompt "overload:CODE" makes the stand-in scheduler refuse it with CODE


class OverloadingBackend(ScriptedBackend):
    def answer(self, msg: Any) -> list[UserReply]:
        if isinstance(msg, TokenizeMsg) and (msg.text or "").startswith(OVERLOAD):
            code = msg.text[len(OVERLOAD) :]
            return [UserReply(u, error=f"refused: {code}", error_code=code) for u in msg.uids]
        return super().answer(msg)


def client_with(limits: QueueLimits) -> tuple[Any, Any]:
    client, backend = make_client()
    frontend = backend.frontend
    frontend.admission.limits = limits
    backend = OverloadingBackend(frontend)
    frontend._push = [backend]
    return client, frontend


def refusals(client: Any, reason: str) -> float:
    text = client.get("/metrics").text
    line = next(x for x in text.splitlines() if x.startswith(f'minisgl_requests_refused_total{{reason="{reason}"}}'))
    return float(line.split()[-1])


def assert_overloaded(r: Any, code: str) -> None:
    assert r.status_code == 503, r.text
    assert r.headers["retry-after"] == str(RETRY_AFTER_S)
    err = r.json()["error"]
    assert err["type"] == "server_overloaded" and err["code"] == code and err["param"] is None
    assert err["message"]


def test_queue_full_is_refused_before_tokenizing() -> None:
    client, frontend = client_with(QueueLimits(max_queued_requests=3))
    frontend.queued.update({1001, 1002})  # two generations waiting for their first token
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200  # 2 + 1 <= 3
    frontend.queued.add(1003)
    sent = len(frontend._push[0].seen)
    for route, body in (
        ("/v1/completions", COMPLETION),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}),
        ("/generate", {"text": "hi"}),
    ):
        assert_overloaded(client.post(route, json=body), "queue_full")
    assert len(frontend._push[0].seen) == sent  # nothing reached a tokenizer
    assert refusals(client, "queue_full") == 3
    # /tokenize is no generation: it does not queue.
    assert client.post("/tokenize", json={"prompt": "hi"}).status_code == 200


def test_a_request_is_never_refused_by_an_empty_queue() -> None:
    client, frontend = client_with(QueueLimits(max_queued_requests=2))
    assert client.post("/v1/completions", json={**COMPLETION, "n": 5}).status_code == 200
    frontend.queued.add(1001)
    assert_overloaded(client.post("/v1/completions", json={**COMPLETION, "n": 2}), "queue_full")
    assert client.post("/v1/completions", json=COMPLETION).status_code == 200


def test_queue_count_follows_first_replies() -> None:
    _, frontend = client_with(QueueLimits(max_queued_requests=2))
    frontend._push = [SimpleNamespace(send=lambda data: None)]  # a backend that has not answered yet
    a = frontend.submit([TokenizeMsg([0, 0], text="hi")])  # n = 2
    assert len(frontend.queued) == 2
    with pytest.raises(Exception, match="2 requests are waiting"):
        frontend.submit([TokenizeMsg([0], text="hi")])
    frontend._dispatch(UserReply(a.uids[0], "x", [10]))  # its first token: generating, no longer queued
    assert frontend.queued == {a.uids[1]} and frontend.in_flight == 2
    assert "minisgl_queued_generations 1.0" in frontend.metrics.render().decode()
    b = frontend.submit([TokenizeMsg([0], text="hi")])
    frontend._dispatch(UserReply(a.uids[1], error="bad", error_param="prompt"))
    frontend.abort(b)
    assert frontend.queued == set() and frontend.in_flight == 1


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("code", [QUEUE_TOKENS, QUEUE_TIMEOUT])
def test_scheduler_refusals_are_503s(code: str, stream: bool) -> None:
    # The first reply is awaited before any status, streams too: a refusal before admission
    # is a 503 with Retry-After, never a 200 with an error event.
    client, frontend = client_with(QueueLimits())
    r = client.post("/v1/completions", json={"prompt": OVERLOAD + code, "max_tokens": 3, "stream": stream})
    assert_overloaded(r, code)
    assert refusals(client, code) == 1
    assert not frontend.queued and not frontend.in_flight
    assert 'minisgl_requests_total{finish_reason="error"} 0.0' in client.get("/metrics").text


def test_admission_deadline_is_stamped() -> None:
    client, frontend = client_with(QueueLimits(max_queue_wait_s=5.0))
    before = time.monotonic()
    client.post("/v1/completions", json=COMPLETION)
    client.post("/tokenize", json={"prompt": "hi"})
    gen, tok = (m for m in frontend._push[0].seen if isinstance(m, TokenizeMsg))
    assert before + 5.0 - 1.0 <= gen.admit_by <= time.monotonic() + 5.0
    assert tok.admit_by is None  # /tokenize never queues
    client, frontend = client_with(QueueLimits())
    client.post("/v1/completions", json=COMPLETION)
    assert frontend._push[0].seen[-1].admit_by is None


def test_draining_refuses_everything_and_health_says_so() -> None:
    client, frontend = client_with(QueueLimits())
    assert client.get("/health").json() == {"status": "ok"}
    frontend.admission.start_drain()
    h = client.get("/health")
    assert h.status_code == 503 and h.json()["status"] == "draining" and "draining" in h.json()["reason"]
    for route, body in (
        ("/v1/completions", COMPLETION),
        ("/tokenize", {"prompt": "hi"}),
        ("/detokenize", {"tokens": [10]}),
    ):
        r = client.post(route, json=body)
        assert_overloaded(r, "draining")
        assert r.headers["connection"] == "close"
    assert client.get("/v1/models").status_code == 200  # reads still answer
    text = client.get("/metrics").text
    assert "minisgl_draining 1.0" in text and refusals(client, "draining") == 3


# ---- scheduler rank 0 ----


def req(uid: int, prompt: int, output: int = 0) -> Request:
    r = Request(uid, [5] * prompt, SamplingParams(max_tokens=8), 0, frozenset(), prompt + 8)
    r.output = [6] * output
    return r


def test_queue_bounds_tokens() -> None:
    b = QueueBounds(100)
    waiting = [req(1, 30), req(2, 20, output=10)]  # 60 tokens to prefill
    scans = []

    class View:  # the scheduler's waiting queue, counting the scans of it
        def __iter__(self):  # noqa: ANN204
            scans.append(1)
            return iter(waiting)

    view = View()

    assert b.refuse(view, 40, None, 0.0) is None  # 60 + 40 = 100
    code, message = b.refuse(view, 1, None, 0.0)
    assert code == QUEUE_TOKENS and "--max-queued-tokens 100" in message and "100 prompt tokens" in message
    assert len(scans) == 1  # one scan per batch of messages
    b.new_batch()
    waiting.clear()
    assert b.refuse(view, 500, None, 0.0) is None  # an empty queue takes any prompt
    assert b.refuse(view, 1, None, 0.0)[0] == QUEUE_TOKENS
    assert QueueBounds(0).refuse(view, 10**9, None, 0.0) is None  # no bound


def test_queue_bounds_deadlines() -> None:
    b = QueueBounds(0)
    assert b.refuse([], 5, 10.0, now=10.0)[0] == QUEUE_TIMEOUT  # late already on arrival
    assert b.refuse([], 5, 10.0, now=9.0) is None
    fresh, old, retracted, untracked = req(1, 5), req(2, 5), req(3, 5, output=2), req(4, 5)
    for r, deadline in ((fresh, 20.0), (old, 10.0), (retracted, 10.0)):
        b.track(r.uid, deadline)
    assert b.expired([fresh, old, retracted, untracked], now=15.0) == [old]
    b.forget(2)
    assert b.expired([old], now=15.0) == []


def test_queue_bounds_scan_only_once_a_deadline_passed() -> None:
    b, scans = QueueBounds(0), []
    late, later = req(1, 5), req(2, 5)

    class View:  # the waiting queue, counting the scans of it
        def __iter__(self):  # noqa: ANN204
            scans.append(1)
            return iter([late, later])

    assert b.expired(View(), now=0.0) == [] and not scans  # nothing tracked
    b.track(1, 10.0), b.track(2, 30.0)
    assert b.expired(View(), now=9.0) == [] and not scans  # before the earliest deadline
    assert b.expired(View(), now=10.0) == [late] and len(scans) == 1
    b.forget(1)
    assert b.expired(View(), now=20.0) == [] and len(scans) == 1  # next deadline 30
    assert b.expired(View(), now=30.0) == [later] and len(scans) == 2


def test_scheduler_process_refuses_and_expires(tmp_path: Path) -> None:
    waiting: deque[Request] = deque()
    engine = SimpleNamespace(
        model_config=SimpleNamespace(eos_token_ids=[2]),
        tp=SimpleNamespace(rank=0, size=1),
        cpu_group=None,
        max_model_len=64,
    )
    sched = SimpleNamespace(add_check=lambda r: None, grammar=SimpleNamespace(compiler=None), waiting=waiting)
    addrs = Addresses.ipc(tmp_path, 1)
    ctx = zmq.Context()
    api = ctx.socket(zmq.PULL)
    api.bind(addrs.api)
    try:
        proc = SchedulerProcess(engine, sched, addrs, StartMsg(64, 100, []), max_queued_tokens=10)  # type: ignore[arg-type]

        def user(uid: int, n: int, admit_by: float | None) -> UserMsg:
            return UserMsg(uid, [5] * n, SamplingParams(max_tokens=4), 0, DetokInit(n), admit_by=admit_by)

        now = time.monotonic()
        proc.bounds.new_batch()
        proc.apply(user(1, 6, now + 60))
        proc.apply(user(2, 6, now + 60))  # 6 + 6 > 10
        proc.apply(user(3, 4, now - 1))  # its deadline passed on the way
        (r2,) = decode(api.recv()).replies
        (r3,) = decode(api.recv()).replies
        assert (r2.uid, r2.error_code) == (2, QUEUE_TOKENS) and (r3.uid, r3.error_code) == (3, QUEUE_TIMEOUT)
        assert [(i[0], i[1].uid) for i in proc.inputs] == [("add", 1)]
        waiting.append(proc.inputs.pop()[1])  # as apply_inputs does at the exchange
        proc.expire()
        assert proc.inputs == []  # not due yet
        proc.bounds.track(1, now - 0.5)  # its deadline moved into the past
        proc.expire()
        assert proc.inputs == [("finish", 1, "abort")] and 1 not in proc.reqs
        (r1,) = decode(api.recv()).replies
        assert (r1.uid, r1.error_code) == (1, QUEUE_TIMEOUT) and "--max-queue-wait-s" in r1.error
    finally:
        api.close(0)
        ctx.term()
