"""MoE routing and token alignment kernels against their torch references on fresh random data:
routing (ids exact, weights to fp32 rounding; the one-kernel router with its GEMM), token alignment
(exact; all tokens to the same experts; routing and alignment in one kernel). Split from
test_moe_kernels.py (the fused expert GEMMs), whose helpers it shares."""

from __future__ import annotations

import pytest
import torch
from test_moe_kernels import DEV, distinct_logits, needs_triton, random_ids

from minisgl import ops
from minisgl.kernels import moe_align as A
from minisgl.kernels import moe_routing as R

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

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
