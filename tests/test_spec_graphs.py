"""Speculative steps through the graph path on the CPU (tests/graph_replay.py's replay runner:
the engine's real CudaGraphRunner, layouts and padded index buffers; "graphs" replay by
running the captured step again). Verify steps replay verify graphs (one logits row per
token); greedy output equals speculation off, padding writes no KV slot but the dummy one
(the pools start as NaN), and the bucket a verify step takes is the smallest that fits."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import spec_models
import torch
from graph_replay import graph_llm
from kv_poison import assert_no_stray_writes, poison_and_track

from minisgl import LLM, SamplingParams
from minisgl.step.cuda_graph import verify_layouts
from minisgl.step.layout import StepLayout, StepSpec

K = 3
OPTS = dict(max_prefill_tokens=48, mixed_chunk_tokens=20, max_running_requests=6, page_size=2)


def test_verify_layouts_follow_the_draft_table() -> None:
    table = {1: 4, 3: 2, 8: 0}

    def k_for(b: int) -> int:
        return table[max(s for s in table if s <= b)]

    got = [(x.tokens, x.requests, x.tiles) for x in verify_layouts([1, 2, 4, 8, 16], k_for, block_m=16)]
    # b = 4 serves 3..4 (K = 2); b = 8 serves 5..8, and 5..7 still speculate with K = 2; 16: K = 0.
    assert got == [(5, 5, 1), (10, 10, 2), (12, 12, 4), (24, 24, 8)]
    want = [StepLayout("extend", 8, 8, 2, 0, verify=True)]
    assert verify_layouts([1, 64], lambda b: 7, block_m=4, max_tokens=100) == want


@pytest.fixture(scope="module")
def target(tiny_model_path) -> str:
    return str(tiny_model_path("llama3"))


@pytest.fixture(scope="module")
def workload() -> tuple[list[list[int]], list[SamplingParams]]:
    rng = random.Random(7)
    phrase = [rng.randrange(300, 3000) for _ in range(9)]
    prompts = [phrase * 5, [rng.randrange(300, 3000) for _ in range(3)], phrase * 2 + [5, 6],
               [rng.randrange(300, 3000) for _ in range(20)]]
    return prompts, [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (30, 7, 11, 25)]


@pytest.fixture(scope="module")
def plain(target, workload) -> list[dict]:
    return LLM(target, device="cpu", dtype="float32", **OPTS).generate(*workload, use_tqdm=False)


@pytest.fixture(scope="module")
def eagle3_head(target, tmp_path_factory) -> str:
    return str(spec_models.build_eagle3_head(Path(target), tmp_path_factory.mktemp("eagle3")))


@pytest.mark.parametrize("algo,table", [("ngram", None), ("ngram", {"1": K, "3": 0}), ("draft-self", {"1": K, "3": 0}),
                                        ("eagle3", None)])
def test_verify_graphs_equal_plain(target, eagle3_head, workload, plain, tmp_path, algo, table) -> None:
    """Verify steps replay verify graphs, a draft model's K/V mirror rides in the target's
    graphs, draft chains replay their own (with a table that turns speculation off at 3+
    requests, plain decodes replay decode graphs between verify steps); greedy output equals
    speculation off, and the target as its own draft accepts every token."""
    opts = {"ngram": {"speculative_algorithm": "ngram", "speculative_ngram_min": 2},
            "draft-self": {"speculative_algorithm": "draft", "speculative_draft_model": target},
            "eagle3": {"speculative_algorithm": "eagle3", "speculative_draft_model": eagle3_head}}[algo]
    if table is not None:
        (tmp_path / "t.json").write_text(json.dumps({"num_draft_tokens": table}))
        opts["speculative_draft_table"] = str(tmp_path / "t.json")
    llm = graph_llm(target, decode_kernel=True, speculative_num_draft_tokens=K, **opts, **OPTS)
    runner, drafter = llm.engine.graphs, llm.engine.drafter
    assert [x.tokens for x in runner.verify] == ([4, 8, 16] if table is None else [4, 8])
    handed_out = poison_and_track(llm)
    spec_models.assert_same_outputs(llm.generate(*workload, use_tqdm=False), plain)
    st = llm.scheduler.stats()
    assert runner.replays["verify"] > 0 and st["spec_verified"] > 0
    if table is not None:
        assert runner.replays["decode"] > 0
    if algo != "ngram":
        assert drafter.steps.graphs.replays["decode"] > 0, "the draft chain replays its graphs"
    if algo == "draft-self":
        assert st["spec_accepted"] == st["spec_proposed"] > 0
    assert_no_stray_writes(llm, handed_out)
    llm.scheduler.check_integrity()


def test_verify_step_takes_the_smallest_fitting_layout(target) -> None:
    llm = graph_llm(target, decode_kernel=True, speculative_algorithm="ngram", speculative_num_draft_tokens=K,
                    **OPTS)
    runner, eng = llm.engine.graphs, llm.engine

    def layout(ext: list[int]) -> StepLayout | None:
        spec = StepSpec("extend", list(range(len(ext))), [5] * len(ext), [[1] * e for e in ext], all_rows=True)
        return runner.layout_for(spec)

    assert layout([4]).tokens == 4  # one request, K = 3: the b = 1 verify graph
    assert layout([2, 1]).tokens == 8  # b = 2
    assert layout([4, 4, 1]).tokens == 16  # b = 3 takes b = 4's graph
    big = layout([4, 4, 4, 4, 4, 4])  # 24 tokens: past the verify graphs; extend bucket 32 has 6 rows
    assert big is None
    # Without all_rows an extend step of 24 tokens takes the 32-token prefill bucket.
    assert runner.layout_for(StepSpec("extend", list(range(6)), [5] * 6, [[1] * 4] * 6)).tokens == 32
    # A verify batch on the graph path: logits at every token equal the eager forward's.
    rows = [eng.table.allocate_row() for _ in range(2)]
    for row in rows:
        pages = eng.allocator.allocate(8)
        eng.write_slots([row] * 16, list(range(16)), eng.allocator.slot_ids(pages))
    toks = [[7, 8, 9, 10], [11, 12]]
    eng.forward(eng.build_batch("extend", rows, [0, 0], [[3, 4, 5, 6, 7], [5, 6, 7, 8, 9]], use_graphs=False))
    batch = eng.build_batch("extend", rows, [5, 5], toks, all_rows=True)
    assert batch.graph is not None and batch.graph.tokens == 8 and batch.all_rows
    got = eng.forward(batch, all_positions=True)
    want = eng.forward(eng.build_batch("extend", rows, [5, 5], toks, use_graphs=False), all_positions=True)
    assert got.shape == (6, eng.model_config.vocab_size)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="all_rows"):
        eng.forward(batch)
