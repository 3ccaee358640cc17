"""Extend (prefill) attention over the paged cache: Triton kernel vs an fp64 reference under
FA3's rule (kernel error <= 2x the error of the same math in torch in the same dtype + the
dtype's rounding floor), page sizes 1 and 16 with permuted pages, prefixes 0 and many."""

from __future__ import annotations

import attention_rule
import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import extend_attention as K

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(prefix: list[int], ext: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype,
              page_size: int, seed: int):
    gen = torch.Generator().manual_seed(seed)
    seq = [p + e for p, e in zip(prefix, ext)]
    table, rows, num_slots = attention_rule.paged_table(seq, page_size, gen, DEV)
    k_cache = torch.randn(num_slots, hkv, d, generator=gen).to(DEV, dtype)
    v_cache = torch.randn(num_slots, hkv, d, generator=gen).to(DEV, dtype)
    t = sum(ext)
    q = torch.randn(t, hq, d, generator=gen).to(DEV, dtype)
    cu = torch.tensor([0] + torch.tensor(ext).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    return dict(q=q, k_cache=k_cache, v_cache=v_cache, req_to_slot=table, req_rows=rows,
                prefix_lens=torch.tensor(prefix, **i32), seq_lens=torch.tensor(seq, **i32),
                cu_seqlens_q=cu, max_extend_len=max(ext), scale=d**-0.5)


def assert_fa3_rule(out: torch.Tensor, c: dict) -> None:
    args = (c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"], c["req_rows"], c["prefix_lens"],
            c["cu_seqlens_q"], c["scale"])
    attention_rule.assert_fa3_rule(out, K.extend_attention_reference, *args)


CASES = [  # (prefix_lens, extend_lens)
    ([0], [1]),
    ([0], [111]),  # batch 1, plain prefill, odd length
    ([37], [1]),
    ([0, 5, 64, 100], [19, 7, 33, 1]),  # mixed: no prefix, short, block-aligned, decode-like
    ([130, 0, 17], [40, 64, 3]),
]


@needs_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", CASES)
def test_extend_matches_reference(case, page_size: int) -> None:
    prefix, ext = case
    c = make_case(prefix, ext, hq=4, hkv=2, d=64, dtype=torch.float16, page_size=page_size,
                  seed=sum(prefix) + 3 * sum(ext) + page_size)
    assert_fa3_rule(ops.extend_attention(**c), c)


@needs_triton
@pytest.mark.parametrize("hq,hkv,d", [(3, 3, 32), (8, 1, 128), (4, 2, 80)])
def test_extend_head_layouts(hq: int, hkv: int, d: int) -> None:
    """MHA, GQA group 8 (MQA), a non-power-of-two head dim."""
    c = make_case([9, 0], [21, 5], hq, hkv, d, torch.float16, page_size=16, seed=hq * d)
    assert_fa3_rule(ops.extend_attention(**c), c)


@needs_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unused_cache_slots_never_reach_the_output(page_size: int, dtype: torch.dtype) -> None:
    prefix, ext = [5, 0, 40], [7, 1, 29]  # context ends inside a key tile
    c = make_case(prefix, ext, 4, 2, 64, dtype, page_size, seed=7 + page_size)
    attention_rule.poison_unused_slots(c, [p + e for p, e in zip(prefix, ext)])
    assert_fa3_rule(ops.extend_attention(**c), c)


@needs_triton
def test_extend_fp32_and_out_and_strided_q() -> None:
    c = make_case([3, 40], [18, 9], 4, 2, 64, torch.float32, page_size=1, seed=11)
    qkv = torch.randn(c["q"].shape[0], 8 * 64, device=DEV)
    q = qkv[:, : 4 * 64].view(-1, 4, 64)  # a row-strided view, as sliced from fused qkv
    q.copy_(c["q"])
    c["q"] = q
    out = torch.full_like(c["q"], float("nan")).contiguous()
    res = ops.extend_attention(**c, out=out)
    assert res.data_ptr() == out.data_ptr()
    assert_fa3_rule(out, c)


def test_bad_arguments_name_the_argument() -> None:
    c = make_case([2], [3], 4, 2, 16, torch.float32, page_size=1, seed=0)
    with pytest.raises(ValueError, match="prefix_lens"):
        ops.extend_attention(**{**c, "prefix_lens": c["prefix_lens"].long()})
    with pytest.raises(ValueError, match="cu_seqlens_q"):
        ops.extend_attention(**{**c, "cu_seqlens_q": c["cu_seqlens_q"][:1]})
    with pytest.raises(ValueError, match="k_cache"):
        ops.extend_attention(**{**c, "k_cache": c["k_cache"].half()})
    with pytest.raises(ValueError, match="multiple of kv heads"):
        ops.extend_attention(**{**c, "q": torch.randn(3, 3, 16, device=DEV)})
    with pytest.raises(ValueError, match="multiple of kv heads"):  # zero KV heads: no ZeroDivisionError
        ops.extend_attention(**{**c, "k_cache": c["k_cache"][:, :0], "v_cache": c["v_cache"][:, :0]})
    for bad in (0, 2, 4):  # 3 new tokens in 1 request
        with pytest.raises(ValueError, match="max_extend_len"):
            ops.extend_attention(**{**c, "max_extend_len": bad})


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_real_sizes(dtype: torch.dtype, d: int, page_size: int) -> None:
    prefix, ext = [0, 1000, 3, 517], [1023, 300, 1, 777]
    c = make_case(prefix, ext, 32, 8, d, dtype, page_size, seed=d + page_size)
    assert_fa3_rule(ops.extend_attention(**c), c)


@needs_triton
@pytest.mark.parametrize("page_size", [1, 16])
def test_triton_backend_matches_torch_backend(page_size: int) -> None:
    """A prefill step (with a cached prefix) then a decode step through both backends."""
    from minisgl.attention.torch_backend import TorchAttentionBackend
    from minisgl.attention.triton_backend import TritonAttentionBackend
    from minisgl.core.batch import ForwardBatch
    from minisgl.kvcache.pool import KVPool

    gen = torch.Generator().manual_seed(page_size)
    hq, hkv, d, layers = 4, 2, 64, 2
    prefix, ext = [0, 21], [13, 6]
    seq = [p + e for p, e in zip(prefix, ext)]
    table, rows, num_slots = attention_rule.paged_table([s + 1 for s in seq], page_size, gen, DEV)
    pools = [KVPool(layers, num_slots // page_size, page_size, hkv, d, torch.float16, torch.device(DEV))
             for _ in range(2)]
    cached = torch.randn((2, *pools[0]._k.shape), generator=gen).half()
    for pool in pools:  # identical random caches: the prefixes' K/V are "already cached"
        pool._k.copy_(cached[0])
        pool._v.copy_(cached[1])
    backends = [TorchAttentionBackend(pools[0], hq, d**-0.5), TritonAttentionBackend(pools[1], hq, d**-0.5)]

    def batch(mode: str, pre: list[int], new: list[int]) -> ForwardBatch:
        i32 = dict(dtype=torch.int32, device=DEV)
        pos = torch.cat([torch.arange(p, p + n) for p, n in zip(pre, new)]).to(DEV)
        row_of = torch.cat([torch.full((n,), i) for i, n in enumerate(new)]).to(DEV)
        out_slots = table[rows.long()[row_of], pos]
        cu = torch.tensor([0] + torch.tensor(new).cumsum(0).tolist(), **i32)
        lens = [p + n for p, n in zip(pre, new)]
        return ForwardBatch(
            mode, torch.zeros(sum(new), dtype=torch.int64, device=DEV), pos, out_slots, rows,
            torch.tensor(lens, **i32), torch.tensor(pre, **i32), cu, (cu[1:] - 1).long(), table,
            lens, pre, max(lens), max(new))

    for b in (batch("extend", prefix, ext), batch("decode", seq, [1, 1])):
        t = b.num_tokens
        q = torch.randn(t, hq, d, generator=gen).to(DEV, torch.float16)
        k = torch.randn(t, hkv, d, generator=gen).to(DEV, torch.float16)
        v = torch.randn(t, hkv, d, generator=gen).to(DEV, torch.float16)
        for layer in range(layers):
            want = backends[0].forward(q, k, v, layer, b)
            got = backends[1].forward(q, k, v, layer, b)
            torch.testing.assert_close(got.float(), want.float(), rtol=2e-3, atol=2e-3)
    assert torch.equal(pools[0]._k, pools[1]._k) and torch.equal(pools[0]._v, pools[1]._v)


@needs_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_tile_map_launch_matches_reference(page_size: int, dtype: torch.dtype) -> None:
    """The CUDA-graph launch: grid sized by a bucket's capacity, tiles read on the device.
    Decode-like 1-token rows, a chunk with a prefix, and padding: 2 empty padding requests
    and 5 padding tokens past the last request; those rows stay as they were (NaN here)."""
    prefix, ext = [30, 0, 41, 3, 0, 0], [1, 70, 1, 33, 0, 0]
    c = make_case(prefix, ext, 4, 2, 64, dtype, page_size, seed=5 + page_size)
    attention_rule.poison_unused_slots(c, [p + e for p, e in zip(prefix, ext)])
    real = sum(ext)
    q = torch.randn(real + 5, 4, 64, generator=torch.Generator().manual_seed(3)).to(DEV, dtype)
    q[:real] = c["q"]
    block_m = ops.extend_block_m(64, dtype, torch.device(DEV))
    cap = ops.extend_tile_capacity(real + 5, len(ext), block_m)
    flat = ops.extend_tile_map(prefix, ext, block_m, cap)
    tiles = torch.tensor(flat, dtype=torch.int32, device=DEV).view(-1, 2)
    assert tiles.shape[0] == cap and (tiles[:, 0] >= 0).sum() == sum(-(-e // block_m) for e in ext)
    out = torch.full_like(q, float("nan"))
    ops.extend_attention(**{**c, "q": q, "max_extend_len": 0}, out=out, tiles=tiles)
    assert torch.isnan(out[real:]).all()
    assert_fa3_rule(out[:real], c)


def test_tile_map_order_and_capacity() -> None:
    # Requests (prefix, new): tiles of 4 rows; the tile seeing most keys goes first.
    flat = K.tile_map([0, 10, 2], [9, 1, 0], 4, capacity=6)
    pairs = list(zip(flat[::2], flat[1::2]))
    assert pairs[:4] == [(1, 0), (0, 8), (0, 4), (0, 0)] and pairs[4:] == [(-1, 0), (-1, 0)]
    for t, b in [(1, 1), (7, 3), (300, 5), (8192, 256)]:  # the bound holds for any split of T
        for lens in ([t - b + 1] + [1] * (b - 1), [t // b] * (b - 1) + [t - (t // b) * (b - 1)]):
            assert len(K.tile_map([0] * b, lens, 128)) // 2 <= K.tile_capacity(t, b, 128)
    with pytest.raises(ValueError, match="capacity"):
        K.tile_map([0], [9], 4, capacity=2)

