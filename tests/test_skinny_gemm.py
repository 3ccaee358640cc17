"""Skinny GEMM: the CUDA kernel against an fp64 reference (FA3's rule: at most twice torch's
own error in the same dtype, plus two roundings), every launch configuration, strides, bias,
the SiLU epilogue, CUDA graphs; and (on the CPU, in CI) the fp32 reference and every check."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from minisgl.ops.gemm.reference import skinny_gemm_reference
from minisgl.ops.gemm.skinny import SkinnyConfig, skinny_gemm, tile_shapes

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def gpu(fn):
    return pytest.mark.gpu(_needs_cuda(fn))


def make(m: int, n: int, k: int, dtype: torch.dtype, device: str, seed: int = 0, bias: bool = False, pad: int = 0):
    """x [m, k] (a column slice of a [m, k + pad] tensor when pad > 0), W [n, k] ~ 1/sqrt(k)
    scale (outputs ~ N(0, 1)), bias [n]: fresh random, never zeros."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k + pad, generator=g).to(dtype).to(device)[:, :k]
    w = (torch.randn(n, k, generator=g) / k**0.5).to(dtype).to(device)
    b = torch.randn(n, generator=g).to(dtype).to(device) if bias else None
    return x, w, b


def gold(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, silu: bool) -> torch.Tensor:
    y = x.double() @ w.double().t()
    if b is not None:
        y = y + b.double()
    if silu:
        gate, up = y.chunk(2, dim=-1)
        y = F.silu(gate) * up
    return y


def torch_same_dtype(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, silu: bool) -> torch.Tensor:
    """What the unfused path computes: torch's GEMM in x's dtype, then SiLU-and-mul rounded."""
    y = F.linear(x, w, b)
    if silu:
        gate, up = y.float().chunk(2, dim=-1)
        y = (F.silu(gate) * up).to(x.dtype)
    return y


def assert_rule(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None, silu: bool) -> None:
    ref = gold(x, w, b, silu)
    assert torch.isfinite(out).all(), "output has unwritten (NaN) entries"
    err = (out.double() - ref).abs().max().item()
    base = (torch_same_dtype(x, w, b, silu).double() - ref).abs().max().item()
    r = ref.to(out.dtype)
    floor = 2 * ((r + 0.3 - 0.3).double() - ref).abs().max().item()
    assert err <= 2 * base + floor, f"kernel error {err:.3g} > 2 x torch {base:.3g} + {floor:.3g}"


def all_configs(m: int) -> list[SkinnyConfig]:
    return [
        SkinnyConfig(t, w, s)
        for t, (_, _, max_m) in enumerate(tile_shapes())
        if m <= max_m
        for w in (1, 2, 4, 8)
        for s in (1, 3, 8)
    ]


# ---- GPU ----


@gpu
@pytest.mark.parametrize("m", [1, 3, 7, 16, 32])
@pytest.mark.parametrize("silu", [False, True])
def test_every_config(m: int, silu: bool) -> None:
    """N odd (tail rows), K = 1000: not a multiple of any group (125 pieces of 8)."""
    n = 2 * 173 if silu else 173
    x, w, _ = make(m, n, 1000, torch.bfloat16, "cuda", seed=m)
    for cfg in all_configs(m):
        out = torch.full((m, n // 2 if silu else n), float("nan"), dtype=torch.bfloat16, device="cuda")
        skinny_gemm(x, w, silu=silu, out=out, config=cfg)
        assert_rule(out, x, w, None, silu)


@gpu
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize(("n", "k"), [(1, 8), (17, 24), (4096, 4096), (1024, 14336), (6144, 1024)])
@pytest.mark.parametrize("m", [1, 3, 7, 16, 32])
def test_shapes_default_config(dtype: torch.dtype, n: int, k: int, m: int) -> None:
    x, w, b = make(m, n, k, dtype, "cuda", seed=n + k + m, bias=(m % 2 == 1))
    assert_rule(skinny_gemm(x, w, b), x, w, b, False)


@gpu
@pytest.mark.parametrize("m", [1, 4, 32])
def test_lm_head_shape(m: int) -> None:
    x, w, _ = make(m, 128256, 4096, torch.bfloat16, "cuda", seed=m)
    assert_rule(skinny_gemm(x, w), x, w, None, False)


@gpu
@pytest.mark.parametrize("silu", [False, True])
def test_bias_noncontiguous_x_and_strided_out(silu: bool) -> None:
    """x is a column slice (row stride k + 64); out is a column slice of a NaN tensor whose
    other columns must stay NaN (nothing written outside the output)."""
    n, k, m = 2 * 300, 2048, 5
    x, w, b = make(m, n, k, torch.bfloat16, "cuda", seed=2, bias=True, pad=64)
    assert not x.is_contiguous()
    n_out = n // 2 if silu else n
    big = torch.full((m, n_out + 24), float("nan"), dtype=torch.bfloat16, device="cuda")
    for cfg in (SkinnyConfig(0, 4, 1), SkinnyConfig(2, 8, 4)):
        big.fill_(float("nan"))
        skinny_gemm(x, w, b, silu=silu, out=big[:, 8 : 8 + n_out], config=cfg)
        assert_rule(big[:, 8 : 8 + n_out], x, w, b, silu)
        assert big[:, :8].isnan().all() and big[:, 8 + n_out :].isnan().all()


@gpu
def test_split_k_is_deterministic() -> None:
    x, w, _ = make(8, 1024, 8192, torch.bfloat16, "cuda", seed=4)
    cfg = SkinnyConfig(1, 4, 8)
    first = skinny_gemm(x, w, config=cfg)
    for _ in range(5):
        assert torch.equal(skinny_gemm(x, w, config=cfg), first)


@gpu
def test_dependent_launch_is_on_where_the_loaded_code_waits() -> None:
    """The launchers ask for programmatic dependent launch only where the code loaded on the GPU
    was compiled for compute_90 or later (csrc/pdl.h), so a build of README's default targets (80
    and 90) overlaps kernels on Hopper and later and not before. A silent False here would cost
    every decode step its overlaps and fail no other test."""
    from minisgl.ops._backend import compiled

    major = torch.cuda.get_device_capability()[0]
    assert compiled().pdl_enabled(torch.cuda.current_device()) == (major >= 9), (
        "this build's code for the GPU has no sm_90 target (MINISGL_CUDA_ARCHS): no kernel overlap")


def check_pdl_chain(chain, outs: list[torch.Tensor], graph: bool) -> None:  # noqa: ANN001
    """Runs chain(False) (launches without PDL), keeps `outs`, NaN-poisons them, runs chain(True)
    (captured in a CUDA graph when `graph`, poisoned again before the replay) and requires the
    same bits."""
    chain(False)
    want = [o.clone() for o in outs]
    for o in outs:
        o.fill_(float("nan"))
    if graph:
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            chain(True)
        for o in outs:
            o.fill_(float("nan"))
        g.replay()
    else:
        chain(True)
    torch.cuda.synchronize()
    for o, w in zip(outs, want):
        assert torch.equal(o, w)


@gpu
@pytest.mark.parametrize("graph", [False, True])
def test_dependent_launches_read_the_previous_output(graph: bool) -> None:
    """Programmatic dependent launch: each GEMM may start while the previous one runs, so
    reading its input (the previous output) before griddepcontrol.wait would read stale data.
    A chain of 6 split-K GEMMs, each consuming the last one's output, against the chain
    computed launch by launch without PDL."""
    from minisgl.ops.gemm.skinny import launch

    m, d = 4, 2048
    x, _, _ = make(m, d, d, torch.bfloat16, "cuda", seed=30)
    ws = [make(m, d, d, torch.bfloat16, "cuda", seed=31 + i)[1] for i in range(6)]
    outs = [torch.empty(m, d, dtype=torch.bfloat16, device="cuda") for _ in ws]
    cfg = SkinnyConfig(1, 4, 4)

    def chain(pdl: bool) -> None:
        h = x
        for w, o in zip(ws, outs):
            launch(h, w, None, o, False, cfg, pdl=pdl)
            h = o

    check_pdl_chain(chain, outs, graph)


@gpu
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("fused", [True, False])
def test_dependent_launches_after_a_norm_and_the_attention_merge(graph: bool, fused: bool) -> None:
    """The fused add-RMSNorm and SiLU-and-mul (Triton) and the decode attention's merge signal the
    next grid at their start, so a skinny GEMM launched with PDL after them starts loading W while
    they still run. Its input is their output: a read before griddepcontrol.wait would be stale.
    So do rope + KV store, and the split decode after it (launched with PDL) reads only the
    table before its wait: q and the last token's K/V row are rope's output.
    (`fused` False: rope, then the KV store kernel, which signals too: the path of QK-norm layers,
    FP8 caches and partial rotary.)
    The norm and rope are themselves launched with PDL (they wait before reading their input, the
    GEMM's output, and read only the weight, positions, cos/sin and slots before), so each follows
    a GEMM directly here.
    GEMM -> norm -> GEMM -> rope + store (the last token's K/V row) -> split decode (4 splits) +
    merge -> GEMM -> GEMM (gate | up) -> SiLU-and-mul -> GEMM -> norm (residual in place) -> GEMM,
    against the same chain without PDL on the GEMMs and with the device synchronized before every
    kernel launched with PDL in both runs (the norms, rope, the attention): their stale reads would
    see a NaN-poisoned GEMM output, the unrotated q or the poisoned K/V row. Outputs NaN-poisoned
    before the run."""
    from attention_rule import assert_fa3_rule
    from test_decode_attention import make_case

    from minisgl import ops
    from minisgl.kernels.decode_attention import decode_attention_reference
    from minisgl.kernels.norm import _launch as norm_launch
    from minisgl.kernels.norm import fused_add_rmsnorm_reference
    from minisgl.kernels.rope import apply_rope_reference
    from minisgl.ops.gemm.skinny import launch

    heads, dim = 16, 128
    d = heads * dim
    x0, w0, _ = make(1, d, d, torch.bfloat16, "cuda", seed=39)
    w1 = make(1, d, d, torch.bfloat16, "cuda", seed=40)[1]
    res = make(1, d, d, torch.bfloat16, "cuda", seed=41)[0]
    w2 = make(1, d, d, torch.bfloat16, "cuda", seed=42)[1]
    w3 = make(1, 2 * d, d, torch.bfloat16, "cuda", seed=44)[1]
    w4 = make(1, d, d, torch.bfloat16, "cuda", seed=45)[1]
    norm_w = torch.randn(d, device="cuda").to(torch.bfloat16)
    c = make_case([900], 4, 4, dim, torch.bfloat16, 1, "cuda", seed=43)
    last = c["req_to_slot"][c["req_rows"].long(), 899].long()  # the slot rope + store writes
    slots = last.to(torch.int32)
    positions = torch.tensor([899], dtype=torch.int64, device="cuda")
    cos_sin = torch.randn(1024, dim, device="cuda")
    k_new, v_new = (torch.randn(1, 4, dim, device="cuda").to(torch.bfloat16) for _ in range(2))
    k_buf = torch.empty_like(k_new)
    k_row, v_row = c["k_cache"][int(last[0])], c["v_cache"][int(last[0])]  # views, poisoned with the outputs
    x, h, r_out, q = (torch.empty(1, d, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    attn = torch.empty(1, heads, dim, dtype=torch.bfloat16, device="cuda")
    y, z, h2, r2, y2 = (torch.empty(1, d, dtype=torch.bfloat16, device="cuda") for _ in range(5))
    gu = torch.empty(1, 2 * d, dtype=torch.bfloat16, device="cuda")
    cfg = SkinnyConfig(1, 4, 4)

    def sync_if(reference: bool) -> None:  # the reference run: the next kernel starts after everything
        if reference:
            torch.cuda.synchronize()

    def chain(pdl: bool) -> None:
        k_buf.copy_(k_new)  # rope rotates k in place (a copy, not a kernel: before the chain)
        r2.copy_(res)  # the second norm's residual, updated in place
        launch(x0, w0, None, x, False, cfg, pdl=pdl)
        sync_if(not pdl)
        norm_launch(x, res, norm_w, 1e-6, h, r_out)
        launch(h, w1, None, q, False, cfg, pdl=pdl)
        sync_if(not pdl)
        if fused:  # (rope and the store kernel signal their dependents in both runs)
            ops.apply_rope_and_store(q.view(1, heads, dim), k_buf, v_new, positions, cos_sin, c["k_cache"],
                                     c["v_cache"], slots)
        else:
            ops.apply_rope(q.view(1, heads, dim), k_buf, positions, cos_sin)
            ops.store_kv(c["k_cache"], c["v_cache"], k_buf, v_new, slots)
        sync_if(not pdl)
        ops.paged_decode_attention(q.view(1, heads, dim), c["k_cache"], c["v_cache"], c["req_to_slot"],
                                   c["req_rows"], c["seq_lens"], dim**-0.5, 4096, out=attn, num_splits=4)
        launch(attn.view(1, d), w2, None, y, False, cfg, pdl=pdl)
        launch(y, w3, None, gu, False, cfg, pdl=pdl)
        launch(ops.silu_and_mul(gu), w4, None, z, False, cfg, pdl=pdl)
        sync_if(not pdl)
        norm_launch(z, r2, norm_w, 1e-6, h2, r2)
        launch(h2, w2, None, y2, False, cfg, pdl=pdl)

    check_pdl_chain(chain, [x, h, r_out, q, k_row, v_row, attn, y, gu, z, h2, r2, y2], graph)
    # And against torch, so a reference run with the same stale reads cannot pass: the stored row is
    # the rotated k and v, the attention is over the final q and cache.
    k_want = k_new.clone()
    apply_rope_reference(torch.zeros_like(k_want), k_want, positions, cos_sin)
    eps = torch.finfo(torch.bfloat16).eps
    torch.testing.assert_close(k_row.float(), k_want[0].float(), rtol=2 * eps, atol=2 * eps)
    assert torch.equal(v_row, v_new[0])
    assert_fa3_rule(attn, decode_attention_reference, q.view(1, heads, dim), c["k_cache"], c["v_cache"],
                    c["req_to_slot"], c["req_rows"], c["seq_lens"], dim**-0.5)
    for hn, rn, src in ((h, r_out, x), (h2, r2, z)):  # the norms, from the final GEMM outputs
        h_want, r_want = fused_add_rmsnorm_reference(src, res, norm_w, 1e-6)
        assert torch.equal(rn, r_want)
        torch.testing.assert_close(hn.float(), h_want.float(), rtol=2 * eps, atol=2 * eps)
    # The GEMMs against fp64 torch, each from the input it read (q is not: rope rotated it in place).
    for out, inp, w in ((x, x0, w0), (y, attn.view(1, d), w2), (gu, y, w3), (z, ops.silu_and_mul(gu), w4),
                        (y2, h2, w2)):
        assert_rule(out, inp, w, None, False)


@gpu
def test_misaligned_x_falls_back_to_cublas() -> None:
    """x starting 2 bytes past a 16-byte boundary cannot take vector loads: cuBLAS, same answer."""
    x, w, _ = make(4, 256, 512, torch.bfloat16, "cuda", seed=5, pad=8)
    x = x.as_strided(x.shape, x.stride(), storage_offset=1)
    assert x.data_ptr() % 16 != 0
    assert_rule(skinny_gemm(x, w), x, w, None, False)


@gpu
def test_cuda_graph_capture_and_replay() -> None:
    """Split-K launches (counters reset in the kernel) replayed many times with new inputs."""
    m, n, k = 8, 2 * 512, 4096
    x, w, b = make(m, n, k, torch.bfloat16, "cuda", seed=6, bias=True)
    cfgs = [SkinnyConfig(1, 4, 1), SkinnyConfig(1, 4, 8), SkinnyConfig(2, 2, 3)]
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # warm-up outside capture (allocates the split-K counters)
        for cfg in cfgs:
            skinny_gemm(x, w, b, config=cfg)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = [skinny_gemm(x, w, b, config=cfg) for cfg in cfgs]
        outs.append(skinny_gemm(x, w, b, silu=True, config=cfgs[1]))
    for seed in range(3):
        fresh, _, _ = make(m, n, k, torch.bfloat16, "cuda", seed=100 + seed)
        x.copy_(fresh)
        for o in outs:
            o.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for o in outs[:3]:
            assert_rule(o, x, w, b, False)
        assert_rule(outs[3], x, w, b, True)


# ---- CPU (and any device): the reference and the checks ----


@pytest.mark.parametrize("silu", [False, True])
def test_reference_matches_fp64(silu: bool) -> None:
    x, w, b = make(5, 64, 48, torch.float32, "cpu", seed=9, bias=True)
    ref = skinny_gemm_reference(x, w, b, silu)
    assert ref.shape == (5, 32 if silu else 64)
    torch.testing.assert_close(ref.double(), gold(x, w, b, silu), rtol=1e-5, atol=1e-5)


def test_cpu_runs_the_reference_into_out() -> None:
    x, w, b = make(3, 40, 16, torch.bfloat16, "cpu", seed=1, bias=True)
    out = torch.full((3, 20), float("nan"), dtype=torch.bfloat16)
    assert skinny_gemm(x, w, b, silu=True, out=out) is out
    assert torch.equal(out, skinny_gemm_reference(x, w, b, True))


def _args(**over):
    x, w, b = make(4, 16, 32, torch.bfloat16, "cpu", bias=True)
    return {"x": x, "weight": w, "bias": b} | over


@pytest.mark.parametrize(
    ("over", "match"),
    [
        ({"x": torch.zeros(4, 32, dtype=torch.int32)}, "x must have dtype"),
        ({"weight": torch.randn(16, 32, dtype=torch.float16)}, "weight must have dtype bfloat16"),
        ({"weight": torch.randn(16, 24, dtype=torch.bfloat16)}, r"weight must have shape \('\*', 32\)"),
        ({"x": torch.randn(33, 32, dtype=torch.bfloat16)}, "x must have at most 32 rows"),
        ({"x": torch.randn(4, 32, 1, dtype=torch.bfloat16)}, "x must have 2 dimensions"),
        ({"x": torch.randn(32, 4, dtype=torch.bfloat16).t()}, "x must be contiguous in its last"),
        ({"bias": torch.randn(15, dtype=torch.bfloat16)}, r"bias must have shape \(16,\)"),
        ({"bias": torch.randn(16, dtype=torch.float32)}, "bias must have dtype bfloat16"),
        ({"out": torch.empty(4, 15, dtype=torch.bfloat16)}, r"out must have shape \(4, 16\)"),
        ({"weight": torch.randn(16, 32, dtype=torch.bfloat16, device="meta")}, "weight is on meta"),
        ({"weight": [[1.0]]}, "weight must be a torch.Tensor"),
    ],
)
def test_bad_arguments_raise(over: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        skinny_gemm(**_args(**over))


def test_silu_needs_even_rows() -> None:
    x, w, _ = make(2, 15, 32, torch.bfloat16, "cpu")
    with pytest.raises(ValueError, match="weight must have an even number of rows"):
        skinny_gemm(x, w, silu=True)


def test_config_text_round_trip() -> None:
    cfg = SkinnyConfig(2, 8, 16)
    assert SkinnyConfig.parse(str(cfg)) == cfg
    with pytest.raises(ValueError, match="not a skinny GEMM config"):
        SkinnyConfig.parse("t1w4")


@gpu
@pytest.mark.parametrize(
    ("cfg", "match"),
    [
        (SkinnyConfig(99, 4, 1), "config tile must be in"),
        (SkinnyConfig(0, 0, 1), "config warps must be in"),
        (SkinnyConfig(0, 4, 65), "config splits must be in"),
        (SkinnyConfig(3, 4, 1), "config tile 3 takes at most 16 rows"),
    ],
)
def test_bad_config_raises(cfg: SkinnyConfig, match: str) -> None:
    x, w, _ = make(32, 64, 64, torch.bfloat16, "cuda")
    with pytest.raises(ValueError, match=match):
        skinny_gemm(x, w, config=cfg)


def test_triton_kernels_signal_only_where_compiled_for_hopper(monkeypatch: pytest.MonkeyPatch) -> None:
    """kernels/device.py dependent_launch: the Triton kernels before a skinny GEMM signal it on sm_90+
    only, never in the Triton interpreter (it cannot run griddepcontrol, on CUDA tensors either)
    and never with a Triton that lacks gdc_launch_dependents."""
    from types import SimpleNamespace

    import triton

    from minisgl.kernels import device

    t = SimpleNamespace(is_cuda=True, device=SimpleNamespace(index=0))
    monkeypatch.setattr(device, "_major", lambda index: 9)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    assert device.dependent_launch(t)
    monkeypatch.setattr(device, "_major", lambda index: 8)
    assert not device.dependent_launch(t)
    monkeypatch.setattr(device, "_major", lambda index: 9)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", True)
    assert not device.dependent_launch(t)
    monkeypatch.setattr(triton.knobs.runtime, "interpret", False)
    monkeypatch.setattr(device, "gdc_launch_dependents", None)
    assert not device.dependent_launch(t)
    assert not device.dependent_launch(torch.zeros(1))
