"""FP8 loading, fast: quantization_config parsing, bad checkpoints (each a clear error at load),
the pre-sm_89 check, and TP sharding of FP8 weights with their block scales."""

from __future__ import annotations

import json
from pathlib import Path
from unittest import mock

import fp8_checkpoints as ck
import pytest
import torch
from safetensors.torch import load_file, save_file

from minisgl import LLM
from minisgl.core.quant_config import from_hf, resolve
from minisgl.distributed.info import TPInfo
from minisgl.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from minisgl.ops.gemm.fp8 import FP8, check_fp8_device, dequantize, quantize_blocks, quantize_rows


def test_formats_parse() -> None:
    block = from_hf(ck.quant_config("block", ["lm_head"]))
    assert (block.weights, block.scale_name, block.block_k) == ("block", "weight_scale_inv", 128)
    tensor = from_hf(ck.quant_config("tensor", []))
    assert (tensor.weights, tensor.scale_name, tensor.static_input) == ("tensor", "weight_scale", True)
    ct = from_hf(ck.quant_config("channel", ["lm_head", "re:.*mlp\\.gate$"]))
    assert (ct.method, ct.weights, ct.block_k) == ("compressed-tensors", "channel", 0)
    assert not ct.quantizes("lm_head") and not ct.quantizes("model.layers.3.mlp.gate")
    assert ct.quantizes("model.layers.3.mlp.gate_proj")
    assert from_hf(None) is None and resolve(None, "fp8").online and resolve(block, "fp8") is block


@pytest.mark.parametrize(
    ("qc", "match"),
    [
        ({"quant_method": "hqq", "bits": 4}, "'hqq' is not supported"),
        ({"quant_method": "fp8", "weight_block_size": [64, 64]}, r"weight_block_size \[64, 64\]"),
        ({"quant_method": "fp8", "fmt": "e5m2"}, "'e5m2'"),
        ({"quant_method": "compressed-tensors", "config_groups": {"g": {
            "targets": ["Linear"], "weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}}},
         "8-bit 'int'"),
    ],
)
def test_unsupported_configs_are_refused(qc: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        from_hf(qc)


@pytest.fixture(scope="module")
def block_folder(tiny_model_path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return ck.write_fp8(tiny_model_path("llama3"), tmp_path_factory.mktemp("fp8") / "block", "block")


def _edit(folder: Path, out: Path, drop: str | None = None, config: dict | None = None) -> Path:
    import shutil

    shutil.copytree(folder, out)
    if drop is not None:
        tensors = load_file(str(out / "model.safetensors"))
        del tensors[drop]
        save_file(tensors, str(out / "model.safetensors"))
    if config is not None:
        cfg = json.loads((out / "config.json").read_text())
        cfg["quantization_config"] = config
        (out / "config.json").write_text(json.dumps(cfg))
    return out


def test_missing_scale_is_named(block_folder: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight_scale_inv"
    with pytest.raises(ValueError, match=f"tensor {name} is missing"):
        LLM(str(_edit(block_folder, tmp_path / "f", drop=name)), device="cpu", dtype="float32")


def test_unknown_method_at_load(block_folder: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="'bitsandbytes' is not supported"):
        LLM(str(_edit(block_folder, tmp_path / "f", config={"quant_method": "bitsandbytes"})), device="cpu")


def test_fp8_tensor_in_an_ignored_module(block_folder: Path, tmp_path: Path) -> None:
    cfg = ck.quant_config("block", ["model.layers.0.self_attn.o_proj"])
    with pytest.raises(ValueError, match="o_proj.weight is FP8, but its module is not FP8"):
        LLM(str(_edit(block_folder, tmp_path / "f", config=cfg)), device="cpu", dtype="float32")


def test_ignore_list_splitting_a_fused_layer(block_folder: Path, tmp_path: Path) -> None:
    cfg = ck.quant_config("block", ["model.layers.0.self_attn.k_proj"])
    with pytest.raises(ValueError, match="all quantized or all 16-bit"):
        LLM(str(_edit(block_folder, tmp_path / "f", config=cfg)), device="cpu", dtype="float32")


def test_pre_sm89_gpu_is_refused() -> None:
    with (mock.patch("torch.cuda.get_device_capability", return_value=(8, 0)),
          mock.patch("torch.cuda.get_device_name", return_value="NVIDIA A100")):
        with pytest.raises(ValueError, match="FP8 support.*A100 is 8.0"):
            check_fp8_device(torch.device("cuda", 0))
    with mock.patch("torch.cuda.get_device_capability", return_value=(9, 0)):
        check_fp8_device(torch.device("cuda", 0))


def _full_block(n: int, k: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w = torch.randn(n, k, generator=gen) * torch.logspace(-3, 2, n)[:, None]  # tiny and huge scales
    q, s = quantize_blocks(w)
    return q, s, dequantize(q, s.repeat_interleave(128, 0)[:n], 128)


def test_tp_shards_block_scales_consistently() -> None:
    """Each rank's dequantized shard equals the same slice of the full dequantized weight."""
    cfg = from_hf(ck.quant_config("block", []))
    hidden, heads, kv, d, inter = 256, 8, 2, 32, 384
    parts = {n: _full_block(rows, hidden, i) for i, (n, rows) in enumerate(
        [("q", heads * d), ("k", kv * d), ("v", kv * d), ("gate", inter), ("up", inter)])}
    down = _full_block(hidden, inter * 2, 9)  # K = 768: ranks split it at 384 = 3 blocks
    for rank in range(2):
        tp = TPInfo(rank, 2)
        qkv = QKVParallelLinear(hidden, d, heads, kv, False, tp, quant=cfg)
        gu = MergedColumnParallelLinear(hidden, [inter, inter], False, tp, quant=cfg)
        row = RowParallelLinear(inter * 2, hidden, False, tp, comm=None, quant=cfg)
        for layer, names in ((qkv, "qkv"), (gu, ["gate", "up"])):
            for i, n in enumerate(names):
                q, s, _ = parts[n]
                layer.load_part(n, "weight_scale", s, i)
                layer.load_part(n, "weight", q, i)
        row.load("down", "weight", down[0])
        row.load("down", "weight_scale", down[1])
        for layer, names in ((qkv, "qkv"), (gu, ["gate", "up"])):
            got = dequantize(layer.weight, layer.weight_scale, 128)
            want = torch.cat([parts[n][2].chunk(2)[rank] for n in names])
            torch.testing.assert_close(got, want, rtol=0, atol=0)
        got = dequantize(row.weight, row.weight_scale, 128)
        torch.testing.assert_close(got, down[2].chunk(2, dim=1)[rank], rtol=0, atol=0)
    with pytest.raises(ValueError, match="inside a 128 x 128 FP8 scale block"):
        RowParallelLinear(320, hidden, False, TPInfo(1, 2), comm=None, quant=cfg)


def test_online_quantization_round_trip() -> None:
    w = torch.randn(64, 200) * torch.logspace(-6, 3, 64)[:, None]
    w[3] = 0.0
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.shape == (64, 1) and torch.isfinite(q.float()).all()
    err = (dequantize(q, s, 200) - w).abs() / w.abs().amax(dim=1, keepdim=True).clamp_min(1e-30)
    assert err.max() <= 2**-4  # e4m3: 3 mantissa bits, relative to each row's max
