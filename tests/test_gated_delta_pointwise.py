"""The Gated DeltaNet layer's pointwise kernels (kernels/gated_delta_pointwise.py, through minisgl.ops)
against their torch references (the model's former code) on fresh random data: strided rows as the
projections' views give them, head counts and dims that are not powers of two, 16-bit and fp32,
decays from softplus's linear branch (a + dt_bias > 20) to its underflow (< -20); outputs written
into NaN-filled buffers would show a missed element (the ops allocate fresh ones, so this checks
every element is finite and close)."""

from __future__ import annotations

import pytest
import torch
from triton_marks import test_device, triton_test

from minisgl import ops
from minisgl.kernels import gated_delta_pointwise as P


def _close(out, ref, rtol, atol, what):
    assert out.dtype == ref.dtype and out.shape == ref.shape, what
    assert out.isfinite().all(), f"{what}: a non-finite element"
    torch.testing.assert_close(out.float(), ref.float(), rtol=rtol, atol=atol, msg=what)


@triton_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h", [(1, 32), (5, 6), (33, 48)])
@pytest.mark.parametrize("strided", [False, True])
def test_gates_match_reference(dtype, t, h, strided):
    """strided: a and b column views of one wider row (row stride 3h + 5), as Qwen3-Next's split of
    in_proj_ba and a verify's saved inputs give them; else packed rows (Qwen3.5's projections)."""
    dev = test_device()
    gen = torch.Generator().manual_seed(t * 100 + h)
    wide = (torch.randn(t, 3 * h + 5, generator=gen) * 8).to(dev).to(dtype)
    a, b = wide[:, 1 : h + 1], wide[:, h + 3 : 2 * h + 3]
    if not strided:
        a, b = a.contiguous(), b.contiguous()
    a_log = (torch.randn(h, generator=gen) * 0.5).to(dev)
    dt_bias = torch.randn(h, generator=gen).to(dev)
    a[0, 0] = 25.0  # softplus's linear branch (a + dt_bias > 20 but for a very negative bias draw)
    if h > 1:
        a[0, 1] = -30.0  # exp(x) below half an ulp of 1: log1p(w) is w itself
    g, beta = ops.gated_delta_gates(a, b, a_log, dt_bias)
    g_ref, beta_ref = P.gates_reference(a, b, a_log, dt_bias)
    assert g.is_contiguous() and beta.is_contiguous()
    # tl.exp is exp2 of x * log2(e): the product's rounding moves the result by ~|x| * 2^-24
    # relative (|b| up to ~30 here: 2e-6; the first GPU run failed beta at 1e-6)
    _close(g, g_ref, 1e-5, 1e-12, "g")
    _close(beta, beta_ref, 8e-3 if dtype == torch.bfloat16 else 1e-5, 0, "beta")


@triton_test
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h,d", [(1, 32, 128), (4, 3, 24), (17, 6, 100)])
def test_gated_norm_matches_reference(dtype, t, h, d):
    dev = test_device()
    gen = torch.Generator().manual_seed(t + h + d)
    o = (torch.randn(t, h, d, generator=gen) * 3).to(dev).to(dtype)
    zz = torch.randn(t, 2 * h, d + 4, generator=gen).to(dev).to(dtype)
    z = zz[:, 1 : h + 1, 2 : d + 2]  # strided token and head steps, as Qwen3-Next's split of qkvz
    weight = (torch.randn(d, generator=gen) * 0.5 + 1).to(dev).to(dtype)
    out = ops.gated_delta_norm(o, z, weight, 1e-6)
    ref = P.gated_norm_reference(o, z, weight, 1e-6)
    assert out.shape == (t, h * d)
    # 16-bit: the kernel's mean sums in another order, so each of its two roundings to bf16 may land
    # an ulp (2^-8 .. 2^-7 relative) away; the interpreter's fp32 -> bf16 conversions truncate
    # (measured: up to 4 ulps off torch's round-to-nearest here), so it gets more room
    rtol = (4e-2 if dev == "cpu" else 1.6e-2) if dtype == torch.bfloat16 else 1e-5
    _close(out, ref, rtol, 1e-5, "gated norm")


def test_ops_refuse_mismatched_shapes():
    a = torch.randn(2, 4)
    with pytest.raises(ValueError, match="b"):
        ops.gated_delta_gates(a, torch.randn(2, 5), torch.randn(4), torch.randn(4))
    with pytest.raises(ValueError, match="weight"):
        ops.gated_delta_norm(torch.randn(2, 3, 8), torch.randn(2, 3, 8), torch.randn(7), 1e-6)
