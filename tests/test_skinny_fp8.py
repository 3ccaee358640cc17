"""Weight-only FP8 skinny GEMM: the CUDA kernel against an fp64 reference on fresh random e4m3
weights (every finite byte pattern, denormals included) with per-channel and 128 x 128 block
scales: every tile configuration at M = 1, 3, 7, 16, 32, K not a multiple of the tile, odd N,
the SiLU epilogue, bias, strided x, extreme scales, CUDA-graph replay and the measured
dispatch; on the CPU (CI) the torch reference against an independent fp64 computation from
the checkpoint's compact block scales, and the op's checks."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from minisgl.ops.gemm.fp8 import FP8, expand_block_scale
from minisgl.ops.gemm.reference import fp8_linear_reference
from minisgl.ops.gemm.skinny import FP8_FORMAT, SkinnyConfig, skinny_gemm_fp8
from minisgl.ops.gemm.table import GemmShape, table_dtype

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    return pytest.mark.gpu(_needs_cuda(fn))


def make(m: int, n: int, k: int, dtype: torch.dtype, device: str, block: bool, seed: int = 0,
         scale_range: tuple[float, float] = (0.5, 2.0), bias: bool = False, pad: int = 0) -> dict:
    """x [m, k] (a column slice when pad > 0); W e4m3 [n, k] from uniformly random bytes (NaN
    patterns 0x7f / 0xff replaced), so every normal and denormal code appears; compact scales
    (block: [ceil(n/128), ceil(k/128)], else [n, 1]) log-uniform in scale_range / (16 sqrt(k))
    (|W| averages ~30); `scale` is the layer layout (block scales expanded to rows)."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + pad, generator=g).to(dtype).to(device)[:, :k]
    raw = torch.randint(0, 256, (n, k), generator=g, dtype=torch.int32)
    raw = torch.where((raw & 0x7F) == 0x7F, raw - 1, raw).to(torch.uint8)
    w = raw.view(FP8)
    lo, hi = (math.log(v / (16 * math.sqrt(k))) for v in scale_range)
    shape = (-(-n // 128), -(-k // 128)) if block else (n, 1)
    compact = torch.empty(shape).uniform_(lo, hi, generator=g).exp()
    scale = expand_block_scale(compact, n) if block else compact
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return dict(x=x, w=w.to(device), compact=compact, scale=scale.contiguous().to(device), b=b, block=block)


def gold(c: dict, silu: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """fp64 (y, magnitude bound): dequantized from the compact scales by index, not by ops.fp8."""
    x, w, compact = c["x"].double().cpu(), c["w"].double().cpu(), c["compact"].double()
    n, k = w.shape
    s = compact[torch.arange(n)[:, None] // 128, torch.arange(k)[None, :] // 128] if c["block"] else compact
    wd = w * s
    y, mag = x @ wd.t(), x.abs() @ wd.abs().t()
    if c["b"] is not None:
        y, mag = y + c["b"].double().cpu(), mag + c["b"].double().cpu().abs()
    if silu:
        (g, u), (mg, mu) = y.chunk(2, dim=-1), mag.chunk(2, dim=-1)
        y, mag = F.silu(g) * u, 1.1 * mg * u.abs() + F.silu(g).abs() * mu
    return y, mag


def assert_rule(out: torch.Tensor, c: dict, silu: bool, what: object = "") -> None:
    """Per element: one output rounding (2 ulp of slack) + fp32 accumulation (2^-14 of the
    magnitude sum |x| |W|): a wrong scale, block or element is off by ~|x||W| / sqrt(K) or more."""
    ref, mag = gold(c, silu)
    assert torch.isfinite(out).all(), f"output has unwritten (NaN) entries {what}"
    rtol = 2.0**-7 if out.dtype == torch.bfloat16 else 2.0**-10
    err = (out.double().cpu() - ref).abs()
    bound = rtol * ref.abs() + 2.0**-14 * mag + 1e-30
    worst = (err / bound).max().item()
    assert worst <= 1.0, f"error {worst:.2f} x the bound (max abs error {err.max().item():.3g}) {what}"


def configs(m: int) -> list[SkinnyConfig]:
    from minisgl.ops.gemm.skinny import tile_shapes

    return [SkinnyConfig(t, w, s) for t, (_, _, max_m) in enumerate(tile_shapes(FP8_FORMAT)) if m <= max_m
            for w in (1, 4, 8) for s in (1, 3, 8)]


# ---- GPU ----


@gpu
@pytest.mark.parametrize("m", [1, 3, 7, 16, 32])
@pytest.mark.parametrize("block", [False, True])
def test_every_config(m: int, block: bool) -> None:
    c = make(m, 197, 4112, torch.bfloat16, "cuda", block, seed=m)  # odd N; K = 32 * 128 + 16
    for cfg in configs(m):
        out = torch.full((m, 197), float("nan"), dtype=torch.bfloat16, device="cuda")
        skinny_gemm_fp8(c["x"], c["w"], c["scale"], 128, out=out, config=cfg)
        assert_rule(out, c, False, cfg)


@gpu
@pytest.mark.parametrize("m", [1, 7, 32])
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_silu_bias_strided_x(m: int, block: bool, dtype: torch.dtype) -> None:
    c = make(m, 2 * 300, 400, dtype, "cuda", block, seed=100 + m, bias=True, pad=24)
    for cfg in configs(m)[::3]:
        out = skinny_gemm_fp8(c["x"], c["w"], c["scale"], 128, c["b"], silu=True, config=cfg)
        assert_rule(out, c, True, cfg)
        out = skinny_gemm_fp8(c["x"], c["w"], c["scale"], 128, c["b"], config=cfg)
        assert_rule(out, c, False, cfg)


@gpu
@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("scales", [(1e-8, 1e-6), (1e3, 1e5), (1e-6, 1e4)])
def test_extreme_scales_and_edge_blocks(block: bool, scales: tuple[float, float]) -> None:
    # N = 300: the last 128-row block is partial; K = 400: so is the last 128-K block.
    c = make(16, 300, 400, torch.bfloat16, "cuda", block, seed=7, scale_range=scales)
    for cfg in configs(16):
        assert_rule(skinny_gemm_fp8(c["x"], c["w"], c["scale"], 128, config=cfg), c, False, cfg)


@gpu
def test_cuda_graph_replay_with_new_inputs() -> None:
    c = make(3, 1000, 2048, torch.bfloat16, "cuda", True, seed=3)
    cfg = SkinnyConfig(0, 4, 4)  # split-K: the counters must reset for every replay
    x = c["x"].clone()
    out = torch.empty(3, 1000, dtype=torch.bfloat16, device="cuda")
    skinny_gemm_fp8(x, c["w"], c["scale"], 128, out=out, config=cfg)  # allocates the counters
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        skinny_gemm_fp8(x, c["w"], c["scale"], 128, out=out, config=cfg)
    for seed in range(3):
        x.copy_(torch.randn(3, 2048, generator=torch.Generator().manual_seed(seed)).to(x))
        out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert_rule(out, dict(c, x=x), False)


@gpu
def test_dispatch_follows_the_measured_table() -> None:
    """tune_gemms measures and installs a table; the FP8 linear then gives our kernel's result
    where the table chose ours and the FP8 GEMM's otherwise, both within the rule."""
    from minisgl.ops.gemm.dispatch import _tables, linear
    from minisgl.ops.gemm.table import GemmCall
    from minisgl.ops.gemm.tuning import tune_gemms

    c = make(1, 1024, 1024, torch.bfloat16, "cuda", False, seed=5)
    table = tune_gemms([GemmCall(c["w"], False, FP8_FORMAT, c["scale"], 1024)], torch.device("cuda"), [1, 4],
                       torch.bfloat16)
    assert table is not None and table.has(GemmShape("bfloat16-fp8chan", 1024, 1024, False), 4)
    try:
        for m in (1, 4):
            cm = dict(c, x=torch.randn(m, 1024, device="cuda").to(torch.bfloat16))
            y = linear(cm["x"], c["w"], fmt=FP8_FORMAT, scale=c["scale"], block_k=1024)
            if table.lookup(GemmShape("bfloat16-fp8chan", 1024, 1024, False), m) is not None:
                assert_rule(y, cm, False)
            else:  # activation quantization: a looser, relative check
                ref, _ = gold(cm, False)
                assert (y.double().cpu() - ref).norm() <= 0.05 * ref.norm()
    finally:
        _tables.clear()


# ---- CPU ----


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("silu", [False, True])
def test_reference_matches_fp64_from_compact_scales(block: bool, silu: bool) -> None:
    """The reference the GPU path is held to (and the CPU runs) against a dequantization done
    here from the compact scales: N = 260 and K = 272 leave partial blocks on both edges."""
    c = make(3, 260, 272, torch.float32, "cpu", block, seed=11, bias=True)
    out = fp8_linear_reference(c["x"], c["w"], c["scale"], 128 if block else 272, c["b"], silu)
    ref, mag = gold(c, silu)
    assert ((out.double() - ref).abs() <= 1e-5 * mag + 1e-30).all()
    assert torch.equal(skinny_gemm_fp8(c["x"], c["w"], c["scale"], 128, c["b"], silu=silu), out)


def test_op_checks() -> None:
    c = make(2, 64, 256, torch.float32, "cpu", True)
    with pytest.raises(ValueError, match="scale must be"):
        skinny_gemm_fp8(c["x"], c["w"], c["scale"][:, :1].repeat(1, 3), 128)
    with pytest.raises(ValueError, match="at most 32 rows"):
        skinny_gemm_fp8(torch.randn(33, 256), c["w"], c["scale"], 128)
    with pytest.raises(ValueError, match="weight"):
        skinny_gemm_fp8(c["x"], c["w"].float(), c["scale"], 128)
    shape = GemmShape(table_dtype(torch.bfloat16, FP8_FORMAT, True), 6, 8, True)
    assert GemmShape.parse_key(shape.key(4))[0].dtype == "bfloat16-fp8block"
