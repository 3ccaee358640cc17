"""The skinny MoE kernel (ops/gemm/skinny_moe.py, csrc/skinny_moe.cuh skinny_moe_kernel), 16-bit and
4-bit experts, against an independent fp32 torch computation of the same routed experts (4-bit:
of their dequantisation by kernels/quant4.py's references), on fresh random data. The experts
no token chose are NaN-poisoned, so a block that read the wrong expert (or the wrong row of x or
of the intermediate) shows as NaN; the kernel's output buffers are fresh. CPU: the choice of path
and the argument checks."""

from __future__ import annotations

import pytest
import torch

from minisgl.kernels import w4a16_gemm as W4
from minisgl.kernels.fused_moe import ExpertAct
from minisgl.kernels.quant4 import dequant_int4_reference, dequant_mxfp4_reference, pack_int4
from minisgl.ops import moe as moe_ops
from minisgl.ops.gemm import skinny_moe
from minisgl.ops.gemm import w4 as w4_ops
from minisgl.ops.gemm.skinny import SkinnyConfig

gpu = pytest.mark.gpu


def _reference(x, w13, w2, weights, ids, b13, b2, act, dtype):
    """Per token and slot in fp32: gate/up rows, the activation rounded to `dtype` (the kernel's
    intermediate), the down rows, then the weighted sum over slots, rounded once."""
    t, k = ids.shape
    inter = w2.shape[2]
    out = torch.zeros(t, x.shape[1], dtype=torch.float64, device=x.device)
    for i in range(t):
        for j in range(k):
            e = int(ids[i, j])
            h = x[i].double() @ w13[e].double().T
            if b13 is not None:
                h = h + b13[e].double()
            gate, up = h[:inter], h[inter:]
            if act is not None and act.kind == "gpt_oss":
                g = gate.clamp(max=act.limit)
                a = g * torch.sigmoid(act.alpha * g) * (up.clamp(-act.limit, act.limit) + 1)
            else:
                a = gate * torch.sigmoid(gate) * up
            a = a.to(dtype).double()
            y = a @ w2[e].double().T
            if b2 is not None:
                y = y + b2[e].double()
            out[i] += float(weights[i, j]) * y
    return out


def _case(tokens, top_k, experts, hidden, inter, dtype, biases, seed, poison=True):
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev = "cuda"
    x = torch.randn(tokens, hidden, generator=g, device=dev).to(dtype)
    w13 = (torch.randn(experts, 2 * inter, hidden, generator=g, device=dev) / hidden**0.5).to(dtype)
    w2 = (torch.randn(experts, hidden, inter, generator=g, device=dev) / inter**0.5).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g, device=dev)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g, device=dev) + 0.1
    b13 = (torch.randn(experts, 2 * inter, generator=g, device=dev) * 0.5).to(dtype) if biases else None
    b2 = (torch.randn(experts, hidden, generator=g, device=dev) * 0.5).to(dtype) if biases else None
    if not poison:  # every expert live: tests whose routing changes after the draw
        return x, w13, w2, weights, ids.contiguous(), b13, b2
    unused = torch.ones(experts, dtype=torch.bool, device=dev)
    unused[ids.long().flatten()] = False
    w13[unused] = float("nan")  # poison: a wrong expert read shows
    w2[unused] = float("nan")
    if biases:
        b13[unused] = float("nan")
        b2[unused] = float("nan")
    return x, w13, w2, weights, ids.contiguous(), b13, b2


def _check(out, ref, dtype):
    assert not out.isnan().any(), "NaN: a block read an expert no token chose"
    scale = ref.abs().max().item()
    tol = (2e-2 if dtype == torch.bfloat16 else 4e-3) * scale
    err = (out.double() - ref).abs().max().item()
    assert err <= tol, f"max error {err:.4g} > {tol:.4g} (scale {scale:.4g})"


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 3, 4])
@pytest.mark.parametrize("top_k,experts", [(1, 4), (4, 32), (8, 64)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_kernel_matches_reference(tokens: int, top_k: int, experts: int, gpt_oss: bool) -> None:
    dtype = torch.bfloat16
    hidden, inter = 392, 200  # row tiles and K splits that end mid-tile / mid-group
    x, w13, w2, weights, ids, b13, b2 = _case(tokens, top_k, experts, hidden, inter, dtype, gpt_oss, seed=tokens)
    act = ExpertAct("gpt_oss", 1.702, 7.0) if gpt_oss else None
    out = skinny_moe.experts(x, w13, w2, weights, ids, b13, b2, act)
    _check(out, _reference(x, w13, w2, weights, ids, b13, b2, act, dtype), dtype)


@gpu
@pytest.mark.parametrize("up,down", [("t0w1s1", "t0w1s1"), ("t1w4s3", "t1w8s2"), ("t2w2s1", "t2w4s4"),
                                     ("t3w8s8", "t3w2s16"), ("t1w4s1", "t0w4s1")])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_every_tile_warp_and_split(up: str, down: str, dtype: torch.dtype) -> None:
    x, w13, w2, weights, ids, b13, b2 = _case(3, 4, 16, 2880 // 4, 2880 // 4 + 8, dtype, True, seed=7)
    act = ExpertAct("gpt_oss", 1.702, 7.0)
    out = skinny_moe.experts(x, w13, w2, weights, ids, b13, b2, act, SkinnyConfig.parse(up), SkinnyConfig.parse(down))
    _check(out, _reference(x, w13, w2, weights, ids, b13, b2, act, dtype), dtype)


@gpu
def test_gpt_oss_shape_and_repeated_launches() -> None:
    """GPT-OSS-20B's layer (H = I = 2880, 32 experts, top 4); the split-K counters reset themselves,
    so launch after launch (and the same routing twice) gives the same bits."""
    dtype = torch.bfloat16
    x, w13, w2, weights, ids, b13, b2 = _case(1, 4, 32, 2880, 2880, dtype, True, seed=3)
    act = ExpertAct("gpt_oss", 1.702, 7.0)
    first = skinny_moe.experts(x, w13, w2, weights, ids, b13, b2, act)
    _check(first, _reference(x, w13, w2, weights, ids, b13, b2, act, dtype), dtype)
    for _ in range(3):
        assert torch.equal(skinny_moe.experts(x, w13, w2, weights, ids, b13, b2, act), first)


@gpu
def test_cuda_graph_replays_new_routing() -> None:
    """The expert ids are read on the device: a captured launch follows the routing of each replay,
    and a token's row is the same whatever the batch (the launch configuration ignores T)."""
    dtype = torch.bfloat16
    experts, top_k = 16, 4
    x, w13, w2, weights, ids, b13, b2 = _case(4, top_k, experts, 256, 128, dtype, False, seed=5, poison=False)
    skinny_moe.experts(x, w13, w2, weights, ids)  # counters allocated outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = skinny_moe.experts(x, w13, w2, weights, ids)
    g = torch.Generator(device="cuda").manual_seed(11)
    for _ in range(3):
        ids.copy_(torch.stack([torch.randperm(experts, generator=g, device="cuda")[:top_k] for _ in range(4)]))
        weights.copy_(torch.rand(4, top_k, generator=g, device="cuda"))
        x.copy_(torch.randn(4, 256, generator=g, device="cuda"))
        graph.replay()
        _check(out, _reference(x, w13, w2, weights, ids, None, None, None, dtype), dtype)
        alone = skinny_moe.experts(x[2:3], w13, w2, weights[2:3], ids[2:3])
        assert torch.equal(alone, out[2:3]), "a token's row depends on the batch it is in"


def _shared(tokens, hidden, dtype, seed):
    """A shared expert's output [T, H] and its gate logit [T, 1] (Qwen2-MoE / Qwen3-Next / Qwen3.5-MoE),
    and what they add to a token's row in fp64: sigmoid(gate) * shared."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    shared = torch.randn(tokens, hidden, generator=g, device="cuda").to(dtype)
    gate = (torch.randn(tokens, 1, generator=g, device="cuda") * 2).to(dtype)
    return dict(shared=shared, shared_gate=gate), torch.sigmoid(gate.double()) * shared.double()


@gpu
@pytest.mark.parametrize("with_shared", [False, True])
def test_fused_moe_takes_the_skinny_path_up_to_max_tokens(monkeypatch, with_shared: bool) -> None:
    """ops.fused_moe routes and runs 1..MAX_TOKENS tokens here (against the Triton path's result on
    the same routing), and the Triton path beyond; a shared expert's gated row joins the sum on both."""
    calls = []
    real = skinny_moe.experts
    monkeypatch.setattr(skinny_moe, "experts", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    dtype = torch.bfloat16
    g = torch.Generator(device="cuda").manual_seed(2)
    w13 = (torch.randn(8, 256, 128, generator=g, device="cuda") / 11).to(dtype)
    w2 = (torch.randn(8, 128, 128, generator=g, device="cuda") / 11).to(dtype)
    for t in (1, skinny_moe.MAX_TOKENS, skinny_moe.MAX_TOKENS + 1):
        x = torch.randn(t, 128, generator=g, device="cuda").to(dtype)
        logits = torch.randn(t, 8, generator=g, device="cuda").to(dtype)
        extra, added = _shared(t, 128, dtype, seed=t) if with_shared else ({}, 0)
        out = moe_ops.fused_moe(x, logits, w13, w2, 2, True, **extra)
        weights, ids = moe_ops.moe_route(logits, 2, True)
        ref = _reference(x, w13, w2, weights, ids, None, None, None, dtype) + added
        _check(out, ref, dtype)
    assert calls == [1, skinny_moe.MAX_TOKENS]


def test_env_setting_is_parsed_or_refused() -> None:
    assert skinny_moe._parse("") == (2, None, None)
    assert skinny_moe._parse("0") == (0, None, None)
    assert skinny_moe._parse("2:t2w4s1,t1w8s2") == (2, SkinnyConfig(2, 4, 1), SkinnyConfig(1, 8, 2))
    with pytest.raises(ValueError, match="MINISGL_SKINNY_MOE"):
        skinny_moe._parse("many")
    with pytest.raises(ValueError, match="not a skinny GEMM config"):
        skinny_moe._parse("4:t2w4s1,oops")


def test_deterministic_splits_follow_the_shape() -> None:
    """Deterministic mode's launches: tile DETERMINISTIC_TILE, each expert weight's K splits as the
    block's warps, one split per pair and slot. For every K the warps cut K into equal shares of
    whole 128-element groups at least MIN_SPLIT_K long, where the grouped GEMM cuts its splits (the
    launcher and kernels/fused_moe.py refuse anything else); examples: Qwen3-30B-A3B's H 2048 in 4,
    its I 768 in 2, GPT-OSS's 2880 in one. The grouped GEMM takes these splits on the GPU's 16-bit
    x, one elsewhere."""
    from minisgl.ops.gemm.skinny import DETERMINISTIC_TILE

    for k in range(8, 20000, 8):
        up, down = skinny_moe.deterministic_configs(k, k)
        assert up == down and up.tile == DETERMINISTIC_TILE and up.splits == 1, k
        s = up.warps
        assert s == 1 or (k % (128 * s) == 0 and k // s >= skinny_moe.MIN_SPLIT_K), (k, s)
        assert s == 8 or k % (256 * s) or k // (2 * s) < skinny_moe.MIN_SPLIT_K, f"K {k}: {s} splits could double"
    assert skinny_moe.deterministic_configs(2048, 768) == (SkinnyConfig(DETERMINISTIC_TILE, 4, 1),
                                                           SkinnyConfig(DETERMINISTIC_TILE, 2, 1))
    assert skinny_moe.deterministic_configs(2880, 2880) == (SkinnyConfig(DETERMINISTIC_TILE, 1, 1),) * 2
    assert skinny_moe.deterministic_splits(torch.ones(1, 8, dtype=torch.bfloat16), 2048, 768) == (1, 1)


def test_cpu_tensors_never_take_the_kernel() -> None:
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w13, w2 = torch.randn(4, 64, 64, dtype=torch.bfloat16), torch.randn(4, 64, 32, dtype=torch.bfloat16)
    assert not skinny_moe.fits(x, w13, w2, 2, None)


def test_shared_expert_fits_except_in_deterministic_mode(monkeypatch) -> None:
    """With the kernel present (stubbed here), a shared expert's layer takes the kernels (the shared
    row joins in the top-k sum); in deterministic mode it keeps the Triton path at every token count."""
    monkeypatch.setattr(skinny_moe, "use_cuda_kernel", lambda name, x: True)
    monkeypatch.setattr(skinny_moe, "compiled", lambda: type("C", (), {"skinny_moe": None})())
    x = torch.randn(1, 64, dtype=torch.bfloat16)
    w13, w2 = torch.randn(4, 64, 64, dtype=torch.bfloat16), torch.randn(4, 64, 32, dtype=torch.bfloat16)
    shared = torch.randn(1, 64, dtype=torch.bfloat16)
    assert skinny_moe.fits(x, w13, w2, 2, None) and skinny_moe.fits(x, w13, w2, 2, shared)
    monkeypatch.setattr(skinny_moe, "is_deterministic", lambda device: True)
    assert skinny_moe.fits(x, w13, w2, 2, None) and not skinny_moe.fits(x, w13, w2, 2, shared)
    with pytest.raises(ValueError, match="shared expert"):
        skinny_moe.experts(x, w13, w2, torch.ones(1, 2), torch.zeros(1, 2, dtype=torch.int32), shared=shared,
                           shared_gate=torch.zeros(1, 1))


@gpu
@pytest.mark.parametrize("tokens", [1, 2, 3])
@pytest.mark.parametrize("with_shared", [False, True])
def test_moe_layer_routes_with_its_router_in_one_kernel(monkeypatch, tokens: int, with_shared: bool) -> None:
    """ops.fused_moe_layer (the router GEMM included) against the router through ops.linear and
    then fused_moe, GPT-OSS-style (router bias, expert biases, clamped SwiGLU): the same routing
    and outputs within bf16 rounding; the one-kernel routing runs where the skinny experts do."""
    from minisgl import ops
    from minisgl.kernels import moe_routing

    used = []
    real = moe_routing.route_linear
    monkeypatch.setattr(moe_routing, "route_linear", lambda *a, **k: used.append(a[0].shape[0]) or real(*a, **k))
    dtype = torch.bfloat16
    x, w13, w2, _, _, b13, b2 = _case(tokens, 4, 32, 512, 256, dtype, True, seed=21, poison=False)
    g = torch.Generator(device="cuda").manual_seed(4)
    gate_w = torch.randn(32, 512, generator=g, device="cuda").to(dtype) / 8
    gate_b = torch.randn(32, generator=g, device="cuda").to(dtype)
    act = ExpertAct("gpt_oss", 1.702, 7.0)
    extra, added = _shared(tokens, 512, dtype, seed=tokens) if with_shared else ({}, 0)
    out = ops.fused_moe_layer(x, gate_w, gate_b, w13, w2, 4, True, b13=b13, b2=b2, act=act, **extra)
    logits = ops.linear(x, gate_w, gate_b)
    weights, ids = ops.moe_route(logits, 4, True)
    _check(out, _reference(x, w13, w2, weights, ids, b13, b2, act, dtype) + added, dtype)
    assert used == ([tokens] if tokens <= skinny_moe.MAX_TOKENS else [])


def _case_w4(fmt: int, tokens, top_k, experts, hidden, inter, group, biases, seed):
    """Random 4-bit experts in the kernels/quant4.py layouts, and their fp32 dequantisation (the
    reference's weights). The unused experts are poisoned: INT4 scales NaN; MXFP4 e8m0 253
    (2^126), so a wrong expert's read turns the output to NaN / inf (GPT-OSS's clamped SwiGLU
    turns those into +-limit in the up projection; the comparison with the reference then fails)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    dev, dtype = "cuda", torch.bfloat16
    x = torch.randn(tokens, hidden, generator=g, device=dev).to(dtype)
    ids = torch.stack([torch.randperm(experts, generator=g, device=dev)[:top_k] for _ in range(tokens)]).int()
    weights = torch.rand(tokens, top_k, generator=g, device=dev) + 0.1
    unused = torch.ones(experts, dtype=torch.bool, device=dev)
    unused[ids.long().flatten()] = False
    mats = []
    for n, k in ((2 * inter, hidden), (hidden, inter)):
        if fmt == W4.INT4:
            w = pack_int4(torch.randint(0, 16, (experts, n, k), generator=g, device=dev))
            s = (torch.rand(experts, n, k // group, generator=g, device=dev) * 0.4 / k**0.5 + 0.05 / k**0.5).to(dtype)
            z = torch.randint(0, 16, (experts, n, k // group), generator=g, device=dev).to(dtype)
            ref = dequant_int4_reference(w, s, z)
            s[unused] = float("nan")
        else:
            w = torch.randint(0, 256, (experts, n, k // 2), generator=g, device=dev, dtype=torch.uint8)
            s = torch.randint(118, 123, (experts, n, k // 32), generator=g, device=dev, dtype=torch.uint8)
            z = None
            ref = dequant_mxfp4_reference(w, s)
            s[unused] = 253
        mats.append((w, s, z, ref))
    b13 = (torch.randn(experts, 2 * inter, generator=g, device=dev) * 0.5).to(dtype) if biases else None
    b2 = (torch.randn(experts, hidden, generator=g, device=dev) * 0.5).to(dtype) if biases else None
    (w13, s13, z13, r13), (w2, s2, z2, r2) = mats
    quant = skinny_moe.Quant4(fmt, s13, z13, s2, z2)
    return x, w13, w2, weights, ids.contiguous(), b13, b2, quant, r13, r2


def _check_finite(out, ref):
    assert out.isfinite().all(), "NaN / inf: a block read an expert no token chose"
    _check(out, ref, torch.bfloat16)


@gpu
@pytest.mark.parametrize("fmt,group", [(W4.INT4, 128), (W4.INT4, 32), (W4.INT4, 64), (W4.MXFP4, 32)])
@pytest.mark.parametrize("tokens,top_k,experts", [(1, 1, 4), (1, 8, 64), (2, 4, 32)])
@pytest.mark.parametrize("gpt_oss", [False, True])
def test_w4_experts_match_the_dequantised_reference(fmt: int, group: int, tokens: int, top_k: int, experts: int,
                                                    gpt_oss: bool) -> None:
    """4-bit experts (ops/gemm/w4.py fused_moe_w4's skinny path): H = 384 and I = 192 (224 at group
    32) end mid-tile and split unevenly; the group is that of w13 (at group 128, w2's one scale
    column makes its group the whole I = 192)."""
    hidden, inter = 384, 192 + 32 * (group == 32)
    x, w13, w2, weights, ids, b13, b2, quant, r13, r2 = _case_w4(fmt, tokens, top_k, experts, hidden, inter, group,
                                                                  gpt_oss, seed=tokens + top_k)
    act = ExpertAct("gpt_oss", 1.702, 7.0) if gpt_oss else None
    out = skinny_moe.experts(x, w13, w2, weights, ids, b13, b2, act, quant=quant)
    _check_finite(out, _reference(x, r13, r2, weights, ids, b13, b2, act, torch.bfloat16))


@gpu
@pytest.mark.parametrize("fmt", [W4.INT4, W4.MXFP4])
@pytest.mark.parametrize("up,down", [("t0w1s1", "t0w1s1"), ("t1w4s3", "t1w8s2"), ("t2w2s1", "t2w4s4"),
                                     ("t3w8s2", "t3w2s4")])
def test_w4_every_tile_warp_and_split(fmt: int, up: str, down: str) -> None:
    # H, I multiples of 32 (the 4-bit loads) but not of 128 (a warp group's K)
    x, w13, w2, weights, ids, b13, b2, quant, r13, r2 = _case_w4(fmt, 1, 4, 16, 736, 672, 32, True, seed=9)
    act = ExpertAct("gpt_oss", 1.702, 7.0)
    out = skinny_moe.experts(x, w13, w2, weights, ids, b13, b2, act, SkinnyConfig.parse(up), SkinnyConfig.parse(down),
                             quant=quant)
    _check_finite(out, _reference(x, r13, r2, weights, ids, b13, b2, act, torch.bfloat16))


@gpu
@pytest.mark.parametrize("fmt", ["int4", "mxfp4"])
def test_fused_moe_w4_takes_the_skinny_path_up_to_max_tokens(monkeypatch, fmt: str) -> None:
    """ops.gemm.w4.fused_moe_w4 runs 1..MAX_TOKENS tokens on the skinny kernel and more on the
    Triton fused MoE; both against the dequantised reference, with GPT-OSS's biases and act."""
    calls = []
    real = skinny_moe.experts
    monkeypatch.setattr(skinny_moe, "experts", lambda *a, **k: calls.append(a[0].shape[0]) or real(*a, **k))
    f = W4.INT4 if fmt == "int4" else W4.MXFP4
    act = ExpertAct("gpt_oss", 1.702, 7.0)
    for t in (1, skinny_moe.MAX_TOKENS, skinny_moe.MAX_TOKENS + 1):
        x, w13, w2, weights, ids, b13, b2, q, r13, r2 = _case_w4(f, t, 4, 16, 256, 128, 128 if f == W4.INT4 else 32,
                                                                  True, seed=t)
        # every expert live (the Triton path's grouped GEMM, past MAX_TOKENS, may read any expert's
        # tiles); the poisoned cases are the tests above
        if f == W4.INT4:
            q.s13.nan_to_num_(0.01)
            q.s2.nan_to_num_(0.01)
        else:
            q.s13.clamp_(max=122)
            q.s2.clamp_(max=122)
        r13 = dequant_int4_reference(w13, q.s13, q.z13) if f == W4.INT4 else dequant_mxfp4_reference(w13, q.s13)
        r2 = dequant_int4_reference(w2, q.s2, q.z2) if f == W4.INT4 else dequant_mxfp4_reference(w2, q.s2)
        out = w4_ops.fused_moe_w4(x, fmt, w13, q.s13, q.z13, w2, q.s2, q.z2, weights, ids, b13=b13, b2=b2, act=act)
        _check_finite(out, _reference(x, r13, r2, weights, ids, b13, b2, act, torch.bfloat16))
    assert calls == [1, skinny_moe.MAX_TOKENS]
