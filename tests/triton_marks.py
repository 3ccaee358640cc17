"""The device and the `triton` mark of the kernel tests that compare a Triton kernel with its torch
reference through the ops wrappers."""

from __future__ import annotations

import pytest
import torch

from minisgl import env


def test_device() -> str:
    return "cuda" if torch.cuda.is_available() else "cpu"


test_device.__test__ = False  # a helper, not a test


def triton_test(fn):  # noqa: ANN001, ANN201
    """The Triton pass; on the CPU only interpreted (the ops would otherwise run the reference
    and these tests would compare it with itself)."""
    skip = pytest.mark.skipif(test_device() == "cpu" and not env.TRITON_INTERPRET,
                              reason="Triton kernels need CUDA or TRITON_INTERPRET=1")
    return pytest.mark.triton(skip(fn))
