"""Sliding windows and sinks in the CUDA paged decode kernel (issue 33), against an independent
fp64 reference: only the last W keys count, a head's sink logit joins the softmax denominator.
Slots older than each request's window are NaN and their table entries point at the NaN dummy
slot, as a window-sized pool leaves them; windows end mid-page; W = 1 and W past the context;
one split and many; an FP8 cache; CUDA graph replay. On the CPU the wrapper's reference path
is checked against the same fp64 math (CI)."""

from __future__ import annotations

import math

import pytest
import torch
from test_decode_attention import gpu, make_case

from minisgl.ops.decode_attention import paged_decode_attention


def forget_old(c: dict, window: int) -> dict:
    """NaN in every slot older than its request's window; those table entries -> slot 0."""
    table, k, v = c["req_to_slot"].clone(), c["k_cache"].clone(), c["v_cache"].clone()
    for row, n in zip(c["req_rows"].tolist(), c["seq_lens"].tolist(), strict=True):
        lo = max(0, n - window)
        k[table[row, :lo].long()] = float("nan")
        v[table[row, :lo].long()] = float("nan")
        table[row, :lo] = 0
    k[0], v[0] = float("nan"), float("nan")
    return c | {"req_to_slot": table, "k_cache": k, "v_cache": v}


def reference(c: dict, scale: float, window: int, sinks: torch.Tensor | None) -> torch.Tensor:
    """fp64, one request and head at a time: softmax over [keys in the window] + [sink]."""
    q = c["q"].double()
    batch, hq, dim = q.shape
    group = hq // c["k_cache"].size(1)
    out = torch.zeros(batch, hq, dim, dtype=torch.float64, device=q.device)
    for i, (row, n) in enumerate(zip(c["req_rows"].tolist(), c["seq_lens"].tolist(), strict=True)):
        lo = max(0, n - window) if window else 0
        slots = c["req_to_slot"][row, lo:n].long()
        for h in range(hq):
            k = c["k_cache"][slots, h // group].double() * c.get("k_scale", 1.0)
            v = c["v_cache"][slots, h // group].double() * c.get("v_scale", 1.0)
            logits = k @ q[i, h] * scale
            if sinks is not None:
                logits = torch.cat([logits, sinks[h].double().reshape(1)])
            p = torch.softmax(logits, dim=0)[: len(slots)]
            out[i, h] = p @ v
    return out


def check(c: dict, window: int, sinks: torch.Tensor | None, dtype: torch.dtype, bound: int, **kw) -> None:
    scale = 1.0 / math.sqrt(c["q"].size(-1))
    out = torch.full(c["q"].shape, float("nan"), dtype=dtype, device=c["q"].device)
    scales = {n: c[n] for n in ("k_scale", "v_scale") if n in c}
    tensors = {n: c[n] for n in ("q", "k_cache", "v_cache", "req_to_slot", "req_rows", "seq_lens")}
    paged_decode_attention(**tensors, **scales, scale=scale, max_seq_len=bound, out=out, window=window,
                           sinks=sinks, **kw)
    assert torch.isfinite(out).all(), "NaN in the output: a slot outside the window was read"
    ref = reference(c, scale, window, sinks)
    tol = 2e-2 if dtype != torch.float32 else 1e-5
    torch.testing.assert_close(out.double(), ref, rtol=tol, atol=tol)


def sinks_for(hq: int, seed: int, device: str) -> torch.Tensor:
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2).to(device)


CASES = [  # (lengths, window)
    ([1, 17, 64, 100], 16),  # windows ending mid-page (page 16), a row shorter than W
    ([5, 300], 50),
    ([33, 2], 1),  # each query sees its own key alone
    ([20, 9], 64),  # W past the context: full attention
    ([4096, 130, 7], 128),  # GPT-OSS's window behind a long context
]


@gpu
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("splits", [None, 1, 3])
def test_window_and_sinks(case, with_sinks: bool, page: int, splits: int | None) -> None:
    lens, window = case
    c = forget_old(make_case(lens, 2, 4, 64, torch.bfloat16, page, "cuda", seed=sum(lens) + window), window)
    sinks = sinks_for(8, window, "cuda") if with_sinks else None
    check(c, window, sinks, torch.bfloat16, bound=32768, num_splits=splits)


@gpu
@pytest.mark.parametrize("dim,group", [(16, 2), (32, 2)])  # the tiny GPT-OSS / Gemma 3 test models' heads
@pytest.mark.parametrize("window", [0, 16])
def test_small_heads_with_sinks(dim: int, group: int, window: int) -> None:
    """Small heads, a multi-split bound (512, as the engine's graphs pass) and rows of mixed
    lengths: the layout of the tiny GPT-OSS engine test, which missed transformers' tokens with
    this kernel's sink path (not yet explained; the backend sends sinks to Triton meanwhile)."""
    c = make_case([35 + 9, 17 + 9, 1 + 9, 100 + 9], 2, group, dim, torch.bfloat16, 1, "cuda", seed=dim + window)
    c = forget_old(c, window) if window else c
    check(c, window, sinks_for(2 * group, dim, "cuda"), torch.bfloat16, bound=512)


@gpu
@pytest.mark.parametrize("dim,group", [(64, 8), (128, 2), (256, 4)])  # GPT-OSS, Gemma 3 27B, Gemma 3 4B
def test_model_shapes(dim: int, group: int) -> None:
    c = forget_old(make_case([3000, 1025, 1], 2, group, dim, torch.bfloat16, 16, "cuda", seed=dim), 1024)
    check(c, 1024, sinks_for(2 * group, dim, "cuda"), torch.bfloat16, bound=32768)
    full = make_case([3000, 1025, 1], 2, group, dim, torch.bfloat16, 16, "cuda", seed=dim + 1)
    check(full, 0, sinks_for(2 * group, dim + 1, "cuda"), torch.bfloat16, bound=32768)  # sinks, no window


@gpu
def test_fp8_cache_window_and_sinks() -> None:
    c = forget_old(make_case([40, 7, 900], 2, 4, 128, torch.bfloat16, 16, "cuda", seed=9), 32)
    ks, vs = 0.5, 0.25
    for name, s in (("k_cache", ks), ("v_cache", vs)):
        c[name] = (c[name] / s).to(torch.float8_e4m3fn)  # NaN stays NaN (e4m3fn has one)
        assert c[name].float().isnan().any()
    c |= {"k_scale": ks, "v_scale": vs}
    # the reference reads the same e4m3 values (as fp64) times the scales
    check(c, 32, sinks_for(8, 3, "cuda"), torch.bfloat16, bound=1024)


@gpu
def test_cuda_graph_replay_with_window_and_sinks() -> None:
    a = forget_old(make_case([300, 7, 4000, 1], 2, 4, 128, torch.bfloat16, 16, "cuda", seed=21), 128)
    b = forget_old(make_case([4001, 19, 2, 1023], 2, 4, 128, torch.bfloat16, 16, "cuda", seed=22), 128)
    sinks = sinks_for(8, 5, "cuda")
    names = ("q", "k_cache", "v_cache", "req_to_slot", "req_rows", "seq_lens")
    static = {n: b[n].clone() for n in names}
    for n in ("q", "req_rows", "seq_lens"):
        static[n].copy_(a[n])
    kw = dict(scale=0.1, max_seq_len=8192, window=128, sinks=sinks)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        paged_decode_attention(**static, **kw)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_decode_attention(**static, **kw)
    for n in names:
        static[n].copy_(b[n])
    out.fill_(float("nan"))
    graph.replay()
    eager = paged_decode_attention(**{n: b[n] for n in names}, **kw)
    torch.cuda.synchronize()
    assert torch.equal(out, eager)
    torch.testing.assert_close(out.double(), reference(b, 0.1, 128, sinks), rtol=2e-2, atol=2e-2)


# ---- CPU (CI): the wrapper's reference path takes windows and sinks, and bad ones are named ----


@pytest.mark.parametrize("case", CASES[:4])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_cpu_reference_window_and_sinks(case, with_sinks: bool) -> None:
    lens, window = case
    c = forget_old(make_case(lens, 2, 3, 32, torch.float32, 4, "cpu", seed=len(lens) + window), window)
    check(c, window, sinks_for(6, 1, "cpu") if with_sinks else None, torch.float32, bound=max(lens))


def test_bad_window_and_sinks_are_named() -> None:
    c = make_case([5, 9], 2, 2, 32, torch.float32, 4, "cpu")
    with pytest.raises(ValueError, match="window"):
        paged_decode_attention(**c, scale=0.1, max_seq_len=9, window=-2)
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(**c, scale=0.1, max_seq_len=9, sinks=torch.zeros(3))
    with pytest.raises(ValueError, match="sinks"):
        paged_decode_attention(**c, scale=0.1, max_seq_len=9, sinks=torch.zeros(4, dtype=torch.float16))
