"""The GEMM dispatch table, one for every weight format: for each (dtype, N, K, SiLU, M) a
measured choice between the format's large-batch path (spelled "cublas": cuBLAS for 16-bit
weights, the FP8 GEMM for FP8 ones) and one of the skinny template's launch configurations, and
its on-disk cache. The dtype field names the activations and the weight format: "bfloat16" for
a 16-bit weight, "bfloat16-fp8chan" / "bfloat16-fp8block" for FP8 ones, "bfloat16-int4g128"
(INT4 with its group size: groups of a multiple of 128 take another loader path) and
"bfloat16-mxfp4" for 4-bit ones, whose large-batch path is the decode to 16 bits + cuBLAS
(`table_dtype`).

Pure logic (no device work here: ops/gemm/tuning.py measures, ops/gemm/dispatch.py looks up),
so all of it is tested on the CPU. A shape the table does not hold goes to the large-batch
path: the choice is always a measurement, never a guess.
"""

from __future__ import annotations

import bisect
import functools
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, NamedTuple

from minisgl.ops.gemm.skinny import DENSE, FP8_FORMAT, MAX_SPLITS, SkinnyConfig

if TYPE_CHECKING:
    import torch

CUBLAS = "cublas"
# Bump when the kernel or the candidate rules change: cached tables of older kernels are ignored.
TABLE_VERSION = 2
# Ours must beat cuBLAS by this fraction to be chosen: repeated timings of one kernel differ
# by about 1%, and a flip on noise would make the choice unstable from run to run.
MARGIN = 0.01
# (tile, warps) pairs timed at engine start, each with the K splits `split_counts` allows.
# From `benchmarks/kernels/skinny_gemm.py --sweep` (its "candidate set" line).
CANDIDATE_PAIRS: tuple[tuple[int, int], ...] = ((1, 4), (0, 4), (2, 4), (1, 8))
# FP8: every tile at 4 warps, and tile 0 at 8. Not yet swept on a GPU
# (benchmarks/kernels/fp8_gemm.py prints the best of each per shape and M).
FP8_CANDIDATE_PAIRS: tuple[tuple[int, int], ...] = ((0, 4), (1, 4), (2, 4), (3, 4), (0, 8))
# 4-bit (INT4 and MXFP4 share the tiles): every tile at 4 and 8 warps. The launch sweep
# (`benchmarks/kernels/w4_gemm.py --sweep`, RESULTS.md twelfth session) found t0w8, t2w8, t1w4 and
# t1w8 best on Llama-3.1-8B's layers, up to 38% faster than default_config's launch; after the
# steady K loop, t3w8 for INT4 o_proj and down_proj at M 1 (twenty-first session; t3w8 was missing here).
W4_CANDIDATE_PAIRS: tuple[tuple[int, int], ...] = ((0, 4), (1, 4), (2, 4), (3, 4), (0, 8), (1, 8), (2, 8), (3, 8))
INT4, MXFP4 = "int4", "mxfp4"
PAIRS = {DENSE: CANDIDATE_PAIRS, FP8_FORMAT: FP8_CANDIDATE_PAIRS, INT4: W4_CANDIDATE_PAIRS, MXFP4: W4_CANDIDATE_PAIRS}
SPLITS = (1, 2, 4, 8)


class GemmCall(NamedTuple):
    """One GEMM a model runs, as the layers list it for the tuner: the weight in format `fmt`
    (with its FP8 `scale` and `block_k`, or its 4-bit `scale` and `zeros`), and whether
    SiLU-and-mul is fused in."""

    weight: Any  # torch.Tensor, [N, K] in the format's layout
    silu: bool
    fmt: str = DENSE
    scale: Any = None  # torch.Tensor or None
    block_k: int = 0
    zeros: Any = None  # INT4's zero points, or None


@functools.cache
def parse_choice(choice: str) -> SkinnyConfig:
    """A config choice's text, parsed once per distinct text (the dispatch parses per call)."""
    return SkinnyConfig.parse(choice)


def table_dtype(x_dtype, fmt: str, block: bool = False, group: int = 0) -> str:
    """The dtype field of a GemmShape: the activations' dtype, and the weight format where it is
    not 16-bit, e.g. 'bfloat16', 'bfloat16-fp8block', 'bfloat16-int4g128', 'bfloat16-mxfp4'."""
    name = str(x_dtype).removeprefix("torch.")
    if fmt == DENSE:
        return name
    if fmt == FP8_FORMAT:
        return f"{name}-fp8{'block' if block else 'chan'}"
    if fmt == INT4:
        return f"{name}-int4g{group}"
    if fmt == MXFP4:
        return f"{name}-mxfp4"
    raise ValueError(f"table_dtype: unknown weight format {fmt!r}")


@functools.cache  # the dispatch builds it on every eager 4-bit call: one key object per layer shape
def w4_shape(x_dtype: torch.dtype, fmt: str, weight_rows: int, weight_cols: int, scale_cols: int,
             silu: bool) -> GemmShape:
    """A 4-bit call's table key from its packed weight's and scales' widths: INT4 packs 8 values an
    int32 (its group is K / scale columns), MXFP4 2 a byte."""
    k = weight_cols * (8 if fmt == INT4 else 2)
    return GemmShape(table_dtype(x_dtype, fmt, group=k // max(scale_cols, 1)), weight_rows, k, silu)


def shape_format(dtype: str) -> str:
    """The weight format of a GemmShape's dtype field (table_dtype's inverse)."""
    tail = dtype.partition("-")[2]
    if not tail:
        return DENSE
    if tail.startswith("fp8"):
        return FP8_FORMAT
    if tail.startswith("int4"):
        return INT4
    if tail == "mxfp4":
        return MXFP4
    raise ValueError(f"not a GEMM table dtype: {dtype!r}")


@dataclass(frozen=True, order=True)
class GemmShape:
    """A linear layer's weight as the kernel sees it: n weight rows (2 x inter with SiLU)."""

    dtype: str  # table_dtype(): "bfloat16", "float16-fp8chan", ...
    n: int
    k: int
    silu: bool

    def key(self, m: int) -> str:
        return f"{self.dtype},{self.n},{self.k},{int(self.silu)},{m}"

    @classmethod
    def parse_key(cls, text: str) -> tuple[GemmShape, int]:
        try:
            dtype, n, k, silu, m = text.split(",")
            return cls(dtype, int(n), int(k), silu == "1"), int(m)
        except ValueError as e:
            raise ValueError(f"not a GEMM table key: {text!r} (expected 'dtype,n,k,silu,m')") from e


def split_counts(tiles: int, k: int, warps: int, group: int, num_sms: int, splits=SPLITS) -> list[int]:
    """K split counts worth timing: 1, and each doubling while the blocks before it were fewer
    than 2 per SM, and every warp still gets at least one group of `group` K elements."""
    out = []
    for s in splits:
        if s == 1 or (s <= MAX_SPLITS and tiles * (s // 2) < 2 * num_sms and -(-k // s) >= warps * group):
            out.append(s)
    return out


def candidate_configs(
    m: int,
    n_out: int,
    k: int,
    silu: bool,
    tile_shapes: tuple[tuple[int, int, int], ...],
    num_sms: int,
    pairs: tuple[tuple[int, int], ...] = CANDIDATE_PAIRS,
) -> list[SkinnyConfig]:
    """Our configurations timed for one (shape, M): each (tile, warps) pair whose tile takes
    M rows, with its useful split counts. `tile_shapes` as in skinny_gemm.tile_shapes()."""
    out = []
    for tile, warps in pairs:
        if tile >= len(tile_shapes):
            continue
        rt, chunks, max_m = tile_shapes[tile]
        if m > max_m:
            continue
        tiles = -(-n_out // (rt * (8 if silu else 16)))
        for s in split_counts(tiles, k, warps, chunks * 32, num_sms):
            out.append(SkinnyConfig(tile, warps, s))
    return out


def choose(times: dict[str, float], margin: float = MARGIN) -> str:
    """The fastest entry of {choice: microseconds}; ours only if it beats cuBLAS by `margin`."""
    if not times:
        raise ValueError("no timings to choose from")
    best = min(times, key=lambda c: times[c])
    if best != CUBLAS and CUBLAS in times and times[best] > times[CUBLAS] * (1.0 - margin):
        return CUBLAS
    return best


@dataclass
class GemmTable:
    """Choices by shape and M. `lookup` takes the smallest measured M >= the asked M (a CUDA
    graph of batch size b runs M = b; eager batches between ladder sizes round up)."""

    choices: dict[GemmShape, dict[int, str]] = field(default_factory=dict)

    def set(self, shape: GemmShape, m: int, choice: str) -> None:
        if choice != CUBLAS:
            parse_choice(choice)  # a malformed choice fails here, not at a launch
        self.choices.setdefault(shape, {})[m] = choice

    def entry(self, shape: GemmShape, m: int) -> str | None:
        """The choice measured for (shape, the smallest measured M >= m), or None if none was."""
        by_m = self.choices.get(shape)
        if not by_m:
            return None
        ms = sorted(by_m)
        i = bisect.bisect_left(ms, m)
        return None if i == len(ms) else by_m[ms[i]]

    def lookup(self, shape: GemmShape, m: int) -> SkinnyConfig | None:
        """Our config for (shape, M), or None for cuBLAS (also when nothing was measured)."""
        choice = self.entry(shape, m)
        return None if choice is None or choice == CUBLAS else parse_choice(choice)

    def has(self, shape: GemmShape, m: int) -> bool:
        return m in self.choices.get(shape, {})

    def to_dict(self) -> dict[str, str]:
        return {shape.key(m): c for shape, by_m in sorted(self.choices.items()) for m, c in sorted(by_m.items())}

    @classmethod
    def from_dict(cls, entries: dict[str, str]) -> GemmTable:
        table = cls()
        for key, choice in entries.items():
            shape, m = GemmShape.parse_key(key)
            table.set(shape, m, choice)
        return table

    def merge(self, other: GemmTable) -> None:
        for shape, by_m in other.choices.items():
            for m, c in by_m.items():
                self.set(shape, m, c)


def load_cache(path: Path, device_key: str) -> GemmTable:
    """The cached table of `device_key` (empty if the file or the key is missing, or the file
    is not a table of this TABLE_VERSION)."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return GemmTable()
    if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
        return GemmTable()
    entries = data.get("devices", {}).get(device_key)
    if not isinstance(entries, dict):
        return GemmTable()
    try:
        return GemmTable.from_dict(entries)
    except ValueError:
        return GemmTable()


def save_cache(path: Path, device_key: str, table: GemmTable) -> None:
    """Merges `table` into the file's entry for `device_key`, written atomically (a temporary
    file, then rename): TP ranks that tune at once each leave a whole, valid file."""
    try:
        data = json.loads(path.read_text())
        if not isinstance(data, dict) or data.get("version") != TABLE_VERSION:
            data = {}
    except (OSError, ValueError):
        data = {}
    devices = data.get("devices", {}) if isinstance(data.get("devices"), dict) else {}
    merged = load_cache(path, device_key)
    merged.merge(table)
    devices[device_key] = merged.to_dict()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        json.dump({"version": TABLE_VERSION, "devices": devices}, f, indent=1, sort_keys=True)
    os.replace(tmp, path)
