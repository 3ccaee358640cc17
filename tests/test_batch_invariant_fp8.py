"""Deterministic mode's FP8 GEMM (kernels/batch_invariant_fp8.py) in the Triton interpreter: right
values against the fp32 reference, rows unchanged by M, its K order the skinny FP8 loader's k16 steps,
bad arguments refused by name. (On the GPU tests/test_deterministic_gpu.py compares its rows with the
skinny kernel's bit for bit.)"""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from minisgl.kernels.batch_invariant_fp8 import _e4m3_to, _span

pytestmark = pytest.mark.triton


@triton.jit
def _store_span(out):
    tl.store(out + tl.arange(0, 128), _span())


@triton.jit
def _convert(W, Y, CONVERT: tl.constexpr):
    i = tl.arange(0, 16)[:, None] * 16 + tl.arange(0, 16)[None, :]
    tl.store(Y + i, _e4m3_to(tl.load(W + i), Y.dtype.element_ty, CONVERT))


def _weights(n: int, k: int, block: bool, g: torch.Generator, dev: torch.device):
    from minisgl.ops.gemm.fp8 import expand_block_scale, quantize_blocks, quantize_rows

    w16 = torch.randn(n, k, generator=g) * 0.05
    if block:
        w, compact = quantize_blocks(w16)
        return w.to(dev), expand_block_scale(compact, n).to(dev)
    w, s = quantize_rows(w16)
    return w.to(dev), s.to(dev)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("k,splits", [(512, 1), (512, 2), (512, 4), (200, 1)])
def test_values_and_rows_independent_of_m(k: int, splits: int, block: bool) -> None:
    """Per-channel and block scales, a bias, K in 1-4 splits and a masked K tail (200): the fp32
    reference's values, and the probe rows' bits whatever rows follow them (the interpreter's matmul
    rounds a row by its place in the tile, so the probes keep their places)."""
    from minisgl.kernels.batch_invariant_fp8 import gemm
    from minisgl.ops.gemm.reference import fp8_linear_reference

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(k + splits)
    n = 40  # not a multiple of the tiles: clamped columns
    w, scale = _weights(n, k, block, g, dev)
    # fp16: the interpreter's bf16 tl.dot is wrong (Triton 3.9: it multiplies the raw bits)
    bias = torch.randn(n, generator=g).to(dev, torch.float16)
    probe = torch.randn(5, k, generator=g).to(dev, torch.float16)
    first = gemm(probe, w, scale, splits, bias)
    assert first.dtype == torch.float16 and first.shape == (5, n)
    ref = fp8_linear_reference(probe, w, scale, 128, bias).float()
    torch.testing.assert_close(first.float(), ref, atol=2e-2, rtol=2e-2)
    for m in (17, 37):
        others = torch.randn(m - 5, k, generator=g).to(dev, torch.float16)
        got = gemm(torch.cat([probe, others]), w, scale, splits, bias)
        assert torch.equal(got[:5], first), f"M={m}, {splits} splits: rows differ from M=5's"


def test_fp32_activations_are_exact_to_the_reference() -> None:
    """fp32 x (ieee dots): within fp32 rounding of the reference."""
    from minisgl.kernels.batch_invariant_fp8 import gemm
    from minisgl.ops.gemm.reference import fp8_linear_reference

    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    g = torch.Generator().manual_seed(3)
    w, scale = _weights(24, 256, True, g, dev)
    x = torch.randn(3, 256, generator=g).to(dev)
    torch.testing.assert_close(gemm(x, w, scale, 2), fp8_linear_reference(x, w, scale, 128), atol=1e-5, rtol=1e-5)


def test_span_order_is_the_skinny_loaders_k16_steps() -> None:
    """The kernel's K offsets in a span: a permutation of 0..127 whose 16-element step i of 64-element
    chunk c holds K elements 64c + 16q + 4i + t (q, t in 0..3), the products the skinny FP8 loader's
    MMA i of that chunk takes (csrc/skinny_weights.cuh Fp8W: thread q's elements 4i..4i+3)."""
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    out = torch.full((128,), -1, dtype=torch.int32, device=dev)
    _store_span[(1,)](out)
    kp = out.cpu().tolist()
    assert sorted(kp) == list(range(128))
    for c in range(2):
        for i in range(4):
            step = set(kp[64 * c + 16 * i : 64 * c + 16 * i + 16])
            assert step == {64 * c + 16 * q + 4 * i + t for q in range(4) for t in range(4)}, (c, i, sorted(step))


@pytest.mark.gpu
def test_e4m3_to_bf16_by_moving_bits_is_exact() -> None:
    """The kernel's e4m3 -> bf16 conversion (PTX moving bits, csrc/fp8_convert.cuh's scheme) gives
    torch's values for all 254 finite bytes (denormals and both zeros' signs too), in a shuffled tile
    so that each packed word holds unrelated bytes."""
    from minisgl.kernels.batch_invariant_fp8 import bits_convert

    if not torch.cuda.is_available():
        pytest.skip("needs a GPU (the interpreter runs no PTX)")
    dev = torch.device("cuda")
    g = torch.Generator().manual_seed(5)
    finite = torch.tensor([b for b in range(256) if b & 0x7F != 0x7F], dtype=torch.uint8)
    bytes_ = torch.cat([finite, finite[:2]])[torch.randperm(256, generator=g)].to(dev)
    w = bytes_.view(torch.float8_e4m3fn)
    y = torch.empty(256, dtype=torch.bfloat16, device=dev)
    assert bits_convert(y)
    _convert[(1,)](w, y, CONVERT=True)
    ref = w.to(torch.bfloat16)
    assert torch.equal(y.view(torch.int16), ref.view(torch.int16)), (
        f"{(y.view(torch.int16) != ref.view(torch.int16)).sum().item()} of 256 differ")


def test_bad_arguments_are_refused_by_name() -> None:
    from minisgl.kernels.batch_invariant_fp8 import gemm

    g = torch.Generator().manual_seed(4)
    w, scale = _weights(16, 384, True, g, torch.device("cpu"))
    x = torch.randn(2, 384, generator=g).bfloat16()
    with pytest.raises(ValueError, match="multiple of 256"):  # 384 is not two whole spans a split
        gemm(x, w, scale, 2)
    with pytest.raises(ValueError, match="ceil"):
        gemm(x, w, scale[:, :2], 1)
    with pytest.raises(ValueError, match="e4m3"):
        gemm(x, w.float(), scale, 1)
    with pytest.raises(ValueError, match="packed in K"):
        gemm(x.t().contiguous().t(), w, scale, 1)


def test_splits_and_skinny_tiles_by_shape() -> None:
    """The FP8 splits are fixed per weight shape (the 16-bit rule, halved from 6,144 rows), and the
    skinny tile the mode launches is one whose warp group fits the warps' shares."""
    from minisgl.kernels.batch_invariant_fp8 import splits_for
    from minisgl.ops.gemm.skinny import deterministic_fp8_tile

    assert [splits_for(n, k) for n, k in [(6144, 4096), (28672, 4096), (4096, 4096), (4096, 14336), (1000, 1040)]] == [
        4, 4, 8, 8, 1]
    assert [deterministic_fp8_tile(m, 4096, 4) for m in (1, 8, 9, 16, 17, 32)] == [2, 2, 0, 0, 1, 1]
    assert deterministic_fp8_tile(1, 4096, 8) == 0  # 8 warps: tile 0 is faster (H200)
    assert splits_for(1024, 1280) == 2
    assert deterministic_fp8_tile(1, 1280, 2) == 0  # 640-element shares: not whole groups of 256
