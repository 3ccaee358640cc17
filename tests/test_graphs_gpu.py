"""Prefill, extend on a cached prefix, chunked prefill and mixed steps through their captured
CUDA graphs (padded to token buckets) against the eager forward of the same step: the same
greedy tokens, else a bf16 near-tie in eager's logits; and padding writes no KV slot but the
dummy one (the pool starts as NaN: a stray write or read of an unused slot shows)."""

from __future__ import annotations

import bf16_tie
import pytest
import torch
from kv_poison import assert_no_stray_writes, poison_and_track

from minisgl import LLM, SamplingParams

pytestmark = pytest.mark.gpu


def compare(eager: torch.Tensor, graph: torch.Tensor, what: str) -> None:
    assert torch.isfinite(graph).all(), what
    rel = ((graph - eager).norm() / eager.norm()).item()
    assert rel < 2e-2, f"{what}: logits differ by {rel:.3g} (relative)"
    for i, (e, g) in enumerate(zip(eager, graph)):
        want, got = int(e.argmax()), int(g.argmax())
        if want != got:
            bf16_tie.assert_near_tie(e, want, got, i)


def step_both_ways(eng, mode: str, rows: list[int], prefix: list[int], new: list) -> torch.Tensor:  # noqa: ANN001
    """The same step eagerly and through its graph (each writes the same slots' K/V); returns
    the graph's logits."""
    eager = eng.forward(eng.build_batch(mode, rows, prefix, new, use_graphs=False)).float().clone()
    batch = eng.build_batch(mode, rows, prefix, new)
    assert batch.graph is not None, f"{mode} step of {batch.num_tokens} tokens found no graph"
    got = eng.forward(batch).float().clone()
    compare(eager, got, f"{mode} {[0 if t is None else len(t) for t in new]}")
    return got


@pytest.mark.parametrize("backend", ["cuda", "triton"])
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("name", ["llama3", "qwen3"])
def test_graph_steps_equal_eager(tiny_model_path, name: str, page_size: int, backend: str) -> None:
    llm = LLM(str(tiny_model_path(name)), device="cuda", dtype="bfloat16", page_size=page_size,
              attention_backend=backend, max_prefill_tokens=256, max_running_requests=8)
    eng = llm.engine
    assert eng.graphs is not None and eng.graphs.extend
    gen = torch.Generator().manual_seed(page_size)
    lens = [37, 150, 12, 20, 9]
    seqs = [torch.randint(0, 5000, (n + 1,), generator=gen).tolist() for n in lens]
    rows = [eng.table.allocate_row() for _ in seqs]
    for row, seq in zip(rows, seqs):
        pages = eng.allocator.allocate(-(-len(seq) // page_size))
        eng.write_slots([row] * len(seq), list(range(len(seq))), eng.allocator.slot_ids(pages)[: len(seq)])
    a, b, c, d, e = rows
    step_both_ways(eng, "extend", [a], [0], [seqs[0][:37]])  # a prefill, padded to a bucket
    for lo, hi in ((0, 64), (64, 128), (128, 150)):  # chunked prefill: 64-token chunks
        step_both_ways(eng, "extend", [b], [lo], [seqs[1][lo:hi]])
    step_both_ways(eng, "extend", [c, d], [0, 0], [seqs[2][:5], seqs[3][:20]])
    step_both_ways(eng, "extend", [c], [5], [seqs[2][5:12]])  # on a cached prefix
    # Mixed: a, b, d decode (inputs from the token buffer), e prefills 9 tokens.
    eng.token_buffer[torch.tensor([a, b, d], device="cuda")] = torch.tensor(
        [seqs[0][37], seqs[1][150], seqs[3][20]], device="cuda")
    got = step_both_ways(eng, "mixed", [a, b, d, e], [37, 150, 20, 0], [None, None, None, seqs[4][:9]])
    # Eager and graph share the decode kernel for the decodes: also against scoring each whole
    # sequence from scratch (extend tiles only), so a wrong decode row cannot hide in both.
    scratch = [seqs[0][:38], seqs[1][:151], seqs[3][:21], seqs[4][:9]]
    compare(torch.stack([eng.score([s])[0][-1] for s in scratch]).to(got.device), got, "mixed vs scratch")


@pytest.mark.parametrize("page_size", [1, 16])
def test_padding_writes_only_the_dummy_slot(tiny_model_path, page_size: int) -> None:
    path = str(tiny_model_path("qwen3"))
    opts = dict(device="cuda", dtype="bfloat16", page_size=page_size, max_prefill_tokens=64, mixed_chunk_tokens=24,
                max_running_requests=8)
    prompts = [list(range(300, 317)), [42], list(range(1000, 1100)), [5, 6, 7, 8] * 5, list(range(300, 340))]
    params = [SamplingParams(max_tokens=m, temperature=0.0, ignore_eos=True) for m in (9, 14, 6, 11, 8)]
    ref = LLM(path, disable_cuda_graph=True, **opts)
    want = [o["token_ids"] for o in ref.generate(prompts, params, use_tqdm=False)]
    llm = LLM(path, **opts)
    handed_out = poison_and_track(llm)
    got = [o["token_ids"] for o in llm.generate(prompts, params, use_tqdm=False)]
    bf16_tie.assert_same_or_bf16_tie(bf16_tie.engine_scorer(ref), want, got, prompts)
    assert_no_stray_writes(llm, handed_out)
    llm.scheduler.check_integrity()


def test_startup_compiles_every_serving_kernel(tiny_model_path) -> None:
    """After startup (graphs captured, sampling warmed up), serving compiles no Triton kernel."""
    import triton

    knobs = getattr(triton, "knobs", None)
    if knobs is None or not hasattr(knobs.runtime, "jit_post_compile_hook"):
        pytest.skip("this Triton has no compile hook")
    llm = LLM(str(tiny_model_path("qwen3")), device="cuda", dtype="bfloat16", max_prefill_tokens=256)
    compiled: list[str] = []
    before = knobs.runtime.jit_post_compile_hook
    knobs.runtime.jit_post_compile_hook = lambda *a, **k: compiled.append(str(k.get("repr", a)))
    try:
        params = [SamplingParams(max_tokens=6, temperature=t, top_k=k, top_p=p, seed=1)
                  for t, k, p in ((0.0, -1, 1.0), (0.8, 20, 0.9), (1.0, -1, 1.0))]
        llm.generate([list(range(100, 100 + n)) for n in (3, 70, 200)], params, use_tqdm=False)
        greedy = SamplingParams(max_tokens=6, temperature=0.0)  # an all-greedy batch: ops.greedy
        llm.generate([list(range(100, 100 + n)) for n in (5, 90)], [greedy] * 2, use_tqdm=False)
    finally:
        knobs.runtime.jit_post_compile_hook = before
    assert not compiled, f"compiled while serving: {compiled}"
