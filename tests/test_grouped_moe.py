"""The grouped 4-bit MoE kernel (ops/gemm/grouped_moe.py, csrc/skinny_moe.cuh
skinny_moe_grouped_kernel) against an independent fp64 torch computation of the same routed experts
from their dequantisation (kernels/quant4.py's references), on fresh random data. Experts a routing
leaves unused are poisoned (test_skinny_moe._case_w4; most cases here use every expert, and the fp64
comparison catches a wrong one) and the launches write into NaN-filled buffers with guard rows, so a
pair row never written, or a padding row written, shows. CPU: the path choice rules, the wrapper's
and the launcher's argument checks."""

from __future__ import annotations

import itertools

import pytest
import torch
from test_skinny_moe import _case_w4, _check_finite, _reference, _shared

from minisgl.kernels import w4a16_gemm as W4
from minisgl.kernels.fused_moe import ExpertAct
from minisgl.kernels.moe_align import align, align_reference
from minisgl.kernels.quant4 import dequant_int4_reference, dequant_mxfp4_reference
from minisgl.ops._backend import compiled
from minisgl.ops.gemm import grouped_moe, skinny_moe
from minisgl.ops.gemm import w4 as w4_ops
from minisgl.ops.gemm.skinny import SkinnyConfig, tile_shapes

gpu = pytest.mark.gpu
GPT_OSS = ExpertAct("gpt_oss", 1.702, 7.0)


def _pair_rows(x, r13, r2, weights, ids, b13, b2, act, dtype):
    """Per (token, slot) pair, in pair order t * top_k + j: the intermediate (rounded to `dtype`, as
    the kernel stores it) and the weighted down row, in fp64."""
    t, k = ids.shape
    inter = r2.shape[2]
    e = ids.reshape(-1).long()
    h = torch.einsum("ph,pnh->pn", x.double().repeat_interleave(k, 0), r13[e].double())
    if b13 is not None:
        h = h + b13[e].double()
    gate, up = h[:, :inter], h[:, inter:]
    if act is not None:
        g = gate.clamp(max=act.limit)
        a = g * torch.sigmoid(act.alpha * g) * (up.clamp(-act.limit, act.limit) + 1)
    else:
        a = gate * torch.sigmoid(gate) * up
    mid = a.to(dtype).double()
    y = torch.einsum("pi,phi->ph", mid, r2[e].double())
    if b2 is not None:
        y = y + b2[e].double()
    return mid, y * weights.reshape(-1, 1).double()


def _close(out, ref, what, rel=2e-2):
    assert out.isfinite().all(), f"{what}: NaN / inf (a wrong expert read, or a row never written)"
    err = (out.double() - ref).abs().max().item()
    tol = rel * ref.abs().max().item()
    assert err <= tol, f"{what}: max error {err:.4g} > {tol:.4g}"


def _guarded(rows: int, cols: int, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A NaN-filled [rows, cols] output inside a buffer with 16 guard rows after it (a padding slot's
    pair number is `rows`: a kernel that wrote it would land there): (the output view, the buffer)."""
    buf = torch.full((rows + 16, cols), float("nan"), dtype=x.dtype, device=x.device)
    return buf[:rows], buf


def _run_launches(case, act, config):
    """align + up + down into NaN-filled buffers, each checked against the pair rows; the rows past
    the pairs' stay unwritten."""
    x, w13, w2, weights, ids, b13, b2, quant, r13, r2 = case
    tokens, top_k = ids.shape
    mid_ref, y_ref = _pair_rows(x, r13, r2, weights, ids, b13, b2, act, x.dtype)
    sorted_ids, blocks = align(ids, w13.shape[0], config.block_m)
    mid, mid_buf = _guarded(tokens * top_k, r2.shape[2], x)
    grouped_moe.up(x, w13, b13, sorted_ids, blocks, top_k, config.block_m, act, config.up, quant, out=mid)
    _close(mid, mid_ref, "up")
    y, y_buf = _guarded(tokens * top_k, x.shape[1], x)
    grouped_moe.down(mid_ref.to(x.dtype), w2, b2, sorted_ids, blocks, weights, top_k, config.block_m, config.down,
                     quant, out=y)
    _close(y, y_ref, "down")
    assert mid_buf[tokens * top_k:].isnan().all() and y_buf[tokens * top_k:].isnan().all(), "a padding row written"


@gpu
@pytest.mark.parametrize("fmt,group", [(W4.INT4, 128), (W4.INT4, 32), (W4.MXFP4, 32)])
@pytest.mark.parametrize("tokens,top_k,experts", [(3, 4, 16), (24, 8, 64), (40, 2, 4), (40, 1, 2)])
@pytest.mark.parametrize("block_m", grouped_moe.BLOCK_SIZES)
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_launches_match_the_pair_rows(fmt: int, group: int, tokens: int, top_k: int, experts: int, block_m: int,
                                      gpt_oss: bool) -> None:
    """Blocks of one pair to several blocks an expert (40 tokens on 2 experts: ~20 pairs each, past
    one block of 16); H = 384, I = 192 (224 at group 32) end mid-tile."""
    inter = 192 + 32 * (group == 32)
    case = _case_w4(fmt, tokens, top_k, experts, 384, inter, group, gpt_oss, seed=tokens + top_k + block_m)
    cfg = SkinnyConfig(0, 4, 1)
    _run_launches(case, GPT_OSS if gpt_oss else None, grouped_moe.GroupedConfig(block_m, cfg, cfg))


@gpu
@pytest.mark.parametrize("fmt", [W4.INT4, W4.MXFP4])
@pytest.mark.parametrize("block_m,up,down", [(16, "t0w1s1", "t0w1s1"), (16, "t1w4s3", "t1w8s2"),
                                             (16, "t2w2s1", "t2w4s4"), (8, "t0w8s2", "t1w2s1"),
                                             (8, "t3w4s1", "t2w4s3"), (8, "t3w1s2", "t3w2s1")])
def test_every_tile_warp_and_split(fmt: int, block_m: int, up: str, down: str) -> None:
    """H, I multiples of 32 (the 4-bit loads) but not of 128 (a warp group's K); split-K's counters
    shared by every block of the launch."""
    case = _case_w4(fmt, 20, 4, 8, 736, 672, 32, True, seed=13)
    config = grouped_moe.GroupedConfig(block_m, SkinnyConfig.parse(up), SkinnyConfig.parse(down))
    _run_launches(case, GPT_OSS, config)


@gpu
@pytest.mark.parametrize("fmt", [W4.INT4, W4.MXFP4])
def test_experts_sum_the_slots(fmt: int) -> None:
    """experts() (align, up, down, the top-k sum) against the token rows of test_skinny_moe's reference,
    at the default configuration of each block size; a second call gives the same bits."""
    x, w13, w2, weights, ids, b13, b2, quant, r13, r2 = _case_w4(fmt, 33, 4, 32, 384, 192, 32, True, seed=3)
    ref = _reference(x, r13, r2, weights, ids, b13, b2, GPT_OSS, torch.bfloat16)
    for block_m in grouped_moe.BLOCK_SIZES:
        cfg = SkinnyConfig(0, 4, 1)
        config = grouped_moe.GroupedConfig(block_m, cfg, cfg)
        out = grouped_moe.experts(x, w13, w2, weights, ids, quant, b13, b2, GPT_OSS, config)
        _check_finite(out, ref)
        assert torch.equal(grouped_moe.experts(x, w13, w2, weights, ids, quant, b13, b2, GPT_OSS, config), out)


@gpu
def test_cuda_graph_replays_new_routing() -> None:
    """The alignment and the expert ids are read on the device: a captured layer follows each
    replay's routing, and a split-K launch's counters reset themselves between replays."""
    x, w13, w2, weights, ids, b13, b2, quant, r13, r2 = _case_w4(W4.MXFP4, 12, 4, 16, 256, 128, 32, False, seed=5)
    quant.s13.clamp_(max=122)  # every expert live: the routing changes after the draw
    quant.s2.clamp_(max=122)
    r13, r2 = dequant_mxfp4_reference(w13, quant.s13), dequant_mxfp4_reference(w2, quant.s2)
    config = grouped_moe.GroupedConfig(16, SkinnyConfig(0, 4, 2), SkinnyConfig(1, 4, 1))
    grouped_moe.experts(x, w13, w2, weights, ids, quant, config=config)  # counters allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = grouped_moe.experts(x, w13, w2, weights, ids, quant, config=config)
    g = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(3):
        ids.copy_(torch.stack([torch.randperm(16, generator=g, device="cuda")[:4] for _ in range(12)]))
        weights.copy_(torch.rand(12, 4, generator=g, device="cuda"))
        x.copy_(torch.randn(12, 256, generator=g, device="cuda"))
        graph.replay()
        _check_finite(out, _reference(x, r13, r2, weights, ids, None, None, None, torch.bfloat16))


@gpu
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
@pytest.mark.parametrize("with_shared", [False, True])
def test_fused_moe_w4_takes_the_grouped_path_in_its_range(monkeypatch, fmt: str, with_shared: bool) -> None:
    """ops.gemm.w4.fused_moe_w4: the per-pair kernel up to skinny_moe.MAX_TOKENS, this one past it up
    to grouped_moe.MAX_TOKENS, the Triton fused MoE beyond; each against the dequantised reference,
    with and without a shared expert's gated row (Qwen3.5-MoE's) in the sum."""
    calls = []
    real = grouped_moe.experts
    monkeypatch.setattr(grouped_moe, "experts", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    monkeypatch.setattr(grouped_moe, "MAX_TOKENS", 9)
    f = W4.INT4 if fmt == "int4" else W4.MXFP4
    for t in (skinny_moe.MAX_TOKENS, skinny_moe.MAX_TOKENS + 1, 9, 10):
        x, w13, w2, weights, ids, b13, b2, q, r13, r2 = _case_w4(f, t, 4, 16, 256, 128, 128 if f == W4.INT4 else 32,
                                                                  True, seed=t)
        if f == W4.INT4:  # every expert live (the Triton path may read any expert's tiles)
            q.s13.nan_to_num_(0.01)
            q.s2.nan_to_num_(0.01)
            r13, r2 = dequant_int4_reference(w13, q.s13, q.z13), dequant_int4_reference(w2, q.s2, q.z2)
        else:
            q.s13.clamp_(max=122)
            q.s2.clamp_(max=122)
            r13, r2 = dequant_mxfp4_reference(w13, q.s13), dequant_mxfp4_reference(w2, q.s2)
        extra, added = _shared(t, 256, x.dtype, seed=t) if with_shared else ({}, 0)
        out = w4_ops.fused_moe_w4(x, fmt, w13, q.s13, q.z13, w2, q.s2, q.z2, weights, ids, b13=b13, b2=b2,
                                  act=GPT_OSS, **extra)
        _check_finite(out, _reference(x, r13, r2, weights, ids, b13, b2, GPT_OSS, torch.bfloat16) + added)
    assert calls == [skinny_moe.MAX_TOKENS + 1, 9]


def test_launches_refuse_mismatched_arguments() -> None:
    """The wrapper's checks, before any CUDA call (CPU tensors): a block size the kernel is not built
    for, an alignment made for another block size, an output of the wrong shape, a tile too
    narrow for the block."""
    if not tile_shapes("int4"):
        pytest.skip("minisgl._C was built without CUDA")
    tokens, top_k, experts, h, inter = 8, 2, 8, 256, 128
    x = torch.randn(tokens, h, dtype=torch.bfloat16)
    w13 = torch.zeros(experts, 2 * inter, h // 8, dtype=torch.int32)
    s = torch.ones(experts, 2 * inter, h // 128, dtype=torch.bfloat16)
    quant = skinny_moe.Quant4(W4.INT4, s, s, s, s)
    ids = torch.randint(0, experts, (tokens, top_k), dtype=torch.int32)
    cfg = SkinnyConfig(0, 4, 1)

    def up(block_m, aligned_for, out=None, w=w13, config=cfg):
        sorted_ids, blocks = align_reference(ids, experts, aligned_for)
        grouped_moe.up(x, w, None, sorted_ids, blocks, top_k, block_m, None, config, quant, out=out)

    with pytest.raises(ValueError, match="block_m must be one of"):  # no 32-pair blocks
        up(32, 32)
    with pytest.raises(ValueError, match="sorted_ids has"):
        up(8, 16)
    with pytest.raises(ValueError, match="rows an expert"):  # w2's rows where w13's (gate | up) belong
        up(8, 8, out=torch.empty(tokens * top_k, inter, dtype=torch.bfloat16),
           w=torch.zeros(experts, inter, h // 8, dtype=torch.int32))
    with pytest.raises(ValueError, match="out must be"):
        up(8, 8, out=torch.empty(tokens, inter, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="at most 8 rows"):  # tile 3 holds 1 x tile (8 pairs)
        up(16, 16, config=SkinnyConfig(3, 4, 1))


_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would run the good calls on fake pointers")


def _launcher():
    ext = compiled()
    if ext is None or not ext.has_cuda or not hasattr(ext, "skinny_moe_grouped"):
        pytest.skip("minisgl._C was built without CUDA")
    p = 1 << 20  # a 16-byte aligned address, never dereferenced (no launch happens)
    k, n = 256, 64

    def call(fmt=1, block_m=8, cfg=1, down=False, act=0, weights=p, sorted_ids=p, blocks=p, tokens=4, top_k=2,
             x_stride=k, dtype=1):
        w_stride = k // 8 if fmt == 1 else k // 2
        q_group = 128 if fmt == 1 else 32
        rows = n if down else 2 * n
        ext.skinny_moe_grouped(p, p, 0, sorted_ids, blocks, weights, p, 0, 0, 0, 0, tokens, top_k, 3, block_m, n, k,
                               x_stride, w_stride, n, rows * w_stride, 0, down, act, 1.702, 7.0, fmt, p,
                               p if fmt == 1 else 0, k // q_group, q_group, rows * (k // q_group), dtype, cfg, 2, 1,
                               False, 0)
    return call


@_NO_GPU
def test_the_launcher_checks_its_arguments() -> None:
    """csrc/skinny_moe.cu skinny_moe_grouped through the bindings on a machine without a GPU: a bad
    argument is refused before any CUDA call ('invalid argument'); the good ones pass every check
    and fail only at the missing device."""
    call = _launcher()
    bad = [
        lambda: call(block_m=32),  # not built
        lambda: call(block_m=16, cfg=3),  # tile 3 holds one x tile
        lambda: call(fmt=0),  # 4-bit experts only
        lambda: call(down=True, act=1),  # the activation is the up projection's
        lambda: call(down=True, weights=0),  # the routing weights are the down projection's
        lambda: call(sorted_ids=0),
        lambda: call(blocks=0),
        lambda: call(x_stride=1 << 29),  # 4 tokens' rows of x past 2^31 elements
        lambda: call(down=True, x_stride=1 << 28),  # the intermediate's 8 pair rows past 2^31
    ]
    for i, bad_call in enumerate(bad):
        with pytest.raises(RuntimeError, match="invalid argument"):
            bad_call()
            pytest.fail(f"bad call {i} was not refused")
    for good in (call, lambda: call(x_stride=(1 << 29) - 8), lambda: call(x_stride=1 << 28),
                 lambda: call(down=True, x_stride=(1 << 28) - 8)):
        with pytest.raises(RuntimeError) as e:
            good()
        assert "invalid argument" not in str(e.value), str(e.value)


@_NO_GPU
def test_every_block_and_tile_has_its_kernels() -> None:
    """Every 4-bit tile at each block size its x tiles hold (8 pairs: all; 16: those of max m >= 16), up
    and down, both formats and 16-bit dtypes, finds its kernel (the calls fail only at the missing
    device); a tile one block size too narrow is refused."""
    call = _launcher()
    for cfg, (_, _, max_m) in enumerate(tile_shapes("int4")):
        for fmt, dtype, down, block_m in itertools.product((1, 2), (0, 1), (False, True), grouped_moe.BLOCK_SIZES):
            if block_m > max_m:
                with pytest.raises(RuntimeError, match="invalid argument"):
                    call(fmt=fmt, block_m=block_m, cfg=cfg, down=down, dtype=dtype)
                continue
            with pytest.raises(RuntimeError) as e:
                call(fmt=fmt, block_m=block_m, cfg=cfg, down=down, dtype=dtype)
            assert "invalid argument" not in str(e.value), (cfg, fmt, dtype, down, block_m)


def test_configs_pick_the_block_by_pairs_per_expert() -> None:
    """Blocks of 16 pairs once the tokens give an expert more than 8 pairs on average."""
    assert grouped_moe.configs(32, 8, 128).block_m == 8  # Qwen3-30B-A3B at 32 tokens: 2 an expert
    assert grouped_moe.configs(128, 8, 128).block_m == 8  # 8 an expert
    assert grouped_moe.configs(129, 8, 128).block_m == 16
    assert grouped_moe.configs(64, 4, 32).block_m == 8  # GPT-OSS-20B at 64 tokens: 8
    assert grouped_moe.configs(65, 4, 32).block_m == 16


def test_env_setting_is_parsed_or_refused() -> None:
    assert grouped_moe._parse("") == 256
    assert grouped_moe._parse("0") == 0
    assert grouped_moe._parse(" 64 ") == 64
    with pytest.raises(ValueError, match="MINISGL_GROUPED_MOE"):
        grouped_moe._parse("many")


def test_cpu_tensors_never_take_the_kernel() -> None:
    x = torch.randn(8, 64, dtype=torch.bfloat16)
    w13, w2 = torch.zeros(4, 64, 8, dtype=torch.int32), torch.zeros(4, 64, 4, dtype=torch.int32)
    s = torch.ones(4, 64, 1, dtype=torch.bfloat16)
    quant = skinny_moe.Quant4(W4.INT4, s, s, s, s)
    assert not grouped_moe.fits(x, w13, w2, 2, None, quant)
