"""Tile configs of the fused MoE GEMMs: tuned ones from fused_moe_configs.json, else a default.

The JSON (written by benchmarks/kernels/tune_fused_moe.py on the GPU it describes) maps
  device name -> "E=..,top_k=..,I=..,H=..,dtype=..[,w=int4g<group>|mxfp4]" -> M (tokens) -> config
where I is the per-rank expert intermediate size, w the 4-bit experts' format, and a config is
  {"block_m": .., "up": {block_n, block_k, group_m, num_warps, num_stages}, "down": {...}}.
A lookup rounds T up to a power of two and takes the smallest tuned M at or above it (the
largest tuned M past all of them). The rounding is the invariant CUDA graphs need: a decode
batch padded to its graph size (the smallest of 1, 2, 4, 8 and multiples of 16 that holds it)
rounds to the same power of two as the batch itself, so eager and graphed steps run the same
tiles and give bitwise the same rows. BLOCK_M is shared by both GEMMs: they read the same
alignment. use_config_file() points the
lookups at another JSON (a fresh tuning run, before it is committed and installed).
"""

from __future__ import annotations

import functools
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

CONFIG_FILE = Path(__file__).with_name("fused_moe_configs.json")
_config_file = CONFIG_FILE


@dataclass(frozen=True)
class GemmTile:
    block_n: int
    block_k: int
    group_m: int = 1
    num_warps: int = 4
    num_stages: int = 3


@dataclass(frozen=True)
class MoeTileConfig:
    block_m: int
    up: GemmTile
    down: GemmTile

    def to_dict(self) -> dict:
        return {"block_m": self.block_m, "up": asdict(self.up), "down": asdict(self.down)}

    @staticmethod
    def from_dict(d: dict) -> MoeTileConfig:
        return MoeTileConfig(int(d["block_m"]), GemmTile(**d["up"]), GemmTile(**d["down"]))


def weights_key(fmt: str | None, group: int) -> str | None:
    """shape_key's `weights` for experts in a 4-bit format: "int4g<group>" (the group decides how
    often the K loop loads scales, kernels/w4a16_gemm.scale_span, and so the best tile) or "mxfp4";
    None for 16-bit experts."""
    return None if fmt is None else f"int4g{group}" if fmt == "int4" else fmt


def shape_key(num_experts: int, top_k: int, inter: int, hidden: int, dtype: torch.dtype,
              weights: str | None = None) -> str:
    """weights: the experts' 4-bit format (weights_key; their tiles are tuned apart: the
    dequantisation in the K loop moves the best tile, and the 16-bit tiles' deepest pipelines
    overflow shared memory with it), None for 16-bit experts."""
    key = f"E={num_experts},top_k={top_k},I={inter},H={hidden},dtype={str(dtype).removeprefix('torch.')}"
    return key if weights is None else f"{key},w={weights}"


@functools.cache
def load_configs(path: Path) -> dict:
    if not path.exists():
        return {}
    return json.loads(path.read_text())


def use_config_file(path: Path) -> None:
    global _config_file
    if not path.exists():
        raise ValueError(f"fused MoE config file {path} does not exist")
    _config_file = path


def token_bucket(num_tokens: int) -> int:
    return 1 << max(0, num_tokens - 1).bit_length()


def default_config(num_experts: int, top_k: int, num_tokens: int, dtype: torch.dtype) -> MoeTileConfig:
    """Untuned: BLOCK_M near the mean rows per expert; narrow N tiles while few rows (more
    programs to stream the weights), wide ones when the GEMMs are compute-bound. Shared memory
    stays under ~100 KB (any sm_80+ GPU)."""
    if dtype == torch.float32:  # ieee dots run on the FMA units: small tiles
        return MoeTileConfig(16, GemmTile(32, 32), GemmTile(32, 32))
    per_expert = token_bucket(num_tokens) * top_k / num_experts
    if per_expert <= 16:
        return MoeTileConfig(16, GemmTile(32, 128, 1, 4, 4), GemmTile(64, 128, 1, 4, 4))
    if per_expert <= 64:
        return MoeTileConfig(32, GemmTile(64, 64, 1, 4, 4), GemmTile(64, 64, 1, 4, 4))
    return MoeTileConfig(64, GemmTile(64, 64, 8, 4, 4), GemmTile(128, 64, 8, 4, 3))


def is_tuned(num_experts: int, top_k: int, inter: int, hidden: int, dtype: torch.dtype, device_name: str | None,
             weights: str | None = None) -> bool:
    key = shape_key(num_experts, top_k, inter, hidden, dtype, weights)
    return key in load_configs(_config_file).get(device_name or "", {})


def get_config(num_experts: int, top_k: int, inter: int, hidden: int, num_tokens: int, dtype: torch.dtype,
               device_name: str | None, weights: str | None = None) -> MoeTileConfig:
    key = shape_key(num_experts, top_k, inter, hidden, dtype, weights)
    table = load_configs(_config_file).get(device_name or "", {}).get(key)
    if not table:
        return default_config(num_experts, top_k, num_tokens, dtype)
    sizes = _tuned_sizes(_config_file, device_name or "", key)
    bucket = token_bucket(num_tokens)
    return MoeTileConfig.from_dict(table[str(next((m for m in sizes if m >= bucket), sizes[-1]))])


@functools.cache  # an eager MoE call asks per layer; the file's table does not change once loaded
def _tuned_sizes(path: Path, device_name: str, key: str) -> tuple[int, ...]:
    """The token counts a shape's tuned entries were measured at, ascending."""
    return tuple(sorted(int(m) for m in load_configs(path)[device_name][key]))
