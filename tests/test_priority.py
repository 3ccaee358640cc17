"""Request priorities (`--scheduling-policy priority`, the request field `priority`), at the
scheduler: the waiting queue in (priority, arrival) order, the lowest priority retracted first
under KV pressure, and a high-priority request admitted at the next step through a full pool
of low-priority work, with every request's greedy tokens those it gets alone."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.priority import retraction_order
from minisgl.scheduler.request import Request


@pytest.fixture(scope="module")
def model(tiny_model_path: Callable[[str], Path]) -> str:
    return str(tiny_model_path("llama3"))


def _prompts(n: int, length: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(100, 5000) for _ in range(length)] for _ in range(n)]


def _req(llm: LLM, prompt: list[int], max_tokens: int, priority: int) -> Request:
    return llm._make_request(
        prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, priority=priority)
    )


def _alone(llm: LLM, prompt: list[int], max_tokens: int) -> list[int]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return llm.generate([prompt], params, use_tqdm=False)[0]["token_ids"]


def _llm(model: str, **kw) -> LLM:  # noqa: ANN003
    """A CPU LLM with small pages under the priority policy (kw overrides, e.g. the pool size)."""
    return LLM(model, **{"device": "cpu", "dtype": "float32", "page_size": 4, "scheduling_policy": "priority", **kw})


def test_waiting_queue_order_and_fcfs_refusal(model: str) -> None:
    llm = _llm(model, num_pages=64)
    sched = llm.scheduler
    reqs = [_req(llm, p, 2, prio) for p, prio in zip(_prompts(7, 6, 1), [3, 1, 3, -2, 1, 3, 0])]
    for r in reqs:
        sched.add(r)
    # Equal priorities keep their arrival order.
    want = sorted(range(7), key=lambda i: (reqs[i].params.priority, i))
    assert [reqs.index(r) for r in sched.waiting] == want
    fcfs = _llm(model, num_pages=64, scheduling_policy="fcfs")
    with pytest.raises(ValueError, match="^priority: .*--scheduling-policy priority") as e:
        fcfs.scheduler.add(_req(fcfs, [5, 6, 7], 2, 1))
    assert e.value.param == "priority"
    fcfs.scheduler.add(_req(fcfs, [5, 6, 7], 2, 0))  # 0 is every request's priority under fcfs


def test_retraction_order() -> None:
    class R:  # what retraction_order reads of a request
        def __init__(self, uid: int, priority: int, done: int) -> None:
            self.uid, self.output = uid, [0] * done
            self.params = SamplingParams(priority=priority)

    reqs = [R(0, 1, 5), R(1, 9, 30), R(2, 1, 2), R(3, 9, 2), R(4, -3, 0)]
    assert [r.uid for r in retraction_order(reqs, by_priority=True)] == [3, 1, 2, 0, 4]
    assert [r.uid for r in retraction_order(reqs, by_priority=False)] == [4, 3, 2, 0, 1]


@pytest.mark.parametrize("high", [0, 5], ids=["higher", "equal"])
def test_high_priority_admitted_at_the_next_step_through_a_full_pool(model: str, high: int) -> None:
    """Five low-priority (5) requests, each needing ~17 of the pool's 40 pages: two run, three
    wait. A priority-0 request is admitted by the very next step (a low one is retracted to make
    room) and finishes before any waiting low one starts; at equal priority it waits its turn."""
    llm = _llm(model, num_pages=40, max_prefill_tokens=64, mixed_chunk_tokens=64)
    sched = llm.scheduler
    lows = [_req(llm, p, 60, 5) for p in _prompts(5, 8, 2)]
    for r in lows:
        sched.add(r)
    for _ in range(4):
        sched.step()
    waiting = list(sched.waiting)
    assert len(sched.running) >= 1 and len(waiting) >= 2, "the pool should be full and requests waiting"
    urgent = _req(llm, _prompts(1, 8, 3)[0], 4, high)
    sched.add(urgent)
    sched.step()
    if high == 5:
        assert urgent in sched.waiting and sched.waiting[-1] is urgent  # behind the earlier equals
        return
    assert urgent in sched.running or urgent is sched.prefilling, "not admitted at the next step"
    assert sched.num_retractions >= 1
    while not urgent.finished:
        sched.step()
    assert all(not r.output for r in waiting), "a low-priority request started before the urgent one ended"
    while sched.has_work:
        sched.step()
    sched.check_integrity()
    for r in [*lows, urgent]:  # retraction cost nothing but time: the greedy tokens of each alone
        assert r.output == _alone(llm, r.prompt, r.params.max_tokens)


def test_kv_pressure_retracts_the_lowest_priority_first(model: str) -> None:
    """An admission estimate of 0 lets every request in; the decodes then outgrow the pool and
    requests are retracted: each time the lowest priority of those holding KV."""
    llm = _llm(model, num_pages=24, init_new_token_ratio=0.0, min_new_token_ratio=0.0, new_token_ratio_decay=0.0)
    sched = llm.scheduler
    reqs = [_req(llm, p, 24, prio) for p, prio in zip(_prompts(4, 8, 4), [3, 1, 7, 2])]
    victims: list[tuple[int, int]] = []
    retract = sched._retract

    def record(req: Request) -> None:
        victims.append((req.params.priority, max(r.params.priority for r in sched.queues.active)))
        retract(req)

    sched._retract = record  # type: ignore[method-assign]
    for r in reqs:
        sched.add(r)
    while sched.has_work:
        sched.step()
    assert victims and victims[0][0] == 7 and all(p == top for p, top in victims), victims
    sched.check_integrity()
    for r in reqs:
        assert r.output == _alone(llm, r.prompt, 24)
