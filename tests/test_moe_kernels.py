"""MoE kernels against their torch references on fresh random data: the fused expert GEMMs (FA3's
rule against fp64), with tokens routed to no expert of a block, all tokens to one expert, M = 1,
E not a power of two, and NaN in every expert no token was routed to (a kernel must never read
one). Routing and alignment: test_moe_routing.py."""

from __future__ import annotations

import pytest
import torch
from attention_rule import assert_fa3_rule

from minisgl import env, ops
from minisgl.kernels import fused_moe as G
from minisgl.kernels import moe_align as A
from minisgl.kernels import moe_routing as R
from minisgl.kernels.fused_moe_config import GemmTile

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def distinct_logits(t: int, e: int, gen: torch.Generator, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Router logits with no ties in any row, even in fp16 (a tie's top-k order is unspecified)."""
    perm = torch.argsort(torch.rand(t, e, generator=gen), dim=1).float()
    return ((perm - e / 2) * (6.0 / e)).to(DEV, dtype)


def random_ids(t: int, e: int, k: int, gen: torch.Generator) -> torch.Tensor:
    """k distinct experts per token, as a router picks them."""
    return torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :k].to(torch.int32).to(DEV)


# ---- fused expert GEMMs --------------------------------------------------------------------


def experts_case(t: int, e: int, k: int, h: int, i: int, dtype: torch.dtype, seed: int, shared: bool = False):
    gen = torch.Generator().manual_seed(seed)
    dgen = torch.Generator(device=DEV).manual_seed(seed)  # drawn where they live (GBs at real shapes)

    def randn(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return torch.randn(*shape, generator=dgen, device=DEV).mul_(scale).to(dtype)

    x, w13, w2 = randn(t, h), randn(e, 2 * i, h, scale=h**-0.5), randn(e, h, i, scale=i**-0.5)
    ids = random_ids(t, e, k, gen)
    weights = torch.rand(t, k, generator=gen).to(DEV)
    extra = dict(shared=randn(t, h), shared_gate=randn(t, 1)) if shared else {}
    return x, w13, w2, weights, ids, extra


def poison_unrouted(w13: torch.Tensor, w2: torch.Tensor, ids: torch.Tensor) -> None:
    """NaN in every expert no token chose: one load of it would reach the output."""
    hit = torch.zeros(w13.shape[0], dtype=torch.bool, device=w13.device)
    hit[ids.reshape(-1).long()] = True
    w13[~hit] = float("nan")
    w2[~hit] = float("nan")


def assert_experts_rule(out: torch.Tensor, x, w13, w2, weights, ids, extra) -> None:  # noqa: ANN001
    def reference(*_: object, compute_dtype: torch.dtype) -> torch.Tensor:
        cast = {k: v.to(compute_dtype) for k, v in extra.items()}
        clean = torch.nan_to_num(w13, nan=0.0), torch.nan_to_num(w2, nan=0.0)  # never read by the routing
        return G.fused_experts_reference(x.to(compute_dtype), clean[0].to(compute_dtype),
                                         clean[1].to(compute_dtype), weights, ids, **cast)

    assert out.shape == x.shape and out.dtype == x.dtype
    # The reference's fp32 routing weights leave its "fp64" output on the fp32 grid, so fp32
    # cases get a floor of a few ulps (seen on the H100: 9.5e-7 vs torch's own 3.6e-7).
    assert_fa3_rule(out, reference, min_floor_ulps=8 if out.dtype == torch.float32 else 0)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize(
    "t,e,k,h,i,shared",
    [(1, 8, 2, 64, 32, False), (7, 6, 4, 48, 40, True), (33, 5, 2, 64, 24, False), (20, 16, 4, 64, 48, True),
     (1, 60, 4, 96, 16, False)],
)
def test_fused_experts_match_reference(t: int, e: int, k: int, h: int, i: int, shared: bool,
                                       dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids, extra = experts_case(t, e, k, h, i, dtype, seed=t * 7 + e, shared=shared)
    poison_unrouted(w13, w2, ids)
    out = ops.fused_experts(x, w13, w2, weights, ids, **extra)
    assert_experts_rule(out, x, w13, w2, weights, ids, extra)


@pytest.mark.parametrize("shared", [False, True])
def test_moe_calls_hold_no_reference_to_their_inputs(shared: bool) -> None:
    """Once a MoE call returns, nothing it was given stays alive (fused_experts, fused_moe). A
    functools.cache left on check_shared (8d6af49) kept every call's activations and shared-expert
    outputs: Qwen3-30B-A3B and GPT-OSS-20B ran out of GPU memory at CUDA graph capture, ~21 GiB of
    norm outputs held (thirty-second session)."""
    import gc
    import weakref

    x, w13, w2, weights, ids, extra = experts_case(5, 6, 2, 32, 16, torch.float32, seed=3, shared=shared)
    logits = distinct_logits(5, 6, torch.Generator().manual_seed(4))
    ops.fused_experts(x, w13, w2, weights, ids, **extra)
    ops.fused_moe(x, logits, w13, w2, 2, True, **extra)
    refs = [weakref.ref(t) for t in (x, logits, weights, ids, *extra.values())]
    del x, logits, weights, ids, extra
    gc.collect()
    assert all(r() is None for r in refs)


@needs_triton
@pytest.mark.parametrize("block_m", [16, 32, 64])
@pytest.mark.parametrize("tile", [GemmTile(16, 16), GemmTile(32, 64, group_m=4), GemmTile(64, 32, group_m=2)])
def test_gemm_tiles_compute_the_same_function(block_m: int, tile: GemmTile) -> None:
    """Every tile shape the tuner may pick (K = 40: a partial K tile; N = 24 / 48: partial N tiles)."""
    x, w13, w2, weights, ids, _ = experts_case(30, 7, 3, 40, 24, torch.float16, seed=block_m)
    sorted_ids, expert_ids = A.align(ids, 7, block_m)
    inter = G.up_gemm(x, w13, sorted_ids, expert_ids, 3, block_m, tile)
    out = G.moe_sum(G.down_gemm(inter, w2, weights, sorted_ids, expert_ids, block_m, tile), 3)
    assert_experts_rule(out, x, w13, w2, weights, ids, {})


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_deterministic_splits_compute_the_same_function(dtype: torch.dtype) -> None:
    """Deterministic mode's sums (`splits`): K in fixed splits, each its own chain from zero, and
    each slot's weighted row in fp32, summed over a token's slots with one rounding. H = 64 in 2 and
    4 splits, I = 48 in 3 and 1 (16-element splits: BLOCK_K shrinks to divide them); splits that
    do not divide K are refused. On the GPU, splits are multiples of 128 (the skinny MoE kernel's warps
    cut K there), so H = 512 and I = 384. (The bits against the skinny kernel:
    tests/test_deterministic_gpu.py.)"""
    h, inter_size = (512, 384) if DEV == "cuda" else (64, 48)
    x, w13, w2, weights, ids, _ = experts_case(30, 7, 3, h, inter_size, dtype, seed=11)
    poison_unrouted(w13, w2, ids)
    sorted_ids, expert_ids = A.align(ids, 7, 16)
    tile = GemmTile(32, 64)
    for up_splits, down_splits in ((2, 3), (4, 1)):
        inter = G.up_gemm(x, w13, sorted_ids, expert_ids, 3, 16, tile, splits=up_splits)
        y = G.down_gemm(inter, w2, weights, sorted_ids, expert_ids, 16, tile, splits=down_splits)
        assert y.dtype == torch.float32
        out = G.moe_sum(y, 3, dtype=dtype)
        assert out.dtype == dtype
        assert_experts_rule(out, x, w13, w2, weights, ids, {})
    with pytest.raises(ValueError, match="splits"):
        G.up_gemm(x, w13, sorted_ids, expert_ids, 3, 16, tile, splits=5)


@needs_triton
def test_deterministic_steps_run_their_experts_in_chunks(monkeypatch) -> None:
    """Deterministic mode past DETERMINISTIC_CHUNK tokens: the experts run per chunk (so the fp32
    slot rows stay bounded), through fused_moe and fused_experts, shared expert included; the
    result is the unchunked one's function (the bits: the GPU test's rows at every batch size)."""
    from minisgl.ops import moe as moe_ops
    from minisgl.ops.deterministic import set_deterministic

    t, e, k = 20, 6, 2
    x, w13, w2, weights, ids, extra = experts_case(t, e, k, 32, 16, torch.float32, seed=3, shared=True)
    logits = distinct_logits(t, e, torch.Generator().manual_seed(3))
    calls = []
    real = moe_ops._experts
    monkeypatch.setattr(moe_ops, "_experts", lambda x, *a, **kw: (calls.append(x.shape[0]), real(x, *a, **kw))[1])
    monkeypatch.setattr(moe_ops, "DETERMINISTIC_CHUNK", 8)
    set_deterministic(x.device, True)
    try:
        out = ops.fused_experts(x, w13, w2, weights, ids, **extra)
        assert calls == [8, 8, 4]
        assert_experts_rule(out, x, w13, w2, weights, ids, extra)
        calls.clear()
        out = ops.fused_moe(x, logits, w13, w2, k, renormalize=False, **extra)
        assert calls == [8, 8, 4]
        weights, ids = R.route_reference(logits, k, False)
        assert_experts_rule(out, x, w13, w2, weights, ids, extra)
    finally:
        set_deterministic(x.device, False)


@needs_triton
@pytest.mark.parametrize("t,k", [(1, 1), (64, 1), (64, 2)])
def test_all_tokens_to_one_expert(t: int, k: int) -> None:
    x, w13, w2, weights, _, _ = experts_case(t, 9, k, 32, 16, torch.float32, seed=t)
    ids = torch.tensor([[4, 2][:k]] * t, dtype=torch.int32, device=DEV)
    poison_unrouted(w13, w2, ids)
    assert_experts_rule(ops.fused_experts(x, w13, w2, weights, ids), x, w13, w2, weights, ids, {})


@needs_triton
@pytest.mark.parametrize("t", [1, 3, 40])
def test_fused_moe_routes_then_runs_the_experts(t: int) -> None:
    """The layer's op (routing + experts; t <= 16 takes the one-kernel routing) vs the references."""
    gen = torch.Generator().manual_seed(t)
    e, k, h, i = 10, 3, 32, 16
    x, w13, w2, _, _, extra = experts_case(t, e, k, h, i, torch.float32, seed=t, shared=True)
    logits = distinct_logits(t, e, gen)
    out = ops.fused_moe(x, logits, w13, w2, k, renormalize=False, **extra)
    weights, ids = R.route_reference(logits, k, False)
    assert_experts_rule(out, x, w13, w2, weights, ids, extra)


@needs_triton
@pytest.mark.parametrize("t", [1, 5, 40])
def test_gpt_oss_experts_biases_and_clamped_swiglu(t: int) -> None:
    """GPT-OSS's experts: biases before the activation and before the router weight, the
    clamped SwiGLU; gate / up outputs large enough that the clamp at `limit` engages."""
    gen = torch.Generator().manual_seed(100 + t)
    e, k, h, i = 8, 4, 32, 16
    x, w13, w2, _, _, _ = experts_case(t, e, k, h, i, torch.float32, seed=t + 50)
    w13 *= 6.0  # pre-activations up to ~+-20: past limit = 2.5
    b13 = torch.randn(e, 2 * i, generator=gen).to(DEV)
    b2 = torch.randn(e, h, generator=gen).to(DEV)
    act = G.ExpertAct("gpt_oss", alpha=1.702, limit=2.5)
    logits = distinct_logits(t, e, gen)
    out = ops.fused_moe(x, logits, w13, w2, k, renormalize=True, b13=b13, b2=b2, act=act)
    weights, ids = R.route_reference(logits, k, True)
    ref = G.fused_experts_reference(x, w13, w2, weights, ids, b13=b13, b2=b2, act=act)
    plain = G.fused_experts_reference(x, w13, w2, weights, ids)
    assert (ref - plain).abs().max() > 1.0  # the biases and the activation matter here
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # The reference itself: transformers' GPT-OSS expert maths, written out per token.
    for tok in range(t):
        acc = torch.zeros(h, device=DEV)
        for j in range(k):
            ex = int(ids[tok, j])
            gu = w13[ex] @ x[tok] + b13[ex]
            gate, up = gu[:i].clamp(max=2.5), gu[i:].clamp(-2.5, 2.5)
            acc += weights[tok, j] * (w2[ex] @ ((up + 1) * gate * torch.sigmoid(1.702 * gate)) + b2[ex])
        torch.testing.assert_close(ref[tok], acc, rtol=1e-4, atol=1e-4)


# ---- argument checks (no kernel runs) ------------------------------------------------------


def test_bad_arguments_name_the_argument() -> None:
    x, w13, w2 = torch.randn(3, 8), torch.randn(4, 6, 8), torch.randn(4, 8, 3)
    logits = torch.randn(3, 4)
    with pytest.raises(ValueError, match="top_k"):
        ops.moe_route(logits, 5, True)
    with pytest.raises(ValueError, match="scoring"):
        ops.moe_route(logits, 2, True, "relu")
    with pytest.raises(ValueError, match="router_logits"):
        ops.moe_route(logits.long(), 2, True)
    with pytest.raises(ValueError, match="block_m"):
        ops.moe_align(torch.zeros(3, 2, dtype=torch.int32), 4, 24)
    with pytest.raises(ValueError, match="topk_ids"):
        ops.moe_align(torch.zeros(3, 2, dtype=torch.int64), 4, 16)
    with pytest.raises(ValueError, match="w13"):
        ops.fused_moe(x, logits, torch.randn(4, 5, 8), w2, 2, True)
    with pytest.raises(ValueError, match="w2"):
        ops.fused_moe(x, logits, w13, torch.randn(4, 8, 4), 2, True)
    with pytest.raises(ValueError, match="w13"):
        ops.fused_moe(x, logits, w13.half(), w2, 2, True)
    with pytest.raises(ValueError, match="router_logits"):
        ops.fused_moe(x, torch.randn(3, 5), w13, w2, 2, True)
    with pytest.raises(ValueError, match="shared_gate"):
        ops.fused_moe(x, logits, w13, w2, 2, True, shared=torch.randn(3, 8))
    with pytest.raises(ValueError, match="topk_weights"):
        ops.fused_experts(x, w13, w2, torch.rand(3, 2).double(), torch.zeros(3, 2, dtype=torch.int32))


# ---- GPU: real shapes, CUDA graphs, no host syncs ------------------------------------------

REAL = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-30b-a3b tp4": (128, 8, 2048, 192),
        "mixtral-8x7b": (8, 2, 4096, 14336)}


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("shape", list(REAL))
@pytest.mark.parametrize("t", [1, 16, 77, 1024])
def test_gpu_bf16_real_shapes(shape: str, t: int) -> None:
    e, k, h, i = REAL[shape]
    x, w13, w2, _, _, _ = experts_case(t, e, k, h, i, torch.bfloat16, seed=t)
    logits = distinct_logits(t, e, torch.Generator().manual_seed(t))
    out = ops.fused_moe(x, logits, w13, w2, k, renormalize=True)
    weights, ids = R.route_reference(logits, k, True)
    assert_experts_rule(out, x, w13, w2, weights, ids, {})


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("t", [1, 8, 16, 40, 256])
def test_gpu_graph_capture_without_host_syncs(t: int) -> None:
    """The whole layer op is captured in a CUDA graph (static sizes per T, nothing read on the
    host: torch's sync debug mode turns any synchronizing call into an error) and its replays on
    new router logits equal eager calls."""
    e, k, h, i = 64, 6, 256, 128
    x, w13, w2, _, _, extra = experts_case(t, e, k, h, i, torch.bfloat16, seed=t, shared=True)
    logits = distinct_logits(t, e, torch.Generator().manual_seed(t), torch.bfloat16)
    run = lambda: ops.fused_moe(x, logits, w13, w2, k, True, **extra)  # noqa: E731
    run()  # compile outside the capture
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for seed in range(3):
        logits.copy_(distinct_logits(t, e, torch.Generator().manual_seed(100 + seed), torch.bfloat16))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, run())
