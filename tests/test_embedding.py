"""Embedding index: exact against the torch reference on CUDA (plain and vocab-parallel, int32
and int64 ids, strided weights, every vector width); CPU: the reference and the checks."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.ops.embedding import embedding_lookup, embedding_lookup_reference

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    """Marks a test `gpu` (select with -m gpu) and skips it without CUDA (no conftest needed)."""
    return pytest.mark.gpu(_needs_cuda(fn))


def make(
    vocab: int,
    hidden: int,
    n: int,
    dtype: torch.dtype,
    id_dtype: torch.dtype,
    seed: int = 0,
    lo: int = 0,
    hi: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    weight = torch.randn(vocab, hidden, generator=g).to(dtype)
    ids = torch.randint(lo, vocab if hi is None else hi, (n,), generator=g).to(id_dtype)
    return weight, ids


@gpu
@pytest.mark.parametrize(
    ("vocab", "hidden", "n", "dtype"),
    [
        (1000, 4096, 1, torch.bfloat16),
        (32000, 1024, 777, torch.float16),
        (50, 896, 4096, torch.float32),
        (100, 6, 19, torch.float16),  # 12-byte rows: 4-byte vectors
        (100, 3, 19, torch.bfloat16),  # 6-byte rows: 2-byte vectors
    ],
)
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_lookup_exact(vocab: int, hidden: int, n: int, dtype: torch.dtype, id_dtype: torch.dtype) -> None:
    weight, ids = make(vocab, hidden, n, dtype, id_dtype, seed=n)
    weight, ids = weight.cuda(), ids.cuda()
    out = torch.full((n, hidden), float("nan"), dtype=dtype, device="cuda")
    embedding_lookup(weight, ids, out=out)
    assert torch.equal(out, F.embedding(ids.long(), weight))


@gpu
@pytest.mark.parametrize("id_dtype", [torch.int32, torch.int64])
def test_vocab_parallel_exact(id_dtype: torch.dtype) -> None:
    # This rank holds vocabulary rows [300, 600) as weight[0:300]; ids span the whole vocab.
    weight, ids = make(300, 2048, 1023, torch.bfloat16, id_dtype, seed=3, lo=-5, hi=1200)
    weight, ids = weight.cuda(), ids.cuda()
    out = embedding_lookup(weight, ids, start=300, end=600)
    assert torch.equal(out, embedding_lookup_reference(weight, ids, 300, 600))
    inside = (ids >= 300) & (ids < 600)
    assert inside.any() and (~inside).any()
    assert (out[~inside] == 0).all()


@gpu
def test_strided_weight_and_out() -> None:
    full, ids = make(500, 1024, 333, torch.bfloat16, torch.int64, seed=4)
    weight = full.cuda()[:, 256:768]  # row stride 1024, 512 columns
    ids = ids.cuda()
    out_buf = torch.full((333, 600), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = embedding_lookup(weight, ids, out=out_buf[:, 8:520])
    assert torch.equal(out, F.embedding(ids, weight))
    assert out_buf[:, :8].isnan().all() and out_buf[:, 520:].isnan().all()


def test_reference_on_cpu() -> None:
    weight, ids = make(40, 16, 50, torch.float32, torch.int64, seed=5, lo=-3, hi=60)
    out = embedding_lookup(weight[:20], ids, start=10, end=30)
    for i, t in enumerate(ids.tolist()):
        expect = weight[t - 10] if 10 <= t < 30 else torch.zeros(16)
        assert torch.equal(out[i], expect)
    w, ids = make(40, 16, 50, torch.float32, torch.int32, seed=6)
    assert torch.equal(embedding_lookup(w, ids), F.embedding(ids.long(), w))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        (dict(weight=torch.zeros(10, 4, dtype=torch.int32)), "weight must have dtype"),
        (dict(weight=torch.zeros(10)), "weight must have 2 dimensions"),
        (dict(weight=torch.zeros(4, 10).t()), "weight must be contiguous"),
        (dict(ids=torch.zeros(3, dtype=torch.float32)), "ids must have dtype"),
        (dict(ids=torch.zeros(3, 2, dtype=torch.int64)), "ids must have 1 dimensions"),
        (dict(ids=torch.zeros(6, dtype=torch.int64)[::2]), "ids must be contiguous"),
        (dict(ids=torch.zeros(3, dtype=torch.int64, device="meta")), "ids is on meta"),
        (dict(out=torch.zeros(3, 5)), "out must have shape"),
        (dict(out=torch.zeros(3, 4, dtype=torch.float16)), "out must have dtype"),
        (dict(start=0, end=11), "end - start must be in"),
    ],
)
def test_bad_arguments_raise(kwargs: dict, match: str) -> None:
    args = dict(weight=torch.zeros(10, 4), ids=torch.zeros(3, dtype=torch.int64))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        embedding_lookup(**args)
