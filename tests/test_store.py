"""KV-cache store: exact against the torch reference on CUDA (every vector width, strided
k/v slices of a fused qkv output), untouched slots stay untouched; CPU: the reference and the
wrapper's checks."""

from __future__ import annotations

import pytest
import torch

from minisgl.ops.store import store_kv, store_kv_reference

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    """Marks a test `gpu` (select with -m gpu) and skips it without CUDA (no conftest needed)."""
    return pytest.mark.gpu(_needs_cuda(fn))


def make_case(
    n: int,
    slots_total: int,
    heads: int,
    dim: int,
    dtype: torch.dtype,
    device: str,
    fused: bool = False,
    seed: int = 0,
) -> dict:
    g = torch.Generator().manual_seed(seed)
    k_cache = torch.randn(slots_total, heads, dim, generator=g).to(dtype)
    v_cache = torch.randn(slots_total, heads, dim, generator=g).to(dtype)
    if fused:  # k, v as column slices of a [n, (q + k + v) heads, dim] projection output
        qkv = torch.randn(n, 3 * heads, dim, generator=g).to(dtype).to(device)
        k, v = qkv[:, heads : 2 * heads], qkv[:, 2 * heads :]  # sliced on the device
    else:
        k = torch.randn(n, heads, dim, generator=g).to(dtype).to(device)
        v = torch.randn(n, heads, dim, generator=g).to(dtype).to(device)
    slots = torch.randperm(slots_total, generator=g)[:n].to(torch.int32)
    c = dict(k_cache=k_cache, v_cache=v_cache, slots=slots)
    return {"k": k, "v": v} | {name: t.to(device) for name, t in c.items()}


@gpu
@pytest.mark.parametrize(
    ("n", "heads", "dim", "dtype"),
    [
        (1, 8, 128, torch.bfloat16),  # 16-byte vectors
        (7, 2, 64, torch.float16),
        (1023, 8, 128, torch.bfloat16),
        (4096, 1, 256, torch.float32),
        (19, 1, 6, torch.float16),  # 12-byte rows: 4-byte vectors
        (111, 3, 3, torch.bfloat16),  # 18-byte rows: 2-byte vectors
    ],
)
@pytest.mark.parametrize("fused", [False, True])
def test_store_matches_reference_exactly(n: int, heads: int, dim: int, dtype: torch.dtype, fused: bool) -> None:
    c = make_case(n, 2 * n + 3, heads, dim, dtype, "cuda", fused=fused, seed=n)
    if fused and n > 1:
        assert not c["k"].is_contiguous()
    ref_k, ref_v = c["k_cache"].clone(), c["v_cache"].clone()
    store_kv_reference(ref_k, ref_v, c["k"], c["v"], c["slots"])
    store_kv(**c)
    assert torch.equal(c["k_cache"], ref_k) and torch.equal(c["v_cache"], ref_v)


@gpu
def test_store_empty_batch_is_a_no_op() -> None:
    c = make_case(0, 4, 2, 64, torch.bfloat16, "cuda")
    before = c["k_cache"].clone()
    store_kv(**c)
    assert torch.equal(c["k_cache"], before)


def test_reference_on_cpu() -> None:
    c = make_case(5, 11, 2, 8, torch.float32, "cpu", fused=True, seed=1)
    untouched = [s for s in range(11) if s not in c["slots"].tolist()]
    before = c["k_cache"][untouched].clone()
    store_kv(**c)
    for i, s in enumerate(c["slots"].tolist()):
        assert torch.equal(c["k_cache"][s], c["k"][i]) and torch.equal(c["v_cache"][s], c["v"][i])
    assert torch.equal(c["k_cache"][untouched], before)


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("k_cache", lambda c: c["k_cache"].long(), "k_cache must have dtype"),
        ("v_cache", lambda c: c["v_cache"].half(), "v_cache must have dtype"),
        ("v_cache", lambda c: c["v_cache"][:-1], "v_cache must have shape"),
        ("k", lambda c: c["k"][:, :1], "k must have shape"),
        (
            "k",
            lambda c: c["k"].transpose(1, 2).contiguous().transpose(1, 2),
            "k must be contiguous",
        ),
        ("v", lambda c: c["v"][:-1], "v must have shape"),
        ("v", lambda c: c["v"].to("meta"), "v is on meta"),
        ("slots", lambda c: c["slots"].long(), "slots must have dtype"),
        ("slots", lambda c: c["slots"][:2], "slots must have shape"),
    ],
)
def test_bad_arguments_raise(name: str, bad, match: str) -> None:
    c = make_case(3, 8, 2, 8, torch.float32, "cpu")
    c[name] = bad(c)
    with pytest.raises(ValueError, match=match):
        store_kv(**c)
