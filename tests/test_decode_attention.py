"""Paged decode attention: the CUDA kernel against an fp64 reference (FA3's error rule), CUDA
graph replay, and (on the CPU, in CI) the fp32 reference and every wrapper check."""

from __future__ import annotations

import math
import random

import pytest
import torch

from minisgl.ops.decode_attention import paged_decode_attention, paged_decode_attention_reference

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    """Marks a test `gpu` (select with -m gpu) and skips it without CUDA (no conftest needed)."""
    return pytest.mark.gpu(_needs_cuda(fn))


def make_case(
    lens: list[int],
    kv_heads: int,
    group: int,
    dim: int,
    dtype: torch.dtype,
    page: int,
    device: str,
    seed: int = 0,
    noncontig_q: bool = False,
) -> dict:
    """A paged KV cache holding len(lens) requests in shuffled pages. Every slot no request
    owns (the dummy page too) and every table entry past a length points at NaN rows."""
    g = torch.Generator().manual_seed(seed)
    batch = len(lens)
    pages_per = [max(1, -(-n // page)) for n in lens]
    num_pages = sum(pages_per) + 2
    order = torch.randperm(num_pages - 1, generator=g)[: sum(pages_per)] + 1  # page 0 stays dummy
    max_ctx = max(max(lens), 1) + 5
    rows = torch.randperm(batch + 3, generator=g)[:batch].to(torch.int32)
    table = torch.zeros(batch + 3, max_ctx, dtype=torch.int32)  # unused entries -> slot 0 (NaN)
    shape = (num_pages * page, kv_heads, dim)
    k = torch.full(shape, float("nan"), dtype=dtype)
    v = torch.full(shape, float("nan"), dtype=dtype)
    at = 0
    for row, n, npg in zip(rows.tolist(), lens, pages_per, strict=True):
        pg = order[at : at + npg]
        at += npg
        slots = (pg[:, None] * page + torch.arange(page)[None, :]).reshape(-1)[:n]
        table[row, :n] = slots.to(torch.int32)
        k[slots] = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
        v[slots] = torch.randn(n, kv_heads, dim, generator=g).to(dtype)
    hq = kv_heads * group
    # noncontig_q: a column slice of a fused qkv output, batch stride (hq + 2 hkv) * dim; sliced
    # after the move (.to() would make it contiguous).
    extra = 2 * kv_heads if noncontig_q else 0
    q = torch.randn(batch, hq + extra, dim, generator=g).to(dtype).to(device)[:, :hq]
    t = dict(
        k_cache=k,
        v_cache=v,
        req_to_slot=table,
        req_rows=rows,
        seq_lens=torch.tensor(lens, dtype=torch.int32),
    )
    return {"q": q} | {name: x.to(device) for name, x in t.items()}


def reference(c: dict, scale: float, dtype: torch.dtype) -> torch.Tensor:
    """The same math, batched over padded K/V, in `dtype` (fp64 for the reference)."""
    q, lens = c["q"], c["seq_lens"].long()
    batch, hq, dim = q.shape
    hkv = c["k_cache"].size(1)
    lmax = max(int(lens.max()), 1)
    slots = c["req_to_slot"][c["req_rows"].long(), :lmax].long()  # [B, Lmax]
    mask = torch.arange(lmax, device=q.device)[None, :] < lens[:, None]
    k = torch.where(mask[:, :, None, None], c["k_cache"][slots], 0).to(dtype)  # [B, L, Hkv, D]
    v = torch.where(mask[:, :, None, None], c["v_cache"][slots], 0).to(dtype)
    qg = q.to(dtype).view(batch, hkv, hq // hkv, dim)
    scores = torch.einsum("bhgd,blhd->bhgl", qg, k) * scale
    scores = scores.masked_fill(~mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1).nan_to_num(0.0)  # a length-0 row -> zeros
    return torch.einsum("bhgl,blhd->bhgd", probs.to(dtype), v).reshape(batch, hq, dim)


def run_and_check(c: dict, dtype: torch.dtype, max_seq_len: int | None = None) -> None:
    scale = 1.0 / math.sqrt(c["q"].size(-1))
    out = torch.full(c["q"].shape, float("nan"), dtype=dtype, device=c["q"].device)  # poisoned
    bound = int(c["seq_lens"].max()) if max_seq_len is None else max_seq_len
    paged_decode_attention(**c, scale=scale, max_seq_len=bound, out=out)
    assert torch.isfinite(out).all(), "output has unwritten (NaN) entries"
    ref = reference(c, scale, torch.float64)
    low = reference(c, scale, dtype)  # the same math done in torch in the input dtype
    err = (out.double() - ref).abs().max().item()
    err_torch = (low.double() - ref).abs().max().item()
    r = ref.to(dtype)
    floor = 2 * ((r + 0.3 - 0.3) - r).abs().max().item()
    assert err <= 2 * err_torch + floor + 1e-6, f"kernel error {err:.3e} vs torch {err_torch:.3e}"


# ---- GPU ----


@gpu
@pytest.mark.parametrize("n", [1, 7, 19, 111, 1023, 4096, 32768])
def test_context_lengths(n: int) -> None:
    batch = 3 if n <= 4096 else 1
    run_and_check(make_case([n] * batch, 2, 4, 128, torch.bfloat16, 16, "cuda", seed=n), torch.bfloat16)


@gpu
def test_context_128k() -> None:
    run_and_check(make_case([131072], 1, 8, 128, torch.bfloat16, 16, "cuda", seed=7), torch.bfloat16)


@gpu
@pytest.mark.parametrize("dim", [16, 32, 64, 128, 256])
@pytest.mark.parametrize("group", [1, 3, 4, 8])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("page", [1, 16])
def test_heads_dims_dtypes(dim: int, group: int, dtype: torch.dtype, page: int) -> None:
    c = make_case([1, 7, 19, 111, 1023], 2, group, dim, dtype, page, "cuda", seed=dim + group)
    run_and_check(c, dtype)


@gpu
@pytest.mark.parametrize("batch", [1, 2, 17, 64, 512])
def test_batch_sizes_mixed_lengths(batch: int) -> None:
    rng = random.Random(batch)
    lens = [rng.choice([1, 2, 7, 19, 33, 111, 250]) for _ in range(batch)]
    run_and_check(make_case(lens, 2, 4, 128, torch.bfloat16, 16, "cuda", seed=batch), torch.bfloat16)


@gpu
def test_mixed_long_and_short_in_one_batch() -> None:
    c = make_case([1, 32768, 7, 4096, 111, 19], 1, 4, 128, torch.float16, 16, "cuda", seed=3)
    run_and_check(c, torch.float16)


@gpu
@pytest.mark.parametrize("bound", [1, 200, 131072])
def test_split_bound_does_not_change_results(bound: int) -> None:
    """The bound only picks the split count; any value gives the right answer."""
    c = make_case([5, 1000, 64, 333], 2, 4, 64, torch.bfloat16, 1, "cuda", seed=bound)
    run_and_check(c, torch.bfloat16, max_seq_len=bound)


@gpu
def test_noncontiguous_q_and_out() -> None:
    c = make_case([19, 111, 1023], 2, 4, 128, torch.bfloat16, 16, "cuda", seed=11, noncontig_q=True)
    assert not c["q"].is_contiguous()
    run_and_check(c, torch.bfloat16)
    big = torch.full((3, 10, 128), float("nan"), dtype=torch.bfloat16, device="cuda")
    out = paged_decode_attention(**c, scale=0.1, max_seq_len=1023, out=big[:, 1:9])
    assert torch.isfinite(out).all() and big[:, 0].isnan().all() and big[:, 9].isnan().all()


@gpu
def test_zero_length_rows_give_zeros() -> None:
    c = make_case([5, 1, 40], 2, 2, 128, torch.bfloat16, 16, "cuda", seed=5)
    c["seq_lens"][1] = 0
    for bound in (40, 100000):  # one split and many
        out = paged_decode_attention(**c, scale=0.1, max_seq_len=bound)
        assert (out[1] == 0).all() and torch.isfinite(out).all()


@gpu
def test_cuda_graph_replay_with_new_lengths() -> None:
    a = make_case([300, 7, 4000, 1], 2, 4, 128, torch.bfloat16, 16, "cuda", seed=21)
    b = make_case([4001, 19, 2, 1023], 2, 4, 128, torch.bfloat16, 16, "cuda", seed=22)
    assert a["k_cache"].shape[0] <= b["k_cache"].shape[0]
    static = {name: t.clone() for name, t in b.items()}  # graph-owned buffers, sized by b
    for name in ("q", "req_rows", "seq_lens"):
        static[name].copy_(a[name])
    bound = 8192
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (num_splits lookup, allocator)
        paged_decode_attention(**static, scale=0.1, max_seq_len=bound)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(**static, scale=0.1, max_seq_len=bound)
    for name, t in b.items():  # new lengths, rows, table, cache contents
        static[name].copy_(t)
    out.fill_(float("nan"))
    graph.replay()
    eager = paged_decode_attention(**b, scale=0.1, max_seq_len=bound)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)


@gpu
def test_kernel_only_checks() -> None:
    c = make_case([4, 9], 2, 2, 128, torch.bfloat16, 1, "cuda")
    with pytest.raises(ValueError, match="q must have dtype"):
        paged_decode_attention(
            **{
                **c,
                "q": c["q"].float(),
                "k_cache": c["k_cache"].float(),
                "v_cache": c["v_cache"].float(),
            },
            scale=0.1,
            max_seq_len=9,
        )
    odd = make_case([4, 9], 2, 2, 96, torch.bfloat16, 1, "cuda")
    with pytest.raises(ValueError, match="head_dim"):
        paged_decode_attention(**odd, scale=0.1, max_seq_len=9)
    buf = torch.randn(2 * 4 * 128 + 1, dtype=torch.bfloat16, device="cuda")
    with pytest.raises(ValueError, match="q must start on a 16-byte boundary"):
        paged_decode_attention(**{**c, "q": buf[1:].view(2, 4, 128)}, scale=0.1, max_seq_len=9)


# ---- CPU (CI): the reference and the wrapper's checks ----


def test_reference_matches_naive_loop() -> None:
    c = make_case([1, 7, 19], 2, 3, 64, torch.float32, 4, "cpu", seed=1)
    out = paged_decode_attention_reference(**c, scale=0.125)
    for i, n in enumerate(c["seq_lens"].tolist()):
        slots = c["req_to_slot"][c["req_rows"][i], :n].long()
        for h in range(6):
            k, v = c["k_cache"][slots, h // 3].double(), c["v_cache"][slots, h // 3].double()
            p = torch.softmax(k @ c["q"][i, h].double() * 0.125, dim=0)
            torch.testing.assert_close(out[i, h].double(), p @ v, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.double(), reference(c, 0.125, torch.float64), rtol=1e-5, atol=1e-5)


def test_cpu_wrapper_runs_the_reference() -> None:
    c = make_case([3, 17], 1, 2, 64, torch.float32, 16, "cpu", seed=2)
    out = torch.full_like(c["q"], float("nan"))
    paged_decode_attention(**c, scale=0.1, max_seq_len=17, out=out)
    # Against this file's own fp64 math, not the wrapper's reference (the CPU path *is* it).
    torch.testing.assert_close(out.double(), reference(c, 0.1, torch.float64), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    ("name", "bad", "match"),
    [
        ("q", lambda c: c["q"].to(torch.int32), "q must have dtype"),
        ("q", lambda c: c["q"][0], "q must have 3 dimensions"),
        ("k_cache", lambda c: c["k_cache"].half(), "k_cache must have dtype"),
        ("k_cache", lambda c: c["k_cache"][:, :, :32], "k_cache must have shape"),
        (
            "k_cache",
            lambda c: c["k_cache"].transpose(1, 2).contiguous().transpose(1, 2),
            "k_cache must be contiguous",
        ),
        ("v_cache", lambda c: c["v_cache"][:-1], "v_cache must have shape"),
        ("req_to_slot", lambda c: c["req_to_slot"].long(), "req_to_slot must have dtype"),
        ("req_to_slot", lambda c: c["req_to_slot"].t(), "req_to_slot must be contiguous"),
        ("req_rows", lambda c: c["req_rows"][:1], "req_rows must have shape"),
        ("req_rows", lambda c: c["req_rows"].to("meta"), "req_rows is on meta"),
        ("seq_lens", lambda c: c["seq_lens"].float(), "seq_lens must have dtype"),
        (
            "seq_lens",
            lambda c: torch.stack([c["seq_lens"]] * 2, 1)[:, 0],
            "seq_lens must be contiguous",
        ),
        ("out", lambda c: torch.empty(2, 4, 32), "out must have shape"),
        ("out", lambda c: torch.empty(2, 4, 64, dtype=torch.float16), "out must have dtype"),
    ],
)
def test_bad_arguments_raise(name: str, bad, match: str) -> None:
    c = make_case([3, 5], 2, 2, 64, torch.float32, 1, "cpu")
    args = dict(c, out=None)
    args[name] = bad(c)
    with pytest.raises(ValueError, match=match):
        paged_decode_attention(**args, scale=0.1, max_seq_len=5)


def test_max_seq_len_below_one_raises() -> None:
    c = make_case([3, 5], 2, 2, 64, torch.float32, 1, "cpu")
    with pytest.raises(ValueError, match="max_seq_len"):
        paged_decode_attention(**c, scale=0.1, max_seq_len=0)


def test_bad_group_raises() -> None:
    c = make_case([3], 1, 9, 64, torch.float32, 1, "cpu")
    with pytest.raises(ValueError, match="q heads must be 1..8 times"):
        paged_decode_attention(**c, scale=0.1, max_seq_len=3)
