"""4-bit weight kernels (the skinny CUDA template's Int4W / Mxfp4W loaders at M <= 32,
kernels/w4a16_gemm.py, the 4-bit experts of kernels/fused_moe.py, all through ops/gemm/w4.py)
against the dequantise-then-matmul reference on fresh random data. The weights
are built here from random nibbles, scales and zeros and dequantised here (not through
kernels/quant4.py), then packed: the references' unpacking is under test too. Every group size,
odd N and K not a multiple of the tile, M = 1 .. 4096 (GPU), bias and SiLU-and-mul on and off."""

from __future__ import annotations

import pytest
import torch

from minisgl import env
from minisgl.kernels import fused_moe as G
from minisgl.kernels.quant4 import E2M1_VALUES, pack_int4, unpack_int4, unpack_nibbles
from minisgl.ops._backend import compiled
from minisgl.ops.gemm import w4

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_int4(n: int, k: int, group: int, dtype: torch.dtype, gen: torch.Generator, sym: bool = False):
    """(qweight, scales, zeros, W fp32 [n, k]) with W = (q - z) * s computed from the unpacked values."""
    q = torch.randint(0, 16, (n, k), generator=gen)
    s = (torch.rand(n, k // group, generator=gen) * 0.02 + 0.005).to(dtype)
    z = torch.full((n, k // group), 8.0) if sym else torch.randint(0, 16, (n, k // group), generator=gen).float()
    z = z.to(dtype)
    w = (q.float() - z.float().repeat_interleave(group, 1)) * s.float().repeat_interleave(group, 1)
    return pack_int4(q).to(DEV), s.to(DEV), z.to(DEV), w.to(DEV)


def make_mxfp4(n: int, k: int, gen: torch.Generator, exps: tuple[int, int] = (120, 126)):
    """(blocks, scales, W fp32 [n, k]); byte j holds columns 2j (low nibble) and 2j + 1; e8m0
    exponents drawn from [exps[0], exps[1])."""
    nib = torch.randint(0, 16, (n, k), generator=gen)
    e = torch.randint(*exps, (n, k // 32), generator=gen)
    lut = torch.tensor(E2M1_VALUES)
    w = lut[nib] * torch.exp2(e.float() - 127).repeat_interleave(32, 1)
    blocks = (nib[:, 0::2] | (nib[:, 1::2] << 4)).to(torch.uint8)
    return blocks.to(DEV), e.to(torch.uint8).to(DEV), w.to(DEV)


def reference(x: torch.Tensor, w: torch.Tensor, bias: torch.Tensor | None, silu: bool) -> torch.Tensor:
    y = x.double() @ w.double().t()
    if bias is not None:
        y = y + bias.double()
    if silu:
        n = y.shape[1] // 2
        y = torch.nn.functional.silu(y[:, :n]) * y[:, n:]
    return y


def assert_close(y: torch.Tensor, ref: torch.Tensor) -> None:
    assert torch.isfinite(y).all()
    # fp32: accumulation order only; 16-bit: the output rounding plus the dequantised weight's rounding.
    tol = 1e-4 if y.dtype == torch.float32 else 2e-2
    scale = ref.abs().max().item() + 1e-6
    err = (y.double() - ref).abs().max().item()
    assert err <= tol * scale, f"max error {err} vs scale {scale}"


def _run_int4(m: int, n: int, k: int, group: int, dtype: torch.dtype, bias: bool, silu: bool, sym: bool = False):
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k + group)
    qw, s, z, w = make_int4(n, k, group, dtype, gen, sym)
    x = torch.randn(m, k, generator=gen).to(DEV, dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(DEV, dtype) if bias else None
    y = w4.int4_linear(x, qw, s, z, b, silu_and_mul=silu)
    assert y.shape == (m, n // 2 if silu else n) and y.dtype == dtype
    assert_close(y, reference(x, w, b, silu))


def _run_mxfp4(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, silu: bool,
               exps: tuple[int, int] = (120, 126)):
    gen = torch.Generator().manual_seed(m * 7919 + n * 31 + k)
    blocks, s, w = make_mxfp4(n, k, gen, exps)
    # tiny scales: x times 2^(120 - the top exponent), so y stays far above assert_close's 1e-6 floor
    x = (torch.randn(m, k, generator=gen) * 2.0 ** max(0, 120 - exps[1])).to(DEV, dtype)
    b = (torch.randn(n, generator=gen) * 0.5).to(DEV, dtype) if bias else None
    y = w4.mxfp4_linear(x, blocks, s, b, silu_and_mul=silu)
    assert y.shape == (m, n // 2 if silu else n) and y.dtype == dtype
    assert_close(y, reference(x, w, b, silu))


# ---- the CPU reference path (no Triton) -----------------------------------------------------


@pytest.mark.skipif(env.TRITON_INTERPRET, reason="the torch reference path runs without the interpreter")
@pytest.mark.parametrize("group", [32, 128, 192])
def test_int4_cpu_reference(group: int) -> None:
    if DEV != "cpu":
        pytest.skip("the CPU path")
    _run_int4(3, 22, 192 if group != 128 else 256, group, torch.float32, bias=True, silu=True)
    _run_int4(5, 21, 384, group if group != 192 else 384, torch.float32, bias=False, silu=False, sym=True)


@pytest.mark.skipif(env.TRITON_INTERPRET, reason="the torch reference path runs without the interpreter")
def test_int4_layout_pairs_columns_in_nibbles_j_and_j_plus_4() -> None:
    """The INT4 layout (kernels/quant4.py NIBBLE_OF): columns 2j and 2j + 1 of a word in nibbles j and
    j + 4, which the skinny loader's one-shift pairs rely on; checkpoints' words unpack lowest first."""
    q = torch.tensor([[1, 2, 3, 4, 5, 6, 7, 8]])
    word = pack_int4(q)[0, 0].item() & 0xFFFFFFFF
    assert [(word >> (4 * i)) & 0xF for i in range(8)] == [1, 3, 5, 7, 2, 4, 6, 8]
    assert torch.equal(unpack_int4(pack_int4(q)), q)
    checkpoint_word = torch.tensor([[0x87654321]], dtype=torch.int64).to(torch.int32)
    assert unpack_nibbles(checkpoint_word).tolist() == [[1, 2, 3, 4, 5, 6, 7, 8]]


def test_mxfp4_cpu_reference() -> None:
    if DEV != "cpu":
        pytest.skip("the CPU path")
    _run_mxfp4(4, 26, 96, torch.float32, bias=True, silu=True)
    _run_mxfp4(1, 13, 64, torch.float32, bias=False, silu=False)


# ---- Triton (interpreted on the CPU: small shapes, fp32 / fp16) -------------------------------


@pytest.mark.triton
@needs_triton
# group 12: a word's 8 columns straddle two groups (the loader's per-column scale path)
@pytest.mark.parametrize("m,n,k,group", [(1, 21, 160, 32), (5, 70, 192, 64), (17, 33, 256, 128), (3, 40, 72, 72),
                                         (4, 18, 48, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias,silu", [(False, False), (True, False), (True, True)])
def test_int4_triton(m: int, n: int, k: int, group: int, dtype: torch.dtype, bias: bool, silu: bool) -> None:
    if silu and n % 2:
        n += 1
    _run_int4(m, n, k, group, dtype, bias, silu, sym=group == 64)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("m,n,k", [(1, 21, 96), (6, 66, 160), (19, 34, 256)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("bias,silu", [(False, False), (True, True)])
def test_mxfp4_triton(m: int, n: int, k: int, dtype: torch.dtype, bias: bool, silu: bool) -> None:
    if silu and n % 2:
        n += 1
    _run_mxfp4(m, n, k, dtype, bias, silu)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("exps", [(1, 12), (230, 242)])
def test_mxfp4_triton_scale_range(exps: tuple[int, int]) -> None:
    """The Triton loader's e2m1 (fp16 bits) times 2^(e8m0 - 127) over the scales' range: near fp32's
    smallest (0.5 a subnormal) and past 2^113, where a scale folded with the fp16 bits' 2^14 would
    overflow to inf though every weight is finite (fp32: fp16 outputs overflow there)."""
    _run_mxfp4(5, 34, 96, torch.float32, bias=False, silu=False, exps=exps)


@pytest.mark.triton
@needs_triton
@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning", "ignore:invalid value:RuntimeWarning")
def test_mxfp4_decode_is_exact_at_every_scale() -> None:
    """w4_dequant to fp32 (the Triton loader) against the reference bit for bit: every nibble under
    every e8m0 byte, 0 (2^-127, a subnormal) and 255 (inf; 0 x inf is NaN in both) included."""
    from minisgl.kernels import w4a16_gemm as K
    from minisgl.kernels.quant4 import dequant_mxfp4_reference

    nib = torch.arange(32) % 16  # a row's 32 columns: every nibble twice
    blocks = (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8).repeat(256, 1).to(DEV)
    scales = torch.arange(256, dtype=torch.uint8)[:, None].to(DEV)  # row r: e8m0 r
    out = K.w4_dequant(blocks, scales, None, K.MXFP4, torch.float32)
    torch.testing.assert_close(out, dequant_mxfp4_reference(blocks, scales), rtol=0, atol=0, equal_nan=True)


@pytest.mark.slow
@pytest.mark.skipif(env.TRITON_INTERPRET, reason="under TRITON_INTERPRET the kernels are not compilable")
@pytest.mark.parametrize("smem,arch", [(227 * 1024, 90), (99 * 1024, 86), (0, 86)])
def test_triton_gemm_tiles_fit_the_devices_shared_memory(smem: int, arch: int) -> None:
    """Every M's 16-bit tile of the Triton W4A16 GEMM, compiled on the CPU (gated, with a bias: its
    largest form), needs no more shared memory than the device gives a block: the H200-swept tiles
    only where that is >= 200 KB (sm_90), else tiles that fit the 99 KB of an sm_86/89 or sm_120 GPU."""
    from triton_compile import shared_bytes

    from minisgl.kernels import w4a16_gemm as W

    types = {"X": "*bf16", "W": "*i32", "S": "*bf16", "Z": "*bf16", "Bias": "*bf16", "Y": "*bf16"}
    tiles = {W._tile(m, torch.bfloat16, smem) for m in (1, 16, 17, 64, 65, 256, 257, 4096)}
    assert any(t[0] == 256 for t in tiles) == (smem >= 200 * 1024)  # the swept tiles only there
    for bm, bn, bk, warps, stages in sorted(tiles):
        consts = dict(FMT=W.INT4, GATED=True, HAS_BIAS=True, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, GROUP_M=8,
                      DOT_PREC="tf32", SPAN=W.scale_span(128, bk))
        shared = shared_bytes(W._w4_gemm_kernel, types, consts, warps, stages, arch)
        assert shared <= max(smem, 99 * 1024), ((bm, bn, bk, warps, stages), arch, shared)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("n,k,group", [(70, 192, 64), (33, 216, 72), (5, 128, 128), (9, 48, 12)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequant_kernel_gives_the_weight(n: int, k: int, group: int, dtype: torch.dtype) -> None:
    """The large-M path's decode: bit for bit the test's own (q - z) * s and e2m1 * 2^e, rounded
    once to the dtype (odd N; the default tile, and a 32-column one that K does not fill; a group of
    72, a group of 12 that splits a word)."""
    from minisgl.kernels import w4a16_gemm as W

    gen = torch.Generator().manual_seed(n * 31 + k)
    qw, s, z, w = make_int4(n, k, group, dtype, gen)
    for tile in (W.DEQUANT_TILE, (16, 32, 4)):  # the default's one K block, and several with a tail
        torch.testing.assert_close(W.w4_dequant(qw, s, z, W.INT4, dtype, tile=tile), w.to(dtype), atol=0, rtol=0)
    k32 = k - k % 32
    blocks, e, w = make_mxfp4(n, k32, gen)
    for tile in (W.DEQUANT_TILE, (16, 32, 4)):
        torch.testing.assert_close(W.w4_dequant(blocks, e, None, W.MXFP4, dtype, tile=tile), w.to(dtype), atol=0,
                                   rtol=0)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("budget", [256 << 20, 1])
def test_large_m_decodes_then_multiplies(dtype: torch.dtype, budget: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """From DEQUANT_MIN_M rows the linear decodes the weight and runs the 16-bit GEMM: the same
    results as the reference, with bias and SiLU-and-mul, INT4 and MXFP4; in one slice of output
    columns, and (a 1-byte budget) in slices of 8 (the last one short)."""
    monkeypatch.setattr(w4, "DEQUANT_BYTES", budget)
    m = w4.DEQUANT_MIN_M + 3
    _run_int4(m, 34, 160, 32, dtype, bias=True, silu=True)
    _run_int4(m, 21, 144, 72, dtype, bias=False, silu=False, sym=True)
    _run_int4(m, 19, 96, 32, dtype, bias=True, silu=False)  # cuBLAS adds the bias into an output slice
    _run_mxfp4(m, 26, 96, dtype, bias=True, silu=True)


def test_dequant_slices_keep_the_budget() -> None:
    """Slices of the large-M path: they cover N in order, start at multiples of 8 columns, are no
    more than the byte budget needs and each within it (but for the rounding to 8 columns); Llama-3.1-8B's
    bf16 gate_up (2 x 14,336 rows of K = 4,096) is one slice, its LM head (128,256) four."""
    budget = w4.DEQUANT_BYTES
    assert len(w4.dequant_slices(14336, 2 * 4096 * 2)) == 1
    assert len(w4.dequant_slices(128256, 4096 * 2)) == 4
    gen = torch.Generator().manual_seed(5)
    for _ in range(200):
        n = int(torch.randint(1, 300_000, (), generator=gen))
        row_bytes = int(torch.randint(1, 64_000, (), generator=gen))
        starts = w4.dequant_slices(n, row_bytes)
        assert starts.start == 0 and starts.step % 8 == 0 and starts[-1] < n
        widths = [min(n, r0 + starts.step) - r0 for r0 in starts]
        assert sum(widths) == n
        if starts.step > 8:
            assert starts.step * row_bytes <= budget + 8 * row_bytes  # ceil, then up to 8 columns
        assert len(starts) <= max(-(-n * row_bytes // budget), 1)  # no more slices than the budget needs


def _routing(t: int, e: int, top_k: int, gen: torch.Generator):
    ids = torch.argsort(torch.rand(t, e, generator=gen), dim=1)[:, :top_k].to(torch.int32)
    weights = torch.softmax(torch.randn(t, top_k, generator=gen), dim=1)
    return weights.to(DEV), ids.to(DEV)


def _experts(fmt: str | None, e: int, n: int, k: int, dtype: torch.dtype, gen: torch.Generator,
             group: int = 128) -> list:
    """E experts' [E, ...] (packed, scales, zeros or None, fp32 W); INT4 at `group`; fmt None:
    16-bit experts (W in dtype, no scales)."""
    made = []
    for _ in range(e):
        if fmt is None:
            w = (torch.randn(n, k, generator=gen) * k**-0.5).to(DEV, dtype)
            made.append((w, None, None, w.float()))
        elif fmt == "int4":
            made.append(make_int4(n, k, group, dtype, gen))
        else:
            blocks, scales, w = make_mxfp4(n, k, gen)
            made.append((blocks, scales, None, w))
    return [None if v[0] is None else torch.stack(v) for v in zip(*made)]


def _gpt_oss_epilogue(e: int, inter: int, h: int, dtype: torch.dtype, gen: torch.Generator):
    """(b13, b2, act): GPT-OSS's expert biases and clamped SwiGLU (a limit the gate and up values cross)."""
    b13 = torch.randn(e, 2 * inter, generator=gen).to(DEV, dtype)
    b2 = torch.randn(e, h, generator=gen).to(DEV, dtype)
    return b13, b2, G.ExpertAct("gpt_oss", alpha=1.702, limit=0.5)


def _experts_reference(x, d13, d2, weights, ids, b13=None, b2=None, act=None) -> torch.Tensor:  # noqa: ANN001
    """fused_experts_reference in fp64 over the weights dequantised here (biases optional)."""
    return G.fused_experts_reference(x.double(), d13.double(), d2.double(), weights, ids,
                                     b13=None if b13 is None else b13.double(),
                                     b2=None if b2 is None else b2.double(), act=act)


@pytest.mark.triton
@pytest.mark.parametrize("fmt,gpt_oss,group", [("int4", False, 32), ("int4", False, 12), ("mxfp4", False, 32),
                                               ("mxfp4", True, 32)])
@pytest.mark.parametrize("t", [1, 7])
def test_fused_moe_w4(fmt: str, gpt_oss: bool, group: int, t: int) -> None:
    """Triton where it runs, else the CPU reference; against a per-expert loop over the weights
    dequantised here (the fp32 ones the test built, not the kernels' dequantisation). gpt_oss:
    GPT-OSS's expert biases and clamped SwiGLU (a limit the gate and up values cross). INT4 group
    12: a word's 8 columns in two groups, H = 120 and I = 72 (K tails in the 32-column tiles)."""
    e, top_k, h, inter = (5, 2, 120, 72) if group == 12 else (5, 2, 96, 64)
    gen = torch.Generator().manual_seed(t * 13 + len(fmt) + gpt_oss + group)
    dtype = torch.float32
    w13, s13, z13, d13 = _experts(fmt, e, 2 * inter, h, dtype, gen, group)
    w2, s2, z2, d2 = _experts(fmt, e, h, inter, dtype, gen, group)
    x = torch.randn(t, h, generator=gen).to(DEV, dtype)
    weights, ids = _routing(t, e, top_k, gen)
    b13, b2, act = _gpt_oss_epilogue(e, inter, h, dtype, gen) if gpt_oss else (None, None, None)
    out = w4.fused_moe_w4(x, fmt, w13, s13, z13, w2, s2, z2, weights, ids, b13=b13, b2=b2, act=act)
    ref = _experts_reference(x, d13, d2, weights, ids, b13, b2, act)
    assert out.shape == (t, h)
    assert_close(out, ref)


# ---- the GPU: bf16 / fp16, M up to 4096 -------------------------------------------------------


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 8, 31, 33, 257, 4096])
@pytest.mark.parametrize("group", [32, 64, 128, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gpu(m: int, group: int, dtype: torch.dtype) -> None:
    """M <= 32: the skinny template (split-K where default_config splits: N = 1031 at K 4096 does,
    N = 8198 at K 1024 does not), else the weight decoded + cuBLAS; odd N, partial row tiles."""
    _run_int4(m, 1031, 4096, group, dtype, bias=m % 2 == 1, silu=False)
    _run_int4(m, 2 * 700, 4096 + group if group < 4096 else 4096, group, dtype, bias=False, silu=True)
    g = min(group, 1024)
    _run_int4(m, 8198, 1024, g, dtype, bias=True, silu=False, sym=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [3, 8, 19, 32])
@pytest.mark.parametrize("k", [4128, 2240, 576])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_int4_gpu_one_group_a_row_with_k_off_the_chunk(m: int, k: int, dtype: torch.dtype) -> None:
    """Per-channel INT4 (one group a row, group_size -1) with K % 128 in {32, 64, 96}: the last
    chunk's quads straddle K, so the skinny loader must keep the per-pair path there (folding the
    scale out of the MMA zeroed the sums of the token columns held by threads past K: m >= 3)."""
    _run_int4(m, 1031, k, k, dtype, bias=True, silu=False)
    _run_int4(m, 2 * 700, k, k, dtype, bias=False, silu=True, sym=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [33, 257])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_triton_gemm_gpu(m: int, dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton W4A16 GEMM, which ops took at these M until DEQUANT_MIN_M moved to 33 and still
    takes at M <= 32 where the skinny kernel's conditions fail: ops routed through it here."""
    monkeypatch.setattr(w4, "DEQUANT_MIN_M", 1 << 30)
    _run_int4(m, 1031, 4096, 128, dtype, bias=True, silu=False)
    _run_int4(m, 2 * 700, 4096, 64, dtype, bias=False, silu=True)
    _run_mxfp4(m, 2877, 2880, dtype, bias=True, silu=False)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("m", [1, 16, 32, 100, 4096])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_mxfp4_gpu(m: int, dtype: torch.dtype) -> None:
    _run_mxfp4(m, 2877, 2880, dtype, bias=True, silu=False)
    _run_mxfp4(m, 8198, 1024, dtype, bias=False, silu=False)
    _run_mxfp4(m, 2 * 1445, 2880, dtype, bias=True, silu=True)


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("exps", [(1, 12), (100, 160), (126, 131)])
@pytest.mark.parametrize("m", [1, 8])
def test_mxfp4_gpu_scale_range(exps: tuple[int, int], m: int) -> None:
    """The bf16 loader builds e2m1 * 2^-126 from the nibble's bits (zero and 0.5 as subnormals) and
    multiplies by 2^(e8m0 - 1), in two steps past 2^127: scales near bf16's smallest (x W stays
    normal), past 2^1 (the two-step products) and across the boundary, each against the reference."""
    _run_mxfp4(m, 2877, 2880, torch.bfloat16, bias=False, silu=False, exps=exps)
    _run_mxfp4(m, 2 * 1445, 2880, torch.bfloat16, bias=False, silu=True, exps=exps)


# ---- bad input --------------------------------------------------------------------------------


def test_bad_input_is_named() -> None:
    gen = torch.Generator().manual_seed(0)
    qw, s, z, _ = make_int4(16, 64, 32, torch.float32, gen)
    x = torch.randn(2, 64).to(DEV)
    with pytest.raises(ValueError, match="qweight must have dtype int32"):
        w4.int4_linear(x, qw.float(), s, z)
    with pytest.raises(ValueError, match="scales must have dtype"):
        w4.int4_linear(x, qw, s.half(), z)
    with pytest.raises(ValueError, match="qweight must have shape"):
        w4.int4_linear(torch.randn(2, 128).to(DEV), qw, s, z)
    with pytest.raises(ValueError, match="zeros must have shape"):
        w4.int4_linear(x, qw, s, z[:, :1])
    with pytest.raises(ValueError, match="even N"):
        w4.int4_linear(x, qw[:15], s[:15], z[:15], silu_and_mul=True)
    with pytest.raises(ValueError, match="divisible by 8"):
        w4.int4_linear(torch.randn(2, 60).to(DEV), qw, s, z)
    blocks, es, _ = make_mxfp4(8, 64, gen)
    with pytest.raises(ValueError, match="divisible by 32"):
        w4.mxfp4_linear(torch.randn(2, 48).to(DEV), blocks, es)
    with pytest.raises(ValueError, match="bias must have shape"):
        w4.mxfp4_linear(x, blocks, es, bias=torch.zeros(7).to(DEV))
    odd = torch.empty(blocks.numel() + 1, dtype=torch.uint8, device=blocks.device)[1:].view(blocks.shape)
    odd.copy_(blocks)
    with pytest.raises(ValueError, match="4-byte-aligned"):
        w4.mxfp4_linear(x, odd, es)
    with pytest.raises(ValueError, match="fmt must be one of"):
        w4.fused_moe_w4(x, "nf4", qw, s, z, qw, s, z, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))
    # INT4 experts whose zeros sit on another device: named (the kernels read every pointer given)
    w13, s13, z13 = qw[None], s[None], z[None]
    w2q, s2, z2, _ = make_int4(64, 8, 8, torch.float32, gen)
    routing = (torch.ones(2, 1).to(DEV), torch.zeros(2, 1, dtype=torch.int32).to(DEV))
    with pytest.raises(ValueError, match="w2_zeros is on meta"):
        w4.fused_moe_w4(x, "int4", w13, s13, z13, w2q[None], s2[None], z2[None].to("meta"), *routing)


def test_skinny_misfit_names_the_kernels_offset_bounds() -> None:
    """The Python gate refuses, by name, what the launcher's 32-bit offsets cannot address (so a
    call is routed to the Triton GEMM instead of failing at launch): meta tensors, nothing allocated."""
    def meta(shape, stride=None, dtype=torch.bfloat16):
        return torch.empty_strided(shape, stride or (shape[1], 1), dtype=dtype, device="meta")

    k = 4096
    x, w, s = meta((1, k)), meta((64, k // 8), dtype=torch.int32), meta((64, k // 128))
    assert w4.skinny_misfit(x, w, s, 1) is None
    big_k = (1 << 22) + 128
    assert "2^22" in w4.skinny_misfit(meta((1, big_k)), meta((64, big_k // 8), dtype=torch.int32),
                                      meta((64, big_k // 128)), 1)
    assert "row offsets" in w4.skinny_misfit(x, meta((64, k // 8), (1 << 25, 1), torch.int32), s, 1)
    assert "row stride" in w4.skinny_misfit(meta((2, k), (1 << 30, 1)), w, s, 1)


_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would run the good calls on fake pointers")


@_NO_GPU
def test_skinny_w4_launchers_check_the_weight_arguments() -> None:
    """The 4-bit launchers' shared argument check (csrc/skinny_gemm.cu w4_args_ok), through the
    bindings on a machine without a GPU: a bad 4-bit argument is refused before any CUDA call
    ('invalid argument'), while good ones pass every check and fail only at the missing device."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        pytest.skip("minisgl._C was built without CUDA")
    p = 1 << 20  # a 16-byte aligned address, never dereferenced (no launch happens)
    k = 256

    def dense(fmt=1, w_stride=k // 8, zeros=p, q_group=128, k=k, x_stride=k):
        ext.skinny_gemm_w4(p, p, p, zeros, k // q_group if fmt == 1 else k // 32, q_group, fmt, 0, p, 0, 0, 0, 0,
                           1, 64, k, x_stride, w_stride, 64, False, 1, 0, 4, 1, False, 0)

    def moe(fmt=1, w_expert_stride=64 * k // 8, zeros=p, q_group=128, q_stride=None):
        ext.skinny_moe(p, p, 0, p, 0, p, 0, 0, 0, 0, 1, 2, 64, k, k, k // 8 if fmt == 1 else k // 2, 64,
                       w_expert_stride, 0, False, 0, 0.0, 0.0, fmt, p, zeros, q_stride or k // q_group, q_group, 128,
                       1, 0, 4, 1, False, 0)

    bad = [
        lambda: dense(fmt=3),
        lambda: dense(w_stride=k // 8 + 1),  # INT4 rows not 16-byte aligned
        lambda: dense(zeros=0),  # INT4 without zeros
        lambda: dense(q_group=48),  # INT4 group not a multiple of 32
        lambda: dense(fmt=2, w_stride=k // 2, zeros=p, q_group=32),  # MXFP4 with zeros
        lambda: dense(fmt=2, w_stride=k // 2, zeros=0, q_group=64),  # MXFP4 scales per 32 only
        # the kernel's 32-bit offsets and exact group index: K <= 2^22, 64 rows of W and m rows of x
        lambda: dense(k=(1 << 22) + 128, w_stride=((1 << 22) + 128) // 8),
        lambda: dense(w_stride=1 << 25),
        lambda: dense(x_stride=1 << 31),
        lambda: moe(w_expert_stride=64 * k // 8 + 2),  # an expert's rows not 16-byte aligned
        lambda: moe(fmt=2, w_expert_stride=64 * k // 2, zeros=p, q_group=32),
        lambda: moe(q_stride=k // 128 - 1),  # scale rows shorter than K / group (32-bit offsets' bound)
        lambda: moe(fmt=2, w_expert_stride=64 * k // 2, zeros=0, q_group=32, q_stride=2),
    ]
    for call in bad:
        with pytest.raises(RuntimeError, match="invalid argument"):
            call()
    for call in (dense, lambda: dense(fmt=2, w_stride=k // 2, zeros=0, q_group=32), moe,
                 lambda: dense(k=1 << 22, w_stride=(1 << 22) // 8), lambda: dense(w_stride=(1 << 25) - 4),
                 lambda: moe(fmt=2, w_expert_stride=64 * k // 2, zeros=0, q_group=32)):
        with pytest.raises(RuntimeError) as e:
            call()
        assert "invalid argument" not in str(e.value), str(e.value)


@_NO_GPU
def test_every_skinny_table_entry_has_its_kernels() -> None:
    """Each launcher (16-bit, FP8, INT4, MXFP4 dense; MoE 16-bit and 4-bit) finds a kernel for every
    configuration of its table at every row count up to that entry's max m, in both 16-bit
    dtypes (csrc/skinny_gemm.cu: Tiles<W> and the pick functions): those calls pass every check
    and fail only at the missing device, while one row past max m is refused by argument."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        pytest.skip("minisgl._C was built without CUDA")
    p, k, n = 1 << 20, 256, 64

    def bf16(m, dtype, cfg):
        ext.skinny_gemm(p, p, 0, p, 0, 0, 0, 0, m, n, k, k, k, n, False, dtype, cfg, 4, 1, False, 0)

    def fp8(m, dtype, cfg):
        ext.skinny_gemm_fp8(p, p, p, 1, False, 0, p, 0, 0, 0, 0, m, n, k, k, k, n, False, dtype, cfg, 4, 1, False, 0)

    def w4(fmt):
        def call(m, dtype, cfg):
            ext.skinny_gemm_w4(p, p, p, p if fmt == 1 else 0, k // (128 if fmt == 1 else 32), 128 if fmt == 1 else 32,
                               fmt, 0, p, 0, 0, 0, 0, m, n, k, k, k // 8 if fmt == 1 else k // 2, n, False, dtype,
                               cfg, 4, 1, False, 0)
        return call

    def moe(fmt):
        def call(m, dtype, cfg):
            stride = k if fmt == 0 else k // 8 if fmt == 1 else k // 2
            ext.skinny_moe(p, p, 0, p, 0, p, 0, 0, 0, 0, 1, 2, n, k, k, stride, n, n * stride, 0, False, 0, 0.0, 0.0,
                           fmt, p if fmt else 0, p if fmt == 1 else 0, k // 128 if fmt == 1 else k // 32,
                           128 if fmt == 1 else 32, k // 32, dtype, cfg, 4, 1, False, 0)
        return call

    tables = {"16-bit": (ext.skinny_gemm_configs(False), bf16), "fp8": (ext.skinny_gemm_configs(True), fp8),
              "int4": (ext.skinny_gemm_w4_configs(), w4(1)), "mxfp4": (ext.skinny_gemm_w4_configs(), w4(2))}
    for name, (table, launch) in tables.items():
        assert len(table) == 4, name
        for cfg, (_, _, max_m) in enumerate(table):
            for dtype in (0, 1):
                for m in sorted({1, 9, *range(8, max_m + 1, 8)}):
                    if m > max_m:
                        continue
                    with pytest.raises(RuntimeError) as e:
                        launch(m, dtype, cfg)
                    assert "invalid argument" not in str(e.value), f"{name} cfg {cfg} m {m} dtype {dtype}"
                with pytest.raises(RuntimeError, match="invalid argument"):
                    launch(max_m + 1, dtype, cfg)
    for fmt, table in ((0, ext.skinny_gemm_configs(False)), (1, ext.skinny_gemm_w4_configs()),
                       (2, ext.skinny_gemm_w4_configs())):
        for cfg in range(len(table)):
            for dtype in (0, 1):
                with pytest.raises(RuntimeError) as e:
                    moe(fmt)(1, dtype, cfg)
                assert "invalid argument" not in str(e.value), f"moe fmt {fmt} cfg {cfg} dtype {dtype}"
            with pytest.raises(RuntimeError, match="invalid argument"):
                moe(fmt)(1, 2, cfg)  # no such dtype


def test_four_bit_tiles_count_32_element_chunks_for_the_split_rule() -> None:
    """tile_shapes reports every format's chunks in 32-element units (the 4-bit loaders' 128-element
    chunks as 4 x 32), so default_config's and skinny_moe.default_configs' split rule, every warp
    keeps at least two warp groups of K, holds for 4-bit weights too (it counted 32 for them)."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        pytest.skip("minisgl._C was built without CUDA")
    from minisgl.ops.gemm import skinny as sk
    from minisgl.ops.gemm import skinny_moe

    w4_tiles = ext.skinny_gemm_w4_configs()
    for fmt in ("int4", "mxfp4"):
        assert sk.tile_shapes(fmt) == tuple((rt, 4 * u, mm) for rt, u, mm in w4_tiles)
        for n, k in ((256, 2048), (1031, 4096), (4096, 14336)):
            cfg = sk.default_config(1, n, k, False, 132, fmt)
            group = 128 * w4_tiles[cfg.tile][1]
            assert k // cfg.splits >= 2 * cfg.warps * group, (fmt, n, k, cfg)
        up, down = skinny_moe.default_configs(4, 2880, 2880, 132, fmt)
        for cfg in (up, down):
            assert 2880 // cfg.splits >= 2 * cfg.warps * 128 * w4_tiles[cfg.tile][1], (fmt, cfg)
    assert sk.default_config(1, 256, 2048, False, 132, "int4").splits == 2  # 4 when 32 was counted


@gpu
@pytest.mark.gpu
def test_int4_dispatch_table_is_measured_and_followed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The engine-start tuner measures 4-bit shapes too (our configs against the decode + cuBLAS
    path), and ops.linear follows the entry: a config goes to the skinny launch, "cublas" to the
    decode + cuBLAS path, no entry to default_config's launch; each equals the reference."""
    from minisgl import ops
    from minisgl.ops.gemm import tuning
    from minisgl.ops.gemm.dispatch import install_table, table_for
    from minisgl.ops.gemm.skinny import SkinnyConfig
    from minisgl.ops.gemm.table import CUBLAS, GemmCall, GemmShape, GemmTable

    monkeypatch.setattr(env, "CACHE_DIR", str(tmp_path))
    dev = torch.device("cuda", torch.cuda.current_device())
    saved = table_for(dev)
    gen = torch.Generator().manual_seed(3)
    n, k, group = 768, 2048, 128
    qw, s, z, w = make_int4(n, k, group, torch.bfloat16, gen)
    shape = GemmShape("bfloat16-int4g128", n, k, False)
    try:
        table = tuning.tune_gemms([GemmCall(qw, False, "int4", s, 0, z)], dev, [1, 4], torch.bfloat16, budget_s=60)
        assert table is not None and table.has(shape, 1) and table.has(shape, 4)
        seen: list[object] = []
        skinny, dequant = w4.skinny_linear, w4.dequant_linear
        monkeypatch.setattr(w4, "skinny_linear", lambda *a, **kw: seen.append(kw.get("config")) or skinny(*a, **kw))
        monkeypatch.setattr(w4, "dequant_linear", lambda *a, **kw: seen.append(CUBLAS) or dequant(*a, **kw))
        forced = GemmTable()
        forced.set(shape, 1, CUBLAS)
        forced.set(shape, 4, "t0w8s2")
        install_table(dev, forced)
        for m, want in ((1, CUBLAS), (4, SkinnyConfig(0, 8, 2)), (5, None)):
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            seen.clear()
            y = ops.linear(x, qw, fmt="int4", scale=s, zeros=z)
            assert seen == [want], f"M {m}: {seen}"
            assert_close(y, reference(x, w, None, False))
    finally:
        install_table(dev, saved if saved is not None else GemmTable())


@gpu
@pytest.mark.gpu
def test_tuned_moe_tiles_gpu() -> None:
    """Each tile config tuned for this GPU (kernels/fused_moe_configs.json; 4-bit experts' w=
    entries and the 16-bit ones, benchmarks/kernels/tune_fused_moe.py): the fused MoE's two GEMMs
    with it, at its shape's H and I (4 experts, top 2, three row blocks of tokens), bf16, each
    tile without and with GPT-OSS's biases and activation, against the per-expert loop over the
    weights (dequantised here). The engine picks these only on this GPU and shape, so no other test runs
    them."""
    import itertools
    import json

    from minisgl.kernels import fused_moe_config as C
    from minisgl.kernels import moe_align

    table = C.load_configs(C.CONFIG_FILE).get(torch.cuda.get_device_name(), {})
    if not table:
        pytest.skip(f"no tuned MoE tiles for {torch.cuda.get_device_name()}")
    e, top_k, dtype = 4, 2, torch.bfloat16
    for key in sorted(table):
        fields = dict(f.split("=") for f in key.split(","))
        h, inter, w_key = int(fields["H"]), int(fields["I"]), fields.get("w")  # w: None, int4g<group>, mxfp4
        fmt = "int4" if w_key is not None and w_key.startswith("int4") else w_key
        group = int(w_key.removeprefix("int4g")) if fmt == "int4" else 32
        gen = torch.Generator().manual_seed(h + inter)
        (w13, s13, z13, d13) = _experts(fmt, e, 2 * inter, h, dtype, gen, group)
        (w2, s2, z2, d2) = _experts(fmt, e, h, inter, dtype, gen, group)
        q13, q2 = (None, None) if fmt is None else (G.W4(s13, z13, w4.FORMATS[fmt]), G.W4(s2, z2, w4.FORMATS[fmt]))
        texts = sorted({json.dumps(cfg, sort_keys=True) for cfg in table[key].values()})
        for text, gpt_oss in itertools.product(texts, (False, True)):  # GPT-OSS: expert biases, clamped SwiGLU
            cfg = C.MoeTileConfig.from_dict(json.loads(text))
            t = 3 * cfg.block_m
            x = torch.randn(t, h, generator=gen).to(DEV, dtype)
            weights, ids = _routing(t, e, top_k, gen)
            b13, b2, act = _gpt_oss_epilogue(e, inter, h, dtype, gen) if gpt_oss else (None, None, None)
            sorted_ids, expert_ids = moe_align.align(ids, e, cfg.block_m)
            inter_y = G.up_gemm(x, w13, sorted_ids, expert_ids, top_k, cfg.block_m, cfg.up, q13, b13, act)
            y = G.down_gemm(inter_y, w2, weights, sorted_ids, expert_ids, cfg.block_m, cfg.down, q2, b2)
            assert_close(G.moe_sum(y, top_k), _experts_reference(x, d13, d2, weights, ids, b13, b2, act))


def test_the_kv_budget_leaves_room_for_a_decoded_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/memory.py: on a GPU, a 4-bit model's KV budget also leaves DEQUANT_BYTES for the
    large-M path's decoded slice (beside the 1 GiB for activations); FP8 and 16-bit models do not."""
    import types

    from minisgl.engine.memory import MemoryPlan

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))

    def budget(fmt: str | None) -> float:
        plan = types.SimpleNamespace(
            device=torch.device("cuda", 0), cfg=types.SimpleNamespace(gpu_memory_fraction=0.9, deterministic=False),
            model_config=types.SimpleNamespace(quantization=None if fmt is None else types.SimpleNamespace(fmt=fmt)))
        return MemoryPlan._kv_budget(plan)

    base = 0.9 * (80 << 30) - (20 << 30) - (1 << 30)
    assert budget(None) == budget("fp8") == base
    assert budget("int4") == budget("mxfp4") == base - w4.DEQUANT_BYTES
