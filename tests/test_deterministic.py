"""Deterministic mode: a request's token ids and logprobs are bit-identical whatever it is
batched with, however its prefill is chunked, whether its prefix comes from the radix cache.

CPU: the torch path (tiny Qwen3, fp32). Interpreter: the batch-invariant GEMM's rows do not
depend on M. GPU (`gpu`): the same request-level comparison through the Triton kernels, with
CUDA graphs and eager, and the kernels' invariance at M up to 8192.
"""

from __future__ import annotations

import random

import pytest
import torch

from minisgl import LLM, SamplingParams, env

GREEDY = SamplingParams(max_tokens=4, temperature=0.0)
SEEDED = SamplingParams(max_tokens=4, temperature=1.0, top_p=0.9, seed=7)


def prompts(n: int, vocab: int, seed: int = 0, shared: int = 40) -> list[list[int]]:
    """n prompts; every other one starts with the same `shared`-token prefix."""
    rng = random.Random(seed)
    prefix = [rng.randrange(vocab) for _ in range(shared)]
    out = []
    for i in range(n):
        tail = [rng.randrange(vocab) for _ in range(rng.randrange(3, 30))]
        out.append(prefix + tail if i % 2 == 0 else tail)
    return out


def run(llm: LLM, ps: list[list[int]], params: list[SamplingParams]) -> list[tuple[list[int], list[float]]]:
    return [(o["token_ids"], o["logprobs"]) for o in llm.generate(ps, params, use_tqdm=False)]


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen2_moe", "gemma3", "gpt_oss"])
def test_cpu_request_is_batch_invariant(tiny_model_path, name: str) -> None:
    """Dense and MoE (Qwen2-MoE with its shared expert): each expert runs a token at a time.
    Gemma 3 and GPT-OSS: sliding-window layers (W = 16, prompts of several windows) and sinks."""
    path = str(tiny_model_path(name))
    mine = prompts(4, 1000)
    params = [GREEDY, SEEDED] * 2
    opts = dict(device="cpu", dtype="float32", num_pages=4096, deterministic=True)
    with LLM(path, cache="naive", **opts) as llm:
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(mine, params)]
    others = prompts(6, 1000, seed=1, shared=0)
    for chunk in (16,):  # (the CPU LM head runs one 152k-wide row at a time: kept small for CI)
        with LLM(path, max_prefill_tokens=chunk, **opts) as llm:
            for warm in (False, True):  # the second pass hits the radix cache
                batch = others[:3] + mine + others[3:]
                sp = [SEEDED] * 3 + params + [GREEDY] * 3
                got = run(llm, batch, sp)[3:7]
                assert got == alone, f"chunk {chunk}, radix cache {'warm' if warm else 'cold'}"


def test_cpu_default_mode_is_not_batch_invariant_here(tiny_model_path) -> None:
    """Why the mode exists (and a check that the test above could fail): without it, the CPU
    BLAS gives a row inside a batch other last bits than the same row alone."""
    path = str(tiny_model_path("qwen3"))
    mine = prompts(4, 1000)
    with LLM(path, device="cpu", dtype="float32", num_pages=4096, cache="naive") as llm:
        alone = [run(llm, [p], [GREEDY])[0] for p in mine]
        together = run(llm, mine + prompts(8, 1000, seed=1), [GREEDY] * 12)[:4]
    assert [t for t, _ in together] == [t for t, _ in alone]  # tokens agree at this size...
    assert [lp for _, lp in together] != [lp for _, lp in alone]  # ...the logprobs' last bits do not


@pytest.mark.parametrize("mode", [True, False])
def test_cpu_moe_rows_do_not_depend_on_the_batch_in_the_mode(mode: bool) -> None:
    """ops.fused_moe on the CPU: a token's output alone and inside a batch of 40, bit for bit in
    the mode; without it the experts' rows go through the BLAS together and differ (so the
    request-level MoE cases above could fail)."""
    from minisgl.ops import fused_moe
    from minisgl.ops.deterministic import set_deterministic

    gen = torch.Generator().manual_seed(3)
    t, h, inter, e = 40, 64, 96, 8
    x = torch.randn(t, h, generator=gen)
    logits = torch.randn(t, e, generator=gen)
    w13 = torch.randn(e, 2 * inter, h, generator=gen) * 0.1
    w2 = torch.randn(e, h, inter, generator=gen) * 0.1
    set_deterministic(x.device, mode)
    try:
        batch = fused_moe(x, logits, w13, w2, 2, True)
        alone = torch.cat([fused_moe(x[i : i + 1], logits[i : i + 1], w13, w2, 2, True) for i in range(t)])
    finally:
        set_deterministic(x.device, False)
    assert torch.equal(batch, alone) == mode


def test_deterministic_refuses_hybrid_linear_attention(tiny_model_path) -> None:
    with pytest.raises(ValueError, match="deterministic mode does not cover hybrid linear-attention"):
        LLM(str(tiny_model_path("qwen3_next")), device="cpu", dtype="float32", deterministic=True)


def test_cpu_fp8_request_is_batch_invariant(tiny_model_path) -> None:
    """FP8 weights (quantized on load) in the mode: a request's tokens and logprobs alone equal
    the same request's among others, chunked, radix cache cold and warm (the FP8 layers take the
    dequantised weight one row at a time, ops/gemm/dispatch.py _fp8_deterministic)."""
    path = str(tiny_model_path("qwen3"))
    mine = prompts(4, 1000)
    params = [GREEDY, SEEDED] * 2
    opts = dict(device="cpu", dtype="float32", num_pages=4096, deterministic=True, quantization="fp8")
    with LLM(path, cache="naive", **opts) as llm:
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(mine, params)]
    others = prompts(6, 1000, seed=1, shared=0)
    with LLM(path, max_prefill_tokens=16, **opts) as llm:
        for warm in (False, True):
            got = run(llm, others[:3] + mine + others[3:], [SEEDED] * 3 + params + [GREEDY] * 3)[3:7]
            assert got == alone, f"radix cache {'warm' if warm else 'cold'}"


def test_deterministic_refuses_4bit_weights_by_name(tiny_model_path, tmp_path) -> None:
    import quant4_checkpoints as ck

    q, _ = ck.write_quant4(tiny_model_path("qwen3"), tmp_path / "q", tmp_path / "deq", "gptq", 16)
    with pytest.raises(ValueError, match="deterministic mode does not cover INT4 weights"):
        LLM(str(q), device="cpu", dtype="float32", deterministic=True)


@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_cpu_speculation_changes_no_bit_in_the_mode(tiny_model_path, algo: str) -> None:
    """Speculation in deterministic mode: a verify step's logits are a decode's bit for bit (its
    tokens are one-token-like rows of the same batch-invariant kernels), and a verify row draws
    its token as the plain sampler draws it at (seed, step): greedy and seeded requests give
    the tokens and logprobs of the mode without speculation, alone or batched. The target is
    its own draft (n-gram: repetitive prompts), so drafts are accepted."""
    path = str(tiny_model_path("qwen3"))
    rng = random.Random(3)
    base = [rng.randrange(1000) for _ in range(6)]
    mine = [base * 4 + [rng.randrange(1000) for _ in range(i)] for i in range(6)]
    # Greedy; seeded and filtered; penalized and biased (the verify rows' raw logprobs); seeded at
    # temperature 1 without filters (a draw over the whole vocabulary).
    params = [SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.05, top_p=0.95, top_k=20, seed=7, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.0, frequency_penalty=0.1, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=0.05, seed=5, logit_bias={5: 0.1}, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=3, ignore_eos=True),
              SamplingParams(max_tokens=12, temperature=1.0, seed=4, presence_penalty=0.2, ignore_eos=True)]
    opts = dict(device="cpu", dtype="float32", num_pages=4096, deterministic=True)
    with LLM(path, **opts) as llm:
        want = [run(llm, [p], [sp])[0] for p, sp in zip(mine, params)]
    spec = dict(speculative_algorithm=algo, speculative_num_draft_tokens=3)
    spec |= {"speculative_draft_model": path} if algo == "draft" else {"speculative_ngram_min": 2}
    with LLM(path, **opts, **spec) as llm:
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(mine, params)]
        others = prompts(3, 1000, seed=5, shared=0)
        long_seeded = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=7)
        batched = run(llm, others + mine, [long_seeded] * 3 + params)[3:]
        st = llm.scheduler.stats()
    assert st["spec_verified"] > 0 and st["spec_accepted"] > 0, "no draft was accepted: the test shows nothing"
    assert alone == want, "speculation changed a request's tokens or logprobs"
    assert batched == want, "speculation in a batch changed a request's tokens or logprobs"


@pytest.mark.gpu
def test_moe_grouped_gemm_rows_do_not_depend_on_the_batch_in_the_mode() -> None:
    """The GPU path in the mode: fixed K splits and one routing kernel at every token count, so
    rows 0, 7 and 199 of a 200-token batch equal the same tokens alone bit for bit (1 token takes
    the skinny kernel in the grouped GEMM's splits; outside the mode the skinny kernel's own, and
    200 tokens the grouped GEMM's larger tiles).
    GPU only: the interpreter's tile products give equal rows with or without the mode."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    from minisgl.kernels.fused_moe import fused_experts_reference
    from minisgl.kernels.moe_routing import route_reference
    from minisgl.ops import fused_moe
    from minisgl.ops.deterministic import set_deterministic

    dev = "cuda"
    gen = torch.Generator().manual_seed(4)
    t, h, inter, e = 200, 64, 96, 8
    x = torch.randn(t, h, generator=gen).half().to(dev)
    logits = torch.randn(t, e, generator=gen).half().to(dev)
    w13 = (torch.randn(e, 2 * inter, h, generator=gen) * 0.1).half().to(dev)
    w2 = (torch.randn(e, h, inter, generator=gen) * 0.1).half().to(dev)
    set_deterministic(x.device, True)
    try:
        batch = fused_moe(x, logits, w13, w2, 2, True)
        # right, not only invariant: the torch reference in fp32 on the same routing
        weights, ids = route_reference(logits.float(), 2, True, "softmax")
        want = fused_experts_reference(x.float(), w13.float(), w2.float(), weights, ids)
        torch.testing.assert_close(batch.float(), want, atol=2e-2, rtol=2e-2)
        for i in (0, 7, 199):
            alone = fused_moe(x[i : i + 1], logits[i : i + 1], w13, w2, 2, True)
            assert torch.equal(batch[i : i + 1], alone), f"row {i}"
    finally:
        set_deterministic(x.device, False)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_batch_invariant_gemm_rows_do_not_depend_on_m(dtype: torch.dtype) -> None:
    """The first rows' results whatever M is and whatever the other rows hold. The interpreter
    runs a tile's tl.dot as a numpy matmul, whose BLAS rounds a row by its place in the tile:
    so here the probe rows keep their places; the GPU test moves them anywhere in the batch."""
    from minisgl.kernels.batch_invariant_gemm import gemm, gemm_reference

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # compiled on a GPU machine
    g = torch.Generator().manual_seed(0)
    k, n = 40, 24  # not multiples of the tiles: masked K and N edges
    w = torch.randn(n, k, generator=g).to(dev, dtype)
    bias = torch.randn(n, generator=g).to(dev, dtype)
    probe = torch.randn(5, k, generator=g).to(dev, dtype)
    first = gemm(probe, w, bias)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(first.float(), gemm_reference(probe, w, bias), atol=tol, rtol=tol)
    for m in (17, 37):  # more row tiles, other neighbours in the probe's tile
        others = torch.randn(m - 5, k, generator=g).to(dev, dtype)
        got = gemm(torch.cat([probe, others]), w, bias)
        assert torch.equal(got[:5], first), f"M={m}: rows differ from the same rows at M=5"


def test_gemm_config_table_is_by_shape_and_checked(tmp_path, monkeypatch) -> None:
    """The GPU GEMM's tiles come from the table by (N, K); an entry lists configs (or "skinny": the
    skinny kernel, at most its 32 rows) from M = 1 up; a malformed table is refused by name."""
    import json

    from minisgl.kernels import batch_invariant_gemm as bg

    cuda, a, b = torch.device("cuda"), [64, 64, 64, 4, 4], [128, 128, 64, 8, 3]
    table = {"16bit": {"default": [[1, b]], "10x20": [[1, a], [256, b]]}}
    path = tmp_path / "configs.json"
    path.write_text(json.dumps(table))
    monkeypatch.setattr(bg, "CONFIG_FILE", path)
    bg._table.cache_clear()
    try:
        assert [bg.config_for(torch.bfloat16, cuda, 10, 20, m) for m in (1, 255, 256, 8192)] == [tuple(a)] * 2 + [
            tuple(b)] * 2
        assert bg.config_for(torch.float16, cuda, 30, 20, 1) == tuple(b)  # no entry: the default
        assert bg.config_for(torch.float32, cuda, 10, 20, 1) == bg.FLOAT32_CONFIG
        # "skinny" (the skinny kernel, same bits) for a few rows; this kernel takes the next config there
        table["16bit"]["10x20"] = [[1, "skinny"], [8, a], [256, b]]
        path.write_text(json.dumps(table))
        bg._table.cache_clear()
        assert [bg.uses_skinny(10, 20, m) for m in (1, 7, 8, 300)] == [True, True, False, False]
        assert [bg.config_for(torch.bfloat16, cuda, 10, 20, m) for m in (1, 7, 8, 300)] == [tuple(a)] * 3 + [tuple(b)]
        assert not bg.uses_skinny(30, 20, 1)  # the default entry names no skinny range
        table["16bit"]["10x20"] = [[1, a], [256, b + ["tma"]]]  # "tma": the same tile through tensor descriptors
        path.write_text(json.dumps(table))
        bg._table.cache_clear()
        assert bg.config_for(torch.bfloat16, cuda, 10, 20, 300) == (*b, bg.TMA)
        bad_tables = ([[2, a]], [[1, "skinny"], [34, a]], [[1, "skinny"]], [[1, a], [64, "skinny"]],
                      [[1, a], [40, "skinny"], [50, b]], [[1, a + ["fast"]]], [[1, a[:4]]], [[1, "tiles"]],
                      [[1, [48, 64, 64, 4, 4]]], [[1, [64, 64, 64, 4, True]]])
        for bad in bad_tables:
            table["16bit"]["10x20"] = bad
            path.write_text(json.dumps(table))
            bg._table.cache_clear()
            with pytest.raises(ValueError, match="10x20"):
                bg.config_for(torch.bfloat16, cuda, 10, 20, 1)
    finally:
        monkeypatch.undo()
        bg._table.cache_clear()
    shipped = bg.configs_for(151936, 1024)  # the shipped table parses
    assert shipped[0][0] == 1
    from minisgl.ops.gemm.skinny import MAX_M

    assert bg.SKINNY_ROWS == MAX_M  # "skinny" entries end where the skinny kernel's rows do


@pytest.mark.triton
@pytest.mark.parametrize("splits", [1, 2, 4])
def test_batch_invariant_gemm_in_the_skinny_splits(splits: int) -> None:
    """K in fixed splits (the skinny kernel's warps): right values, rows unchanged by M (probe rows
    keep their places: the interpreter's matmul rounds by a row's place in the tile), and splits
    that do not cut K into whole BLOCK_K steps refused by name."""
    from minisgl.kernels.batch_invariant_gemm import INTERPRETER_CONFIG, gemm, gemm_reference

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(1)
    k, n = 512, 24  # 4 splits of 128 (the GPU's split alignment)
    w = torch.randn(n, k, generator=g).to(dev)
    bias = torch.randn(n, generator=g).to(dev)
    probe = torch.randn(5, k, generator=g).to(dev)
    first = gemm(probe, w, bias, INTERPRETER_CONFIG, splits=splits)
    torch.testing.assert_close(first, gemm_reference(probe, w, bias), atol=1e-4, rtol=1e-4)
    if splits > 1:  # the splits sum in another order than one chain (so the equalities below are not trivial)
        assert not torch.equal(gemm(probe, w, bias, INTERPRETER_CONFIG, splits=1), first)
    for m in (17, 37):
        others = torch.randn(m - 5, k, generator=g).to(dev)
        got = gemm(torch.cat([probe, others]), w, bias, INTERPRETER_CONFIG, splits=splits)
        assert torch.equal(got[:5], first), f"M={m}, {splits} splits: rows differ from M=5's"
    with pytest.raises(ValueError, match="BLOCK_K"):  # K does not cut into 3 equal splits
        gemm(probe, w, bias, INTERPRETER_CONFIG, splits=3)
    with pytest.raises(ValueError, match="BLOCK_K"):  # splits of 128 are not whole BLOCK_K 256 steps
        gemm(probe, w, bias, (16, 16, 256, 1, 1), splits=4)


@pytest.mark.triton
@pytest.mark.parametrize("k,splits", [(512, 1), (512, 4), (40, 1)])
def test_batch_invariant_gemm_tma_loads_give_the_pointer_loads_bits(k: int, splits: int, monkeypatch) -> None:
    """A config ending in "tma" (tiles through tensor descriptors: zeros past M, N and a K tail,
    stores clipped) gives the pointer kernel's bits in the same tile, at M and N that end mid-tile,
    with a bias, in splits; tensors whose rows are not 16-byte aligned, and a Triton without host
    tensor descriptors (before 3.4), take the pointer kernel."""
    from minisgl.kernels import batch_invariant_gemm as bg
    from minisgl.kernels.batch_invariant_gemm import TMA, gemm, gemm_reference

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(2)
    n = 40  # 2.5 column tiles of 16
    w = torch.randn(n, k, generator=g).to(dev)
    bias = torch.randn(n, generator=g).to(dev)
    for m in (5, 37):
        x = torch.randn(m, k, generator=g).to(dev)
        for b in (None, bias):
            ptr = gemm(x, w, b, (16, 16, 16, 1, 1), splits=splits)
            tma = gemm(x, w, b, (16, 16, 16, 1, 1, TMA), splits=splits)
            assert torch.equal(tma, ptr), f"M={m} K={k} splits={splits} bias={b is not None}"
            torch.testing.assert_close(tma, gemm_reference(x, w, b), atol=1e-4, rtol=1e-4)
    odd = torch.randn(6, 42, generator=g).to(dev)[:, :41]  # rows of 42 floats: not 16-byte aligned
    w_odd = torch.randn(8, 41, generator=g).to(dev)
    assert torch.equal(gemm(odd, w_odd, None, (16, 16, 16, 1, 1, TMA)), gemm(odd, w_odd, None, (16, 16, 16, 1, 1)))
    empty_k = gemm(torch.empty(3, 0, device=dev), torch.empty(8, 0, device=dev), None, (16, 16, 16, 1, 1, TMA))
    assert torch.equal(empty_k, torch.zeros(3, 8, device=dev))  # K = 0: no descriptor, the pointer kernel's zeros
    launched = []
    monkeypatch.setattr(bg._gemm_tma_kernel, "run", lambda *a, **kw: launched.append(1))  # would it launch?
    gemm(x, w, bias, (16, 16, 16, 1, 1, TMA), splits=splits)
    assert launched, "the TMA kernel was not launched where descriptors fit"
    launched.clear()
    monkeypatch.setattr(bg, "TensorDescriptor", None)  # Triton before 3.4
    assert torch.equal(gemm(x, w, bias, (16, 16, 16, 1, 1, TMA), splits=splits), ptr) and not launched


@pytest.mark.slow
def test_gemm_candidates_compile_for_sm90() -> None:
    """Every candidate tile of the mode's GEMM (pointer and TMA loads, 8 splits and a K tail)
    compiles for sm_90 within an H100's 227 KB of shared memory per block, compiled on the CPU:
    the GPU tests and the table's benchmark launch them all, CI has no GPU."""
    if env.TRITON_INTERPRET:
        pytest.skip("under TRITON_INTERPRET the kernels are interpreted functions, not compilable")
    from triton_compile import shared_bytes

    from minisgl.kernels import batch_invariant_gemm as bg

    for cfg in bg.CANDIDATES:
        bm, bn, bk, warps, stages, *loads = cfg
        tma = loads == [bg.TMA]
        fn = bg._gemm_tma_kernel if tma else bg._gemm_kernel
        for splits, even in ((8, True), (1, False)):
            consts = dict(HAS_BIAS=True, EVEN_K=even, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP=bg.GROUP_M,
                          DOT_PREC="tf32", SPLITS=splits)
            if tma:
                types = {"x_desc": f"tensordesc<bf16[{bm},{bk}]>", "w_desc": f"tensordesc<bf16[{bn},{bk}]>",
                         "y_desc": f"tensordesc<bf16[{bm},{bn}]>", "Bias": "*bf16"}
            else:
                types = {"X": "*bf16", "W": "*bf16", "Y": "*bf16", "Bias": "*bf16"}
            shared = shared_bytes(fn, types, consts, warps, stages)
            assert shared <= 227 * 1024, (cfg, splits, shared)


def test_deterministic_splits_are_fixed_by_k() -> None:
    """splits_for: up to 8 splits (the skinny kernel's warps per block), each a whole multiple of
    128 K elements and at least 512 long, none where K is not a multiple of 256."""
    from minisgl.kernels.batch_invariant_gemm import MAX_SPLITS, MIN_SPLIT_K, SPLIT_ALIGN, splits_for
    from minisgl.ops.gemm.skinny import MAX_WARPS

    assert splits_for(4096) == 8
    assert splits_for(14336) == 8
    assert splits_for(3072) == 4  # 8 would be 384 long
    assert splits_for(2048) == 4
    assert splits_for(1024) == 2
    assert splits_for(1000) == 1  # K not a multiple of 256: one split
    assert splits_for(384) == 1  # 384 = 3 x 128: two splits would not be whole multiples
    assert MAX_SPLITS <= MAX_WARPS  # the skinny kernel runs the splits as one block's warps
    for k in (4096, 3072, 1024, 640, 1536):
        s = splits_for(k)
        assert k % (s * SPLIT_ALIGN) == 0 and (s == 1 or k // s >= MIN_SPLIT_K) and s <= MAX_SPLITS
