"""Mixed steps: the scheduler's decisions (a prompt that arrives while others decode joins
the very next step with every decode; prompt tokens per step stay within the budget; a long
prompt is chunked across steps that keep decoding), and their tokens equal solo runs."""

from __future__ import annotations

import pytest

from minisgl import LLM, SamplingParams

GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_path(tiny_model_path):
    return str(tiny_model_path("llama3"))


def record_steps(llm: LLM) -> list[tuple[str, int, list[int]]]:
    """Every batch the scheduler builds: (mode, decodes, prompt tokens per extending request)."""
    steps: list[tuple[str, int, list[int]]] = []
    build = llm.engine.build_batch

    def recording(mode, rows, prefix, new, use_graphs=True, extra_logit_rows=None):  # noqa: ANN001
        new_list = [None] * len(rows) if new is None else list(new)
        decodes = sum(t is None for t in new_list) if mode != "decode" else len(rows)
        steps.append((mode, decodes, [len(t) for t in new_list if t is not None and mode != "decode"]))
        return build(mode, rows, prefix, new, use_graphs, extra_logit_rows)

    llm.engine.build_batch = recording
    return steps


def step_until(llm: LLM, cond) -> None:  # noqa: ANN001
    for _ in range(200):
        if cond():
            return
        llm.scheduler.step()
    raise AssertionError("condition never met")


def test_prompt_joins_the_next_step_with_all_decodes(model_path) -> None:
    llm = LLM(model_path, device="cpu", dtype="float32", mixed_chunk_tokens=16, max_prefill_tokens=64)
    sched = llm.scheduler
    first = [llm._make_request(list(range(200 + 9 * i, 209 + 9 * i)), GREEDY) for i in range(3)]
    for r in first:
        sched.add(r)
    steps = record_steps(llm)
    step_until(llm, lambda: len(sched.running) == 3 and all(r.output for r in first))
    late = llm._make_request(list(range(900, 950)), GREEDY)  # 50 prompt tokens: 4 chunks of <= 16
    sched.add(late)
    before = len(steps)
    step_until(llm, lambda: late.cached_len == len(late.prompt))
    joined = steps[before:]
    # Every step since the arrival: the 3 decodes and a chunk of the new prompt, nothing else.
    assert [s[0] for s in joined] == ["mixed"] * 4, joined
    assert all(d == 3 for _, d, _ in joined)
    assert [c for _, _, cs in joined for c in cs] == [16, 16, 16, 2]
    while sched.has_work:
        sched.step()
    alone = LLM(model_path, device="cpu", dtype="float32", mixed_chunk_tokens=0)
    for r in [*first, late]:
        assert r.output == alone.generate([r.prompt], GREEDY, use_tqdm=False)[0]["token_ids"]


PROMPTS = [list(range(100 + 3 * i, 100 + 3 * i + n)) for i, n in enumerate([5, 30, 61, 12, 3, 47])]
PARAMS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 3, 14, 6, 11, 5)]


@pytest.fixture(scope="module")
def unchunked(model_path) -> list[list[int]]:
    ref = LLM(model_path, device="cpu", dtype="float32", mixed_chunk_tokens=0, max_prefill_tokens=8192)
    return [o["token_ids"] for o in ref.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("mixed", [0, 7, 24])
def test_token_budgets_hold(model_path, unchunked, mixed: int) -> None:
    budget = 40
    llm = LLM(model_path, device="cpu", dtype="float32", mixed_chunk_tokens=mixed, max_prefill_tokens=budget)
    steps = record_steps(llm)
    out = llm.generate(PROMPTS, PARAMS, use_tqdm=False)
    for mode, decodes, chunks in steps:
        assert sum(chunks) <= (min(mixed, budget) if mode == "mixed" else budget), (mode, chunks)
        assert mode != "mixed" or (decodes >= 1 and chunks)
    modes = {m for m, _, _ in steps}
    assert ("mixed" in modes) == (mixed > 0)
    if mixed == 0:  # prefill and decode steps alternate while both have work
        assert any(a == "extend" and b == "decode" for (a, *_), (b, *_) in zip(steps, steps[1:]))
    assert [o["token_ids"] for o in out] == unchunked
    llm.scheduler.check_integrity()


def test_offline_llm_mixes_whole_prefill_chunks_by_default(model_path) -> None:
    """The offline LLM's mixed chunk is max_prefill_tokens unless given (throughput: nothing
    streams); the server keeps the 384-token latency budget (ServerArgs passes it only if set)."""
    from minisgl.launch.args import ServerArgs
    from minisgl.scheduler.config import SchedulerConfig

    with LLM(model_path, device="cpu", dtype="float32", max_prefill_tokens=96) as llm:
        assert llm.scheduler.cfg.mixed_chunk_tokens == 96
    with LLM(model_path, device="cpu", dtype="float32", mixed_chunk_tokens=16) as llm:
        assert llm.scheduler.cfg.mixed_chunk_tokens == 16
    assert ServerArgs().mixed_chunk_tokens is None and SchedulerConfig().mixed_chunk_tokens == 384
