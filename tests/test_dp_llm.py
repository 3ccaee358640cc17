"""The offline `LLM(dp_size=2)`: prompts split across two replica processes, results in input
order and equal to one replica's."""

from __future__ import annotations

import random

import pytest

from minisgl import LLM, SamplingParams
from minisgl.offline.replicas import replica_options, split_by_cost


def _calls(llm: LLM, prompts: list, params: list[SamplingParams]) -> list[list[dict]]:
    """The same sequence of calls on each LLM: greedy, then unseeded sampling (whose seeds each
    LLM draws in input order), then stop strings."""
    return [
        llm.generate(prompts, params, use_tqdm=False),
        llm.generate(prompts, SamplingParams(max_tokens=6, temperature=0.9), use_tqdm=False),
        llm.generate(prompts[:4], SamplingParams(max_tokens=8, temperature=0.0, stop=[" the", "e"]), use_tqdm=False),
    ]


def assert_same(got: list[list[dict]], want: list[list[dict]]) -> None:
    """Equal results; the logprobs (fp32) within rounding, as the replicas' batches differ."""
    def strip(calls: list[list[dict]]) -> list[list[dict]]:
        return [[{k: v for k, v in r.items() if k != "logprobs"} for r in c] for c in calls]

    assert strip(got) == strip(want)
    for g, w in zip(got, want):
        assert [r["logprobs"] for r in g] == [pytest.approx(r["logprobs"], abs=1e-4) for r in w]


def test_dp2_returns_results_in_input_order_equal_to_dp1(tiny_model_path) -> None:
    path = str(tiny_model_path("llama3"))
    prompts = ["Hello, my name is", [5, 6, 7, 8, 9] * 9, "The capital of France is", [42],
               list(range(300, 377)), "def fib(n):", "Once upon a time, in a land far away", [7, 7, 7]]
    params = [SamplingParams(max_tokens=3 + 2 * (i % 4), temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    # The split puts requests of both replicas in an order unlike the input's.
    costs = [len(p) if isinstance(p, list) else 8 for p in prompts]
    shards = split_by_cost([c + sp.max_tokens for c, sp in zip(costs, params)], 2)
    assert all(shards) and shards[0] != list(range(len(shards[0])))
    want = _calls(LLM(path, device="cpu"), prompts, params)
    two = LLM(path, device="cpu", dp_size=2)
    workers = list(two._replicas.procs)
    try:
        assert len(workers) == 1 and workers[0].is_alive()
        got = _calls(two, prompts, params)
        with pytest.raises(ValueError, match="token id"):  # checked here, before any replica sees it
            two.generate([[1, 2], [10**9]], use_tqdm=False)
        again = two.generate(prompts[:2], params[:2], use_tqdm=False)  # still serving after a refusal
    finally:
        two.shutdown()
    assert_same(got, want)
    assert_same([again], [want[0][:2]])
    workers[0].join(30)
    assert not workers[0].is_alive()
    with pytest.raises(RuntimeError, match="shut down"):
        two.generate(prompts, params, use_tqdm=False)


@pytest.mark.parametrize(
    "kwargs,match",
    [({"dp_size": 0}, "dp_size must be an integer >= 1"), ({"dp_size": 2, "device": "cuda:1"}, "names one GPU")],
)
def test_bad_dp_size_is_refused(tiny_model_path, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        LLM(str(tiny_model_path("llama3")), **{"device": "cpu", **kwargs})


def test_split_by_cost_balances_and_keeps_input_order() -> None:
    rng = random.Random(3)
    costs = [rng.randrange(100, 2000) for _ in range(101)]
    shards = split_by_cost(costs, 3)
    assert sorted(i for s in shards for i in s) == list(range(101))
    assert all(s == sorted(s) for s in shards)
    totals = [sum(costs[i] for i in s) for s in shards]
    assert max(totals) - min(totals) <= max(costs)
    assert split_by_cost([5, 1], 4) == [[0], [1], [], []]


def test_offline_replicas_follow_each_other_on_the_gpus() -> None:
    # LLM(dp_size=2, tp_size=2, base_gpu_id=1): replica 1's ranks on GPUs 3 and 4
    assert replica_options({"tp_size": 2, "base_gpu_id": 1}, 1)["base_gpu_id"] == 3
    assert replica_options({}, 2)["base_gpu_id"] == 2
