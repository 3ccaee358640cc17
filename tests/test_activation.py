"""SiLU-and-mul and GELU(tanh)-and-mul: the Triton kernels against its fp32 reference, and the op's checks."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import activation as K

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def _check(t: int, inter: int, dtype: torch.dtype, pad: int, seed: int, gelu: bool = False) -> None:
    gen = torch.Generator().manual_seed(seed)
    full = (torch.randn(t, 2 * inter + pad, generator=gen) * 3).to(DEV, dtype)
    x = full[:, : 2 * inter]  # row-strided when pad > 0
    out = ops.gelu_tanh_and_mul(x) if gelu else ops.silu_and_mul(x)
    assert out.shape == (t, inter) and out.dtype == dtype and out.is_contiguous()
    eps = torch.finfo(dtype).eps
    # exp differs by an fp32 ulp between backends: at most one step of the dtype after rounding.
    ref = K.gelu_tanh_and_mul_reference(x) if gelu else K.silu_and_mul_reference(x)
    # gelu: the kernel's sigmoid form of tanh rounds apart from torch's near gelu's zero crossing.
    atol = (16 if gelu else 2) * eps
    torch.testing.assert_close(out.float(), ref.float(), rtol=2 * eps, atol=atol)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("t,inter,pad", [(1, 1, 0), (7, 19, 3), (19, 111, 0), (3, 1023, 8), (2, 5000, 0)])
def test_silu_and_mul_matches_reference(dtype: torch.dtype, t: int, inter: int, pad: int) -> None:
    _check(t, inter, dtype, pad, seed=t * 31 + inter)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("t,inter,pad", [(1, 1, 0), (7, 19, 3), (3, 1023, 8)])
def test_gelu_tanh_and_mul_matches_reference(dtype: torch.dtype, t: int, inter: int, pad: int) -> None:
    _check(t, inter, dtype, pad, seed=t * 17 + inter, gelu=True)


def test_bad_arguments_name_the_argument() -> None:
    with pytest.raises(ValueError, match="even"):
        ops.silu_and_mul(torch.randn(3, 7))
    with pytest.raises(ValueError, match="x"):
        ops.silu_and_mul(torch.randn(3, 8, dtype=torch.float64))
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.silu_and_mul(torch.randn(8, 4).t())


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("inter", [4096, 14336])
def test_gpu_bf16_real_sizes(inter: int) -> None:
    _check(8192, inter, torch.bfloat16, 0, seed=inter)
