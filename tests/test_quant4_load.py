"""4-bit loading units on the CPU: quantization_config parsing and refusals, the layers' TP shards
of INT4 weights (N and K splits, fused parts, act-order), the MXFP4 layout of GPT-OSS blocks, and
ops.linear's fp32 references for the 4-bit formats, each against an independent computation."""

from __future__ import annotations

import pytest
import quant4_checkpoints as ck
import torch
import torch.nn.functional as F

from minisgl import ops
from minisgl.core.quant_config import from_hf
from minisgl.distributed.info import TPInfo
from minisgl.kernels.quant4 import E2M1_VALUES, pack_int4
from minisgl.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from minisgl.layers.quant4_load import mxfp4_layout


def ct(weights: dict, **extra) -> dict:
    group = {"targets": ["Linear"], "weights": weights, "input_activations": None, "format": "pack-quantized"}
    return {"quant_method": "compressed-tensors", "config_groups": {"g": group}, **extra}


def test_configs_parse_and_refuse_by_name() -> None:
    q = from_hf({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "GEMM",
                 "modules_to_not_convert": ["lm_head"]})
    assert (q.fmt, q.packing, q.group, q.sym, q.ignore) == ("int4", "awq", 128, False, ("lm_head",))
    q = from_hf({"quant_method": "gptq", "bits": 4, "group_size": -1, "desc_act": True, "sym": False,
                 "checkpoint_format": "gptq_v2"})
    assert (q.packing, q.group, q.sym, q.desc_act) == ("gptq_v2", 0, False, True)
    w = {"num_bits": 4, "type": "int", "strategy": "channel", "symmetric": False}
    assert (from_hf(ct(w)).packing, from_hf(ct(w)).sym) == ("pack-quantized", False)
    assert from_hf({"quant_method": "mxfp4"}).fmt == "mxfp4"
    refused = [
        ({"quant_method": "awq", "bits": 4, "version": "gemv"}, "version 'gemv'"),
        ({"quant_method": "gptq", "bits": 8}, "8-bit"),
        ({"quant_method": "gptq", "bits": 4, "checkpoint_format": "marlin"}, "'marlin'"),
        ({"quant_method": "gptq", "bits": 4, "group_size": 100}, "group_size 100"),
        ({"quant_method": "gptq", "bits": 4, "dynamic": {"-:.*down": {}}}, "'dynamic'"),
        ({"quant_method": "bitsandbytes"}, "'bitsandbytes'"),
        (ct({**w, "strategy": "group", "group_size": 128, "actorder": "group"}), "actorder"),
        (ct({**w, "strategy": "tensor"}), "strategy 'tensor'"),
        (ct(w, format="int-quantized") | {"config_groups": {"g": {"targets": ["Linear"], "weights": w}}},
         "'int-quantized'"),
    ]
    for qc, match in refused:
        with pytest.raises(ValueError, match=match):
            from_hf(qc)


def _parts(fmt: str, ws: list[torch.Tensor], group: int, perm: torch.Tensor | None):
    out = [ck._module(fmt, w, group, False, perm) for w in ws]
    return [t for t, _ in out], torch.cat([d for _, d in out])


@pytest.mark.parametrize(("fmt", "group", "act_order"),
                         [("awq", 32, False), ("gptq", 64, False), ("gptq_v2", 32, True),
                          ("compressed-tensors", 64, False), ("compressed-tensors", -1, False)])
def test_tp_shards_sum_to_the_dequantized_layer(fmt: str, group: int, act_order: bool) -> None:
    """Column-parallel gate/up (N split) and row-parallel down (K split) over 2 ranks: the ranks'
    outputs, concatenated or summed, equal x @ W^T of the dequantized weights."""
    torch.manual_seed(0)
    h, inter = 128, 256
    q = from_hf(ck.quant_config(fmt, group, False, act_order, []))
    perm = torch.randperm(h) if act_order else None
    gate_up, w13 = _parts(fmt, [torch.randn(inter, h), torch.randn(inter, h)], group, perm)
    down, w2 = _parts(fmt, [torch.randn(h, inter)], group, None)
    x, xi = torch.randn(3, h), torch.randn(3, inter)
    ys, partial = [], torch.zeros(3, h)
    for rank in range(2):
        tp = TPInfo(rank, 2)
        col = MergedColumnParallelLinear(h, [inter, inter], False, tp, quant=q)
        for part, tensors in enumerate(gate_up):
            for kind, t in reversed(tensors.items()):  # any order
                col.load_part(f"m.p{part}.{kind}", kind, t, part)
        ys.append(col(x).split(inter // 2, dim=1))
        row = RowParallelLinear(inter, h, False, tp, comm=None, reduce=False, quant=q)
        for kind, t in down[0].items():
            row.load(f"m.down.{kind}", kind, t)
        partial += row.partial(xi[:, row.in_start : row.in_start + row.local_in])
    got = torch.cat([ys[0][0], ys[1][0], ys[0][1], ys[1][1]], dim=1)  # (gate r0 | gate r1 | up r0 | up r1)
    torch.testing.assert_close(got, x @ w13.t(), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(partial, xi @ w2.t(), rtol=1e-5, atol=1e-5)


def test_k_shards_off_group_boundaries_and_act_order_splits_are_refused() -> None:
    q = from_hf(ck.quant_config("gptq", 128, True, False, []))
    with pytest.raises(ValueError, match="groups of 128"):
        RowParallelLinear(384, 64, False, TPInfo(1, 2), comm=None, reduce=False, quant=q)  # K shard at 192
    q = from_hf(ck.quant_config("gptq", 32, True, True, []))
    row = RowParallelLinear(128, 64, False, TPInfo(0, 2), comm=None, reduce=False, quant=q)
    parts, _ = ck._module("gptq", torch.randn(64, 128), 32, True, torch.randperm(128))
    with pytest.raises(ValueError, match="act-order"):
        for kind, t in parts.items():
            row.load(f"m.down.{kind}", kind, t)


def test_bad_tensors_name_themselves() -> None:
    q = from_hf(ck.quant_config("awq", 32, False, False, []))
    parts, _ = ck._module("awq", torch.randn(64, 64), 32, False, None)
    row = RowParallelLinear(64, 64, False, TPInfo(0, 1), comm=None, reduce=False, quant=q)
    row.load("m.o.scales", "scales", parts["scales"])
    row.load("m.o.qzeros", "qzeros", parts["qzeros"])
    with pytest.raises(ValueError, match=r"m\.o\.qweight has dtype torch\.float32"):
        row.load("m.o.qweight", "qweight", parts["qweight"].float())
    with pytest.raises(ValueError, match="unexpected tensor m.o.g_idx"):
        row.load("m.o.g_idx", "g_idx", torch.zeros(64, dtype=torch.int32))


def test_mxfp4_layout_of_gpt_oss_blocks() -> None:
    """GPT-OSS blocks [E, N, K/32, 16] + e8m0 scales -> kernels/quant4.py's layout, dequantized by
    hand here: element k of row n is the nibble (k % 2: high) of byte k // 2 of its 32-block."""
    g = torch.Generator().manual_seed(1)
    e, n, k = 2, 5, 64
    blocks = torch.randint(0, 256, (e, n, k // 32, 16), dtype=torch.uint8, generator=g)
    scales = torch.randint(120, 134, (e, n, k // 32), dtype=torch.uint8, generator=g)
    b, s = mxfp4_layout("experts.gate_up_proj", blocks, scales)
    assert b.shape == (e, n, k // 2) and s.shape == (e, n, k // 32)
    want = torch.empty(e, n, k)
    for i in range(k):
        byte = blocks[..., i // 32, (i % 32) // 2].long()
        nib = (byte >> 4) if i % 2 else (byte & 0xF)
        want[..., i] = torch.tensor(E2M1_VALUES)[nib] * 2.0 ** (scales[..., i // 32].float() - 127)
    x = torch.randn(3, k)
    for j in range(e):
        torch.testing.assert_close(ops.linear(x, b[j], fmt="mxfp4", scale=s[j]), x @ want[j].t())
    with pytest.raises(ValueError, match="do not match"):
        mxfp4_layout("x", blocks, scales[..., :1])


def test_int4_linear_reference_with_bias_and_silu() -> None:
    g = torch.Generator().manual_seed(2)
    n, k, group = 48, 64, 16
    q = torch.randint(0, 16, (n, k), generator=g)
    s, z = torch.rand(n, k // group, generator=g) + 0.1, torch.randint(0, 16, (n, k // group), generator=g).float()
    w = (q - z.repeat_interleave(group, 1)) * s.repeat_interleave(group, 1)
    x, b = torch.randn(5, k, generator=g), torch.randn(n, generator=g)
    got = ops.linear(x, pack_int4(q), b, True, fmt="int4", scale=s, zeros=z)
    gate, up = F.linear(x, w, b).chunk(2, dim=-1)
    torch.testing.assert_close(got, F.silu(gate) * up)
    with pytest.raises(ValueError, match="weight format 'int3'"):
        ops.linear(x, w, fmt="int3")
