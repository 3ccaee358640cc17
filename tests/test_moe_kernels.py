"""MoE kernels against their torch references on fresh random data: routing (ids exact, weights
to fp32 rounding), token alignment (exact), the fused expert GEMMs (FA3's rule against fp64),
with tokens routed to no expert of a block, all tokens to one expert, M = 1, E not a power of
two, and NaN in every expert no token was routed to (a kernel must never read one)."""

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


# ---- routing -------------------------------------------------------------------------------


@needs_triton
@pytest.mark.parametrize("t,e,k", [(1, 8, 2), (7, 60, 4), (19, 128, 8), (33, 5, 5), (4, 3, 1)])
@pytest.mark.parametrize("scoring,renormalize", [("softmax", True), ("softmax", False), ("sigmoid", True)])
def test_route_matches_reference(t: int, e: int, k: int, scoring: str, renormalize: bool) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + e)
    wide = distinct_logits(t, e + 3, gen, torch.float16)
    logits = wide[:, :e]  # row stride != E
    weights, ids = ops.moe_route(logits, k, renormalize, scoring)
    ref_w, ref_ids = R.route_reference(logits, k, renormalize, scoring)
    assert ids.dtype == torch.int32 and weights.dtype == torch.float32 and ids.shape == (t, k)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)
    if renormalize:
        torch.testing.assert_close(weights.sum(-1), torch.ones(t, device=DEV))


@needs_triton
@pytest.mark.parametrize("t,e,h,k", [(1, 32, 200, 4), (3, 8, 64, 2), (2, 60, 136, 8), (2, 32, 2880, 4)])
@pytest.mark.parametrize("bias", [True, False])
def test_route_linear_matches_linear_then_route(t: int, e: int, h: int, k: int, bias: bool) -> None:
    """The router GEMM and the routing in one kernel: the logits rounded to x's dtype as the router's
    linear layer rounds them, then route()'s ids and weights. The inputs are drawn until no two of
    the top k + 1 logits are near-ties, so the ids (in order) must be exact."""
    dtype = torch.float16
    gen = torch.Generator().manual_seed(7 * t + e)
    for _ in range(100):  # the first draw (fixed seed) whose top-k + 1 logits are 4 fp16 ulps apart or more
        x = torch.randn(t, h + 8, generator=gen).to(DEV, dtype)[:, :h]  # row stride != H
        w = (torch.randn(e, h, generator=gen) / h**0.5).to(DEV, dtype)
        b = (torch.randn(e, generator=gen) * 0.3).to(DEV, dtype) if bias else None
        logits = (x.float() @ w.float().T + (b.float() if bias else 0)).to(dtype)
        top = logits.float().sort(dim=1, descending=True).values[:, : k + 1]
        if (top[:, :-1] - top[:, 1:]).min() > 4e-3 * top.abs().max():
            break
    else:
        raise AssertionError("no draw without near-ties in 100")
    ctr = torch.zeros(8, dtype=torch.int32, device=DEV)
    for _ in range(2):  # the counters reset themselves: a second launch routes the same
        weights, ids = R.route_linear(x, w, b, k, True, ctr)
    assert not ctr.any()
    ref_w, ref_ids = R.route_reference(logits, k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=1e-2, atol=1e-3)  # fp32 sums of fp16 logits one ulp apart


# ---- alignment -----------------------------------------------------------------------------


def assert_alignment_valid(ids: torch.Tensor, num_experts: int, block_m: int, sorted_ids: torch.Tensor,
                           expert_ids: torch.Tensor) -> None:
    """The contract, checked independently of the reference: every assignment exactly once,
    in a block of its own expert, ascending within the expert; padding = N; unused blocks -1."""
    flat = ids.reshape(-1).cpu().long()
    n = flat.numel()
    s, b = sorted_ids.cpu().long(), expert_ids.cpu().long()
    assert s.numel() == b.numel() * block_m == A.num_blocks(n, num_experts, block_m) * block_m
    real = s[s < n]
    assert sorted(real.tolist()) == list(range(n)) and (s[s >= n] == n).all()
    block_of = torch.arange(s.numel()) // block_m
    assert (b[block_of[s < n]] == flat[real]).all()
    used = b >= 0
    assert used.sum() == sum(-(-int((flat == x).sum()) // block_m) for x in range(num_experts))
    assert not used[used.sum():].any()  # the used blocks come first
    for x in range(num_experts):
        rows = s[(b[block_of] == x) & (s < n)]
        assert (rows.diff() > 0).all()


@needs_triton
@pytest.mark.parametrize(
    "t,e,k,block_m",
    [(1, 128, 8, 16), (3, 8, 2, 16), (2, 64, 2, 16), (40, 60, 4, 16), (300, 128, 8, 64), (1000, 8, 2, 128),
     (257, 7, 3, 32)],
)
def test_align_matches_reference(t: int, e: int, k: int, block_m: int) -> None:
    """ops.moe_align (its default path), and each of align()'s paths forced: three launches always,
    one program where the batch fits it (decode-sized)."""
    gen = torch.Generator().manual_seed(t + e)
    ids = random_ids(t, e, k, gen)
    ref_sorted, ref_experts = A.align_reference(ids, e, block_m)
    runs = {"default": ops.moe_align(ids, e, block_m), "three launches": A.align(ids, e, block_m, one_program=False)}
    if A.small_align_fits(t * k, e):
        runs["one program"] = A.align(ids, e, block_m, one_program=True)
    for path, (sorted_ids, expert_ids) in runs.items():
        assert torch.equal(sorted_ids, ref_sorted) and torch.equal(expert_ids, ref_experts), path
        assert_alignment_valid(ids, e, block_m, sorted_ids, expert_ids)


@needs_triton
@pytest.mark.parametrize("t", [1, 50, 700])
def test_align_all_tokens_to_the_same_experts(t: int) -> None:
    ids = torch.tensor([[3, 5]] * t, dtype=torch.int32, device=DEV)
    for one_program in (False, True):
        sorted_ids, expert_ids = A.align(ids, 7, 16, one_program=one_program)
        assert torch.equal(sorted_ids, A.align_reference(ids, 7, 16)[0]), one_program
        assert_alignment_valid(ids, 7, 16, sorted_ids, expert_ids)


@needs_triton
@pytest.mark.parametrize("t,e,k", [(1, 128, 8), (5, 13, 3), (16, 128, 8), (100, 8, 2)])
def test_route_and_align_in_one_kernel(t: int, e: int, k: int) -> None:
    """The decode-sized path (one program) equals routing then aligning."""
    assert A.small_route_align_fits(t, e, k)
    logits = distinct_logits(t, e, torch.Generator().manual_seed(t))
    weights, ids, sorted_ids, expert_ids = A.route_and_align(logits, k, True, "softmax", 16)
    ref_w, ref_ids = R.route_reference(logits, k, True)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w, rtol=2e-6, atol=1e-7)
    ref_sorted, ref_experts = A.align_reference(ids, e, 16)
    assert torch.equal(sorted_ids, ref_sorted) and torch.equal(expert_ids, ref_experts)


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
