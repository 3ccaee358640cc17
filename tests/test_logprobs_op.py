"""The batched top-k logprobs op against its fp64 log_softmax + sort reference: values within
fp32 tolerance, ids equal (fresh random logits have no ties), targets' logprobs, k = 0, -inf
entries, bad arguments refused by name. GPU: real vocabulary, one call for many rows."""

from __future__ import annotations

import pytest
import torch

from minisgl import ops
from minisgl.ops.logprobs import top_logprobs_reference


def check(logits: torch.Tensor, k: int, targets: torch.Tensor | None) -> None:
    chosen, ids, lps = ops.top_logprobs(logits, k, targets)
    want_chosen, want_ids, want_lps = top_logprobs_reference(logits, k, targets)
    assert ids.dtype == torch.int64 and lps.dtype == torch.float32 and ids.shape == (logits.shape[0], k)
    assert torch.equal(ids.cpu(), want_ids.cpu())
    torch.testing.assert_close(lps.double(), want_lps, rtol=1e-5, atol=1e-5)
    if targets is None:
        assert chosen is None
    else:
        torch.testing.assert_close(chosen.double(), want_chosen, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("k", [0, 1, 5, 20])
def test_top_logprobs_equal_reference(k: int) -> None:
    g = torch.Generator().manual_seed(k)
    logits = torch.randn(7, 1000, generator=g) * 4
    logits[2, ::3] = float("-inf")  # masked entries never show up among the top
    targets = torch.randint(0, 1000, (7,), generator=g)
    targets[2] = 1  # not masked (1 % 3 != 0)
    check(logits, k, targets)
    check(logits[1:4], k, None)  # a row-slice view (row stride free)
    assert not ops.top_logprobs(logits, 20)[1][2].remainder(3).eq(0).any()


def test_bad_arguments_name_the_argument() -> None:
    logits = torch.randn(3, 10)
    with pytest.raises(ValueError, match="logits"):
        ops.top_logprobs(logits.double(), 2)
    with pytest.raises(ValueError, match="k must"):
        ops.top_logprobs(logits, 11)
    with pytest.raises(ValueError, match="targets"):
        ops.top_logprobs(logits, 2, torch.zeros(2, dtype=torch.int64))
    with pytest.raises(ValueError, match="targets"):
        ops.top_logprobs(logits, 2, torch.zeros(3, dtype=torch.int32))


@pytest.mark.gpu
def test_gpu_top_logprobs_at_real_vocab() -> None:
    g = torch.Generator(device="cuda").manual_seed(3)
    logits = torch.randn(64, 151_936, device="cuda", generator=g) * 3
    targets = torch.randint(0, 151_936, (64,), device="cuda", generator=g)
    check(logits, 20, targets)
    check(logits[::2], 3, None)
