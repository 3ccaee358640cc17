"""Checkpoint streaming: Hugging Face safetensors (single file or sharded), tensor by tensor."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import safe_open


def safetensors_files(folder: Path) -> list[Path]:
    index = folder / "model.safetensors.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text()).get("weight_map")
        if not weight_map:
            raise ValueError(f"{index} has no weight_map")
        files = sorted({folder / f for f in weight_map.values()})
        for f in files:
            if not f.exists():
                raise ValueError(f"shard {f.name} listed in {index.name} is missing")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors weights in {folder}")
    return files


def iter_safetensors(folder: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yields (name, tensor) one tensor at a time, so peak host memory is one tensor."""
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt", device="cpu") as fh:
            for name in fh.keys():
                yield name, fh.get_tensor(name)


def fill_dummy(model: torch.nn.Module, seed: int = 0) -> None:
    """Random weights of the real shapes (benchmarks without checkpoints). Norm weights are
    ones and other weights small, so activations stay in a realistic range. FP8 layers get
    e4m3 values uniform in [-448, 448] and scales 0.02 / 448 (the same range dequantized); INT4
    layers random nibbles, zeros 8 and scales 0.02 / 8 (likewise); MXFP4 experts random bytes and
    scales 2^-8."""
    gens: dict[torch.device, torch.Generator] = {}
    params = dict(model.named_parameters())
    for name, p in model.named_parameters():
        if "norm" in name:
            p.data.fill_(1.0)
            continue
        packed = params.get(name.removesuffix("_scale").removesuffix("_zero"))
        if name.endswith(("_scale", "_zero")) and packed is not None and packed.dtype == torch.int32:
            p.data.fill_(8.0 if name.endswith("_zero") else 0.02 / 8)  # INT4: (q - 8) * s within +-0.02
            continue
        if name.endswith("_scale") and packed is not None and packed.dtype == torch.uint8:
            p.data.fill_(119)  # MXFP4 e8m0 2^-8: e2m1 values (|v| <= 6) times it within +-0.024
            continue
        if p.dtype == torch.uint8:  # MXFP4 bytes: two e2m1 values each, every code equally likely
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.data.random_(0, 256, generator=gen)
            continue
        if p.dtype == torch.int32:  # INT4 words: every nibble uniform in 0..15
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            p.data.random_(-(2**31), 2**31 - 1, generator=gen)
            continue
        if name.endswith(".weight_scale"):
            p.data.fill_(0.02 / 448.0)
            continue
        if p.dtype == torch.float8_e4m3fn:  # drawn in fp16, one row block at a time (bounded temporary)
            gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
            for rows in p.data.split(4096):
                tmp = torch.empty(rows.shape, dtype=torch.float16, device=p.device).uniform_(-448, 448, generator=gen)
                rows.copy_(tmp)
            continue
        # Drawn where the weight lives (an 8B model in seconds on a GPU), in its dtype.
        gen = gens.setdefault(p.device, torch.Generator(device=p.device).manual_seed(seed))
        p.data.uniform_(-0.02, 0.02, generator=gen)
