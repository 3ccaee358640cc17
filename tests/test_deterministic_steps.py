"""Deterministic mode on the step path (CPU): with the Triton backend's step layouts and the
engine's real CudaGraphRunner (replayed as in test_graph_replay_cpu), no step reaches a decode
kernel: decode steps carry a tile map (one one-row tile per request) and run extend
attention, mixed steps have no decode rows (their decodes are one-row tiles, through the
extend graphs: no mixed ladder), graph and eager alike. The bitwise claims themselves need
the GPU kernels (test_deterministic_gpu.py); here the attention runs as its torch reference."""

from __future__ import annotations

import pytest
from graph_replay import ReplayRunner
from test_graph_replay_cpu import OPTS, PARAMS, PROMPTS

from minisgl import LLM
from minisgl.attention.triton_backend import TritonAttentionBackend
from minisgl.step.builder import StepBuilder
from minisgl.step.layout import StepLayout, StepSpec, exact_layout


def deterministic_triton_llm(path: str, graphs: bool, **options) -> tuple[LLM, list]:
    """A CPU LLM in deterministic mode whose backend is the Triton one (as on a GPU), with its
    decode kernel replaced by a failure; returns it and the list of every batch it builds."""
    llm = LLM(path, device="cpu", dtype="float32", deterministic=True, **options)
    eng = llm.engine
    eng.attn = TritonAttentionBackend(eng.pool, eng.num_q_heads, eng.model_config.head_dim**-0.5)
    eng.attn.deterministic = True

    def no_decode_kernel(*args, **kwargs) -> None:
        raise AssertionError("a decode kernel ran in deterministic mode")

    eng.attn._decode = no_decode_kernel
    eng.steps = StepBuilder(eng.table, eng.token_buffer, eng.device, eng.max_model_len,
                            eng.model_config.vocab_size, eng.attn.tile_block_m, deterministic=True)
    if graphs:
        eng.enable_cuda_graphs(4, *llm.scheduler.graph_max_tokens, runner_cls=ReplayRunner)
    built: list = []
    build = eng.build_batch

    def recording(*args, **kwargs):  # noqa: ANN202
        batch = build(*args, **kwargs)
        built.append(batch)
        return batch

    eng.build_batch = recording
    return llm, built


@pytest.fixture(scope="module")
def eager_tokens(tiny_model_path) -> list[list[int]]:
    with LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", deterministic=True, **OPTS) as llm:
        return [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]


@pytest.mark.parametrize("graphs", [True, False], ids=["replayed", "eager"])
def test_no_step_reaches_a_decode_kernel(tiny_model_path, eager_tokens, graphs: bool) -> None:
    llm, built = deterministic_triton_llm(str(tiny_model_path("qwen3")), graphs, **OPTS)
    with llm:
        eng = llm.engine
        if graphs:
            runner = eng.graphs
            assert runner.mixed == []  # mixed steps take the extend graphs, decodes as tiles
            assert all(x.tiles == x.requests for x in runner.decode)
        got = [o["token_ids"] for o in llm.generate(PROMPTS, PARAMS, use_tqdm=False)]
        assert got == eager_tokens
        modes = {b.mode for b in built}
        assert modes == {"extend", "mixed", "decode"}, modes
        assert all(b.decode_rows is None and b.tiles is not None for b in built)
        for b in built:
            if b.mode == "decode" and b.graph is None:  # one one-row tile per request
                assert sorted(b.tiles.tolist()) == [[i, 0] for i in range(b.batch_size)]
            elif b.mode == "decode":
                assert b.graph.tiles == b.graph.requests >= b.batch_size
        if graphs:
            assert runner.replays["decode"] > 3 and runner.replays["extend"] > 3 and runner.replays["mixed"] == 0
        llm.scheduler.check_integrity()


def test_decode_layout_carries_tiles_only_when_asked() -> None:
    spec = StepSpec("decode", [3, 0, 5], [7, 2, 9], [None, None, None])
    assert exact_layout(spec, 16, True) == StepLayout("decode", 3, 3)
    assert exact_layout(spec, 16, False, decode_tiles=True) == StepLayout("decode", 3, 3, 3)
    assert exact_layout(spec, None, False, decode_tiles=True) == StepLayout("decode", 3, 3)  # torch backend
