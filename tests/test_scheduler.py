"""The scheduler under pressure: random arrivals, shared prefixes, cancellations and a KV
pool small enough to force eviction and retraction. Every request that is not cancelled
must finish with exactly the greedy tokens it gets alone, and no KV page may leak."""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams
from minisgl.scheduler.request import Request


@pytest.fixture(scope="module")
def model_path(tiny_model_path):
    return str(tiny_model_path("llama3"))


@pytest.fixture(scope="module")
def workload() -> list[tuple[list[int], int]]:
    rng = random.Random(1234)
    shared = [rng.randrange(100, 4000) for _ in range(40)]
    reqs = []
    for i in range(18):
        n = rng.choice([1, 5, 19, 33, 60])
        own = [rng.randrange(100, 4000) for _ in range(n)]
        prompt = (shared[: rng.choice([8, 24, 40])] + own) if i % 2 == 0 else own
        reqs.append((prompt, rng.choice([1, 6, 17, 30])))
    return reqs


@pytest.fixture(scope="module")
def alone(model_path, workload) -> list[list[int]]:
    llm = LLM(model_path, device="cpu", dtype="float32", cache="naive", disable_overlap=True)
    return [
        llm.generate([p], SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True), use_tqdm=False)[0][
            "token_ids"
        ]
        for p, m in workload
    ]


def run_random_arrivals(llm: LLM, workload, seed: int, cancel: set[int]) -> dict[int, Request]:
    rng = random.Random(seed)
    sched = llm.scheduler
    pending = list(enumerate(workload))
    reqs: dict[int, Request] = {}
    steps = 0
    while pending or sched.has_work:
        for _ in range(rng.choice([0, 0, 1, 3])):  # random arrivals between steps
            if pending:
                i, (prompt, max_tokens) = pending.pop(0)
                req = llm._make_request(prompt, SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True))
                reqs[i] = req
                sched.add(req)
        for i in cancel:  # cancel at a random point: queued, mid-prefill or decoding
            if i in reqs and not reqs[i].finished and rng.random() < 0.3:
                sched.finish(reqs[i], "abort")
        sched.step()
        steps += 1
        assert steps < 5000, "scheduler made no progress"
        sched.check_integrity()
    return reqs


@pytest.mark.parametrize(
    "options",
    [
        {"cache": "radix", "num_pages": 40, "page_size": 4, "max_prefill_tokens": 32},
        {"cache": "radix", "num_pages": 130, "page_size": 1, "max_prefill_tokens": 16, "disable_overlap": True},
        {"cache": "naive", "num_pages": 40, "page_size": 4, "max_prefill_tokens": 64},
        {"cache": "radix", "num_pages": 300, "page_size": 2, "max_prefill_tokens": 8192, "max_running_requests": 5},
    ],
    ids=["radix-tight-overlap", "radix-page1-chunky", "naive-tight", "radix-roomy"],
)
def test_random_arrivals_match_alone(model_path, workload, alone, options) -> None:
    llm = LLM(model_path, device="cpu", dtype="float32", **options)
    cancel = {3, 7, 12}
    reqs = run_random_arrivals(llm, workload, seed=len(options), cancel=cancel)
    for i, req in reqs.items():
        if req.finish_reason == "abort":
            assert i in cancel
            continue
        assert req.output == alone[i], f"request {i} differs from its solo run"
    sched = llm.scheduler
    assert not sched.running and not sched.waiting and sched.prefilling is None
    # Nothing leaked: every page is free or cached, and the cache can give all of it back.
    assert llm.engine.allocator.free_pages + sched.cache.cached_pages == llm.engine.allocator.total_pages
    assert sched.cache.protected_pages == 0
    if options["num_pages"] == 40:
        assert sched.num_retractions > 0, "the tight pool should have forced a retraction"


@pytest.mark.parametrize("budget", [7, 64, 8192])
@pytest.mark.parametrize("overlap", [True, False])
@pytest.mark.parametrize("cache", ["radix", "naive"])
def test_chunked_prefill_overlap_and_caches_agree(model_path, workload, alone, budget, overlap, cache) -> None:
    llm = LLM(
        model_path, device="cpu", dtype="float32", cache=cache, max_prefill_tokens=budget, disable_overlap=not overlap
    )
    prompts = [p for p, _ in workload[:8]]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for _, m in workload[:8]]
    out = llm.generate(prompts, params, use_tqdm=False)
    assert [o["token_ids"] for o in out] == alone[:8]
    llm.scheduler.check_integrity()


def test_prefix_cache_hits_on_repeat(model_path) -> None:
    llm = LLM(model_path, device="cpu", dtype="float32", page_size=4)
    prompt = list(range(200, 260))
    p = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
    first = llm.generate([prompt], p, use_tqdm=False)[0]["token_ids"]
    again = llm._make_request(prompt, p)
    llm.scheduler.add(again)
    while llm.scheduler.has_work:
        llm.scheduler.step()
    assert again.output == first
    assert again.cache_hit_tokens >= 56  # all whole pages of the prompt but the last token's
