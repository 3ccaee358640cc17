"""RMSNorm and fused add + RMSNorm: the Triton kernel against its fp32 reference, and the op's checks.

On the CPU the kernels run under TRITON_INTERPRET=1 (small shapes); `gpu` tests cover bf16 at
real sizes."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import norm as K

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _rows(t: int, h: int, dtype: torch.dtype, gen: torch.Generator, pad: int = 0) -> torch.Tensor:
    """[t, h] random rows; with pad > 0 a row-strided view into a wider tensor."""
    full = torch.randn(t, h + pad, generator=gen).to(DEV, dtype) * 2 + 0.5
    return full[:, :h] if pad else full


def _ulp_close(a: torch.Tensor, b: torch.Tensor) -> None:
    # Sum-of-squares order differs from torch's: allow one rounding step of the dtype.
    eps = torch.finfo(a.dtype).eps
    torch.testing.assert_close(a.float(), b.float(), rtol=2 * eps, atol=2 * eps)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h,pad", [(1, 7, 0), (19, 111, 5), (3, 1023, 0), (5, 256, 64)])
def test_rmsnorm_matches_reference(dtype: torch.dtype, t: int, h: int, pad: int) -> None:
    gen = torch.Generator().manual_seed(t * 1000 + h)
    x = _rows(t, h, dtype, gen, pad)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEV, dtype)
    out = K.rmsnorm(x, w, 1e-6)
    assert out.is_contiguous() and out.dtype == dtype
    _ulp_close(out, K.rmsnorm_reference(x, w, 1e-6))


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,h,pad", [(1, 7, 0), (19, 111, 3), (4, 1023, 0)])
def test_fused_add_rmsnorm_matches_reference(dtype: torch.dtype, t: int, h: int, pad: int) -> None:
    gen = torch.Generator().manual_seed(t * 7 + h)
    x = _rows(t, h, dtype, gen, pad)
    res = _rows(t, h, dtype, gen, pad)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEV, dtype)
    x_before = x.clone()
    ref_out, ref_res = K.fused_add_rmsnorm_reference(x, res, w, 1e-5)
    out, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-5)
    assert new_res.data_ptr() == res.data_ptr(), "the new residual is written in place"
    if DEV == "cpu" and dtype == torch.bfloat16:
        _ulp_close(new_res, ref_res)  # the interpreter truncates fp32 -> bf16 instead of rounding
    else:
        assert torch.equal(new_res, ref_res), "x + residual is one fp32 add rounded once: exact"
    assert torch.equal(x, x_before), "x is left untouched"
    _ulp_close(out, ref_out)


@needs_triton
def test_rmsnorm_fp32_weight_with_half_input() -> None:
    gen = torch.Generator().manual_seed(3)
    x = _rows(6, 64, torch.float16, gen)
    w = torch.randn(64, generator=gen).to(DEV)
    _ulp_close(ops.rmsnorm(x, w, 1e-6), K.rmsnorm_reference(x, w, 1e-6))


def test_reference_is_hf_llama_rmsnorm() -> None:
    """The reference follows HF: normalize in fp32, cast, then weight * hidden in the input dtype."""
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4, 48, generator=gen).to(torch.bfloat16)
    w = torch.randn(48, generator=gen).to(torch.bfloat16)
    xf = x.float()
    hf = w * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + 1e-6)).to(torch.bfloat16)
    assert torch.equal(K.rmsnorm_reference(x, w, 1e-6), hf)


def test_bad_arguments_name_the_argument() -> None:
    x = torch.randn(3, 8)
    with pytest.raises(ValueError, match="weight"):
        ops.rmsnorm(x, torch.randn(9), 1e-6)
    with pytest.raises(ValueError, match="x"):
        ops.rmsnorm(torch.randn(3, 8, 2), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        ops.fused_add_rmsnorm(x, torch.randn(3, 8, dtype=torch.float16), torch.randn(8), 1e-6)
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.rmsnorm(torch.randn(8, 3).t(), torch.randn(8), 1e-6)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("h", [4096, 5120])
def test_gpu_bf16_real_sizes(h: int) -> None:
    gen = torch.Generator().manual_seed(h)
    x = _rows(8192, h, torch.bfloat16, gen)
    res = _rows(8192, h, torch.bfloat16, gen)
    w = (torch.randn(h, generator=gen) * 0.5 + 1).to(DEV, torch.bfloat16)
    _ulp_close(ops.rmsnorm(x, w, 1e-5), K.rmsnorm_reference(x, w, 1e-5))
    ref_out, ref_res = K.fused_add_rmsnorm_reference(x, res, w, 1e-5)
    out, new_res = ops.fused_add_rmsnorm(x, res, w, 1e-5)
    assert torch.equal(new_res, ref_res)
    _ulp_close(out, ref_out)
