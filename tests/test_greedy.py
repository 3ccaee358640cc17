"""Greedy rows (kernels/greedy.py through ops.greedy): the first argmax and log_softmax at it,
against torch on fresh random logits: vocabularies across the chunk boundaries, ties within and
across chunks, -inf (masked) logits, a row alone against the same row in a batch, bit for bit."""

from __future__ import annotations

import pytest
import torch
from triton_marks import test_device, triton_test

from minisgl import ops
from minisgl.kernels.greedy import CHUNK, greedy_reference

DEV = test_device()


def logits(b: int, v: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, v, generator=g) * 4).to(DEV)


def check(x: torch.Tensor) -> None:
    tok, lp = ops.greedy(x)
    want_tok = x.argmax(dim=-1)
    want_lp = torch.log_softmax(x.double(), dim=-1).gather(1, want_tok[:, None]).squeeze(1)
    assert tok.dtype == torch.int64 and lp.dtype == torch.float32
    assert torch.equal(tok, want_tok)
    torch.testing.assert_close(lp.double(), want_lp, rtol=0, atol=2e-5)


@triton_test
@pytest.mark.parametrize("v", [1, 37, CHUNK - 1, CHUNK, CHUNK + 1, 3 * CHUNK + 123, 32_000])
def test_rows_match_torch(v: int) -> None:
    check(logits(5, v, seed=v))


@triton_test
def test_ties_take_the_first_index() -> None:
    x = logits(4, 3 * CHUNK + 5, seed=1)
    top = x.max() + 1.0
    x[0, [7, 9]] = top  # within a chunk
    x[1, [CHUNK + 3, 2 * CHUNK + 1, 3 * CHUNK + 4]] = top  # across chunks, the last one partial
    x[2, [2 * CHUNK, CHUNK - 1]] = top  # the earlier index in the earlier chunk
    x[3, :] = 0.5  # every logit equal
    check(x)
    assert ops.greedy(x)[0].tolist() == [7, CHUNK + 3, CHUNK - 1, 0]


@triton_test
def test_masked_logits() -> None:
    x = logits(3, 2 * CHUNK + 77, seed=2)
    x[0, : 2 * CHUNK] = float("-inf")  # whole chunks masked: the token lies in the last one
    x[1, 1::2] = float("-inf")
    keep = torch.zeros(x.shape[1], dtype=torch.bool, device=x.device)
    keep[[5, CHUNK + 9]] = True
    x[2, ~keep] = float("-inf")  # a grammar leaving two tokens
    check(x)
    x[1] = float("-inf")  # every logit masked: token 0 and a NaN log-prob, as torch gives
    tok, lp = ops.greedy(x)
    want_tok, want_lp = greedy_reference(x)
    assert tok[1].item() == want_tok[1].item() == 0
    assert torch.isnan(lp[1]) and torch.isnan(want_lp[1])


@triton_test
def test_a_row_alone_equals_the_row_in_a_batch() -> None:
    x = logits(9, 5 * CHUNK + 11, seed=3)
    check(x)
    tok, lp = ops.greedy(x)
    for i in range(x.shape[0]):
        t1, l1 = ops.greedy(x[i : i + 1].clone())
        assert t1.item() == tok[i].item() and torch.equal(l1, lp[i : i + 1])


@triton_test
def test_row_stride_and_empty_batch() -> None:
    base = logits(3, 2 * CHUNK + 40, seed=4)
    check(base[:, : 2 * CHUNK + 1])  # a column slice: row stride past the vocabulary
    tok, lp = ops.greedy(base[:0])
    assert tok.shape == (0,) and lp.shape == (0,)


def test_reference_and_errors() -> None:
    x = torch.randn(3, 50)
    tok, lp = greedy_reference(x)
    assert torch.equal(tok, x.argmax(-1))
    torch.testing.assert_close(lp, torch.log_softmax(x, -1).gather(1, tok[:, None]).squeeze(1))
    with pytest.raises(ValueError, match="logits"):
        ops.greedy(x.double())
    with pytest.raises(ValueError, match="packed"):
        ops.greedy(torch.randn(50, 3).t())
    with pytest.raises(ValueError, match="non-empty"):
        ops.greedy(torch.randn(3, 0))
