"""4-bit experts (kernels/fused_moe.py's grouped GEMMs with the 4-bit loader, through ops/gemm/w4.py
fused_moe_w4, and every tuned tile of this GPU) against a per-expert loop over weights built and
dequantised in test_w4_kernels.py (not through kernels/quant4.py), on fresh random data."""

from __future__ import annotations

import pytest
import torch
from test_w4_kernels import DEV, assert_close, gpu, make_int4, make_mxfp4

from minisgl.kernels import fused_moe as G
from minisgl.ops.gemm import w4


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
