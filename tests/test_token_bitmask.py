"""Grammar mask application: the Triton kernel against its torch reference and an independent
per-token statement of the bit layout, on fresh random logits; rows not listed stay untouched
bit for bit; the optional raw log-normalizer of each masked row against fp64 logsumexp; `gpu`:
real Qwen3 sizes, and graph replay equals eager."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import token_bitmask as K

pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def case(b: int, v: int, rows: list[int], seed: int, extra_words: int = 0, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * 3).to(DEV, dtype)
    words = -(-v // 32) + extra_words
    # Random bits everywhere, including past the vocabulary (they must be ignored).
    bitmask = torch.randint(-(2**31), 2**31 - 1, (len(rows), words), generator=g, dtype=torch.int64)
    bitmask = bitmask.to(torch.int32).to(DEV)
    return logits, bitmask, torch.tensor(rows, dtype=torch.int32, device=DEV)


def independent(logits: torch.Tensor, bitmask: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """Token t of mask row j is allowed iff bit (t % 32) of word (t // 32) is set, read in Python."""
    out = logits.double().cpu().clone()
    words = bitmask.cpu().tolist()
    for j, r in enumerate(rows):
        for t in range(logits.shape[1]):
            if not (words[j][t // 32] >> (t % 32)) & 1:
                out[r, t] = float("-inf")
    return out


@needs_triton
@pytest.mark.parametrize(
    ("b", "v", "rows", "extra"),
    [(1, 7, [0], 0), (5, 1000, [4, 0, 2], 1), (3, 4097, [1], 0), (19, 111, list(range(18, -1, -3)), 2), (2, 33, [], 0)],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kernel_matches_reference_and_bit_layout(b: int, v: int, rows: list[int], extra: int, dtype) -> None:
    logits, bitmask, rows_t = case(b, v, rows, seed=b * 7 + v, extra_words=extra, dtype=dtype)
    want = independent(logits, bitmask, rows)
    ref = logits.clone()
    K.apply_token_bitmask_reference(ref, bitmask, rows_t)
    got = logits.clone()
    K.apply_token_bitmask(got, bitmask, rows_t, block=64 if v > 64 else 32)  # several blocks per row
    assert torch.equal(ref.double().cpu(), want)
    assert torch.equal(got, ref)  # exact: -inf or the untouched value
    for r in set(range(b)) - set(rows):  # unconstrained rows: untouched, bit for bit
        assert torch.equal(got[r], logits[r])


@needs_triton
@pytest.mark.parametrize(("b", "v", "rows"), [(1, 7, [0]), (6, 1000, [5, 0, 2]), (3, 4097, [1, 2]), (2, 33, [])])
def test_lse_is_the_raw_row_logsumexp(b: int, v: int, rows: list[int]) -> None:
    """with_lse: the masked rows' logsumexp before the mask (fp64 reference), the same masking;
    a row whose block is all -inf (the penalty op's bans) adds nothing, not NaN."""
    logits, bitmask, rows_t = case(b, v, rows, seed=v + len(rows))
    if rows:
        logits[rows[0], : min(v, 40)] = float("-inf")
    want = logits[rows_t.long()].double().logsumexp(dim=-1)
    ref = logits.clone()
    K.apply_token_bitmask_reference(ref, bitmask, rows_t)
    got = logits.clone()
    lse = ops.apply_token_bitmask(got, bitmask, rows_t, with_lse=True)
    assert torch.equal(got, ref)
    assert lse is not None and lse.dtype == torch.float32 and lse.shape == (len(rows),)
    torch.testing.assert_close(lse.double(), want, rtol=1e-6, atol=1e-5)
    got2 = logits.clone()
    lse2 = K.apply_token_bitmask(got2, bitmask, rows_t, block=32, with_lse=True)  # many blocks per row
    assert torch.equal(got2, ref)
    torch.testing.assert_close(lse2.double(), want, rtol=1e-6, atol=1e-5)


@needs_triton
def test_op_strided_logits_and_nan_rows_untouched() -> None:
    """A row-strided logits view; an unlisted row full of NaN stays NaN (never read or written)."""
    full = torch.randn(4, 300, generator=torch.Generator().manual_seed(1)).to(DEV)
    full[2] = float("nan")
    logits = full[:, :257]
    _, bitmask, rows = case(4, 257, [3, 0], seed=3)
    ref = logits.clone()
    K.apply_token_bitmask_reference(ref, bitmask, rows)
    ops.apply_token_bitmask(logits, bitmask, rows)
    assert torch.equal(logits[[0, 1, 3]], ref[[0, 1, 3]])
    assert torch.isnan(full[2]).all() and torch.isfinite(full[[0, 1, 3], 257:]).all()  # past the view: untouched


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("b,k", [(1, 1), (64, 17), (256, 256)])
def test_kernel_qwen3_vocab_and_graph_replay(b: int, k: int) -> None:
    v = 151936
    rows = sorted(torch.randperm(b, generator=torch.Generator().manual_seed(b))[:k].tolist())
    logits, bitmask, rows_t = case(b, v, rows, seed=b)
    ref = logits.clone()
    K.apply_token_bitmask_reference(ref, bitmask, rows_t)
    eager = logits.clone()
    lse = ops.apply_token_bitmask(eager, bitmask, rows_t, with_lse=True)
    assert torch.equal(eager, ref)
    torch.testing.assert_close(lse.double(), logits[rows_t.long()].double().logsumexp(dim=-1), rtol=1e-6, atol=1e-4)
    static = logits.clone()
    ops.apply_token_bitmask(static.clone(), bitmask, rows_t)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.apply_token_bitmask(static, bitmask, rows_t)
    static.copy_(logits)
    graph.replay()
    assert torch.equal(static, ref)
