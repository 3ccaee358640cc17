"""4-bit weight kernels (the skinny CUDA template's Int4W / Mxfp4W loaders at M <= 32,
kernels/w4a16_gemm.py, through ops/gemm/w4.py) against the dequantise-then-matmul reference on
fresh random data (the 4-bit experts: test_w4_moe.py; the argument checks: test_w4_checks.py). The weights
are built here from random nibbles, scales and zeros and dequantised here (not through
kernels/quant4.py), then packed: the references' unpacking is under test too. Every group size,
odd N and K not a multiple of the tile, M = 1 .. 4096 (GPU), bias and SiLU-and-mul on and off."""

from __future__ import annotations

import pytest
import torch

from minisgl import env
from minisgl.kernels.quant4 import E2M1_VALUES, pack_int4, unpack_int4, unpack_nibbles
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
