"""The graph path on the CPU: the engine's real CudaGraphRunner (bucket choice, padded index
buffers, tile maps, a mixed step's decode rows) with "graphs" that replay by running the
captured step again over the static buffer and writing into the captured tensors, as a CUDA
graph's replay writes its static memory. Greedy tokens through the scheduler (prefill padded
to buckets, chunked prefill, prefix hits, mixed steps, decode batches padded) must equal the
plain CPU engine's, and padding must write no KV slot but the dummy one (the pool starts as
NaN). The attention kernels run as their torch references here (the Triton kernels, tile map
included, have their own interpreter tests)."""

from __future__ import annotations

import pytest
import torch
from graph_replay import graph_llm
from kv_poison import assert_no_stray_writes, poison_and_track

from minisgl import LLM, SamplingParams

PROMPTS = [list(range(300, 317)), [42], list(range(1000, 1070)), [5, 6, 7, 8] * 5, list(range(300, 330))]
PARAMS = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 14, 6, 11, 8)]


OPTS = dict(max_prefill_tokens=48, mixed_chunk_tokens=20, max_running_requests=6, page_size=2)


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_path) -> list[list[int]]:
    llm = LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", **OPTS)
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["decode-rows", "decode-tiles"])
def test_replayed_graphs_equal_eager(tiny_model_path, eager_tokens, decode_kernel: bool) -> None:
    llm = graph_llm(str(tiny_model_path("qwen3")), decode_kernel, **OPTS)
    eng = llm.engine
    runner = eng.graphs
    assert [x.tokens for x in runner.extend] == [16, 32, 48]  # up to max_prefill_tokens
    assert [x.tokens for x in runner.mixed] == ([16, 26] if decode_kernel else [])  # 6 decodes + 20
    handed_out = poison_and_track(llm)  # every slot unused so far; padding may write only the dummy
    got = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
    assert got == eager_tokens
    assert runner.replays["extend"] >= 1 and runner.replays["decode"] > 3
    assert runner.replays["mixed" if decode_kernel else "extend"] > 3
    assert_no_stray_writes(llm, handed_out)
    llm.scheduler.check_integrity()


def test_score_through_a_graph_batch_runs_eagerly(tiny_model_path) -> None:
    """All positions' logits of a step built for a graph (the graph keeps only sampled rows)."""
    path = str(tiny_model_path("qwen3"))
    llm = graph_llm(path, True, max_prefill_tokens=48, max_running_requests=4)
    eng = llm.engine
    prompt = list(range(700, 719))
    want = eng.score([prompt])[0]
    row = eng.table.allocate_row()
    pages = eng.allocator.allocate(len(prompt))
    eng.write_slots([row] * len(prompt), list(range(len(prompt))), eng.allocator.slot_ids(pages))
    batch = eng.build_batch("extend", [row], [0], [prompt])
    assert batch.graph is not None and batch.graph.tokens == 32
    torch.testing.assert_close(eng.forward(batch, all_positions=True), want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(eng.forward(batch), want[-1:], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("decode_kernel", [True, False], ids=["decode-rows", "decode-tiles"])
@pytest.mark.parametrize("graphs", [True, False], ids=["replayed", "eager"])
def test_mixed_step_logits_equal_separate_steps(tiny_model_path, decode_kernel: bool, graphs: bool) -> None:
    """Two decodes and a prompt chunk on a cached prefix in one mixed step: each request's
    logits equal scoring its whole sequence from scratch."""
    path = str(tiny_model_path("qwen3"))
    llm = graph_llm(path, decode_kernel, max_prefill_tokens=48, max_running_requests=4, page_size=4)
    eng = llm.engine
    gen = torch.Generator().manual_seed(3)
    seqs = [torch.randint(0, 5000, (n,), generator=gen).tolist() for n in (10, 15, 26)]
    cached = [9, 14, 5]  # A and B decode their last token; C runs tokens 5..25
    rows = [eng.table.allocate_row() for _ in seqs]
    for row, seq in zip(rows, seqs):
        pages = eng.allocator.allocate(-(-len(seq) // 4))
        eng.write_slots([row] * len(seq), list(range(len(seq))), eng.allocator.slot_ids(pages)[: len(seq)])
    for row, seq, n in zip(rows, seqs, cached):  # the cached prefixes, eagerly
        eng.forward(eng.build_batch("extend", [row], [0], [seq[:n]], use_graphs=False))
    eng.token_buffer[torch.tensor(rows[:2])] = torch.tensor([seqs[0][-1], seqs[1][-1]])
    batch = eng.build_batch("mixed", rows, cached, [None, None, seqs[2][5:]], use_graphs=graphs)
    assert (batch.graph is not None) == graphs and (batch.decode_rows is not None) == decode_kernel
    got = eng.forward(batch)
    for i, seq in enumerate(seqs):
        torch.testing.assert_close(got[i], eng.score([seq])[0][-1], rtol=1e-4, atol=1e-4)


def test_mixed_chunk_fills_the_largest_bucket_within_the_budget(tiny_model_path) -> None:
    """A mixed step's prompt chunk is trimmed so decodes + chunk fill a captured bucket (the
    mixed ladder here is [16, 26]: 6 requests + a 20-token budget), never padded past it."""
    llm = graph_llm(str(tiny_model_path("qwen3")), True, **OPTS)
    chunk = llm.scheduler._mixed_chunk
    assert [chunk(d) for d in (1, 3, 5, 6)] == [15, 13, 11, 20]
    llm.engine.graphs = None  # eager: the budget as it is
    assert chunk(3) == 20
