"""What deterministic mode refuses (README "Determinism"). Its sampler is
minisgl.sampling.sampler.sample_per_row; the kernels' side is minisgl.ops.deterministic and the
attention backends."""

from __future__ import annotations

from minisgl.core.model_config import ModelConfig
from minisgl.distributed.info import TPInfo
from minisgl.engine.config import EngineConfig


def check_deterministic(cfg: EngineConfig, mc: ModelConfig, tp: TPInfo) -> None:
    """Deterministic mode covers what its kernels cover; refuse the rest by name."""
    if mc.linear_attn is not None:
        # The Gated DeltaNet scan sums in 64-token chunks that start where each prefill chunk,
        # or a prefix-cache resume from a state snapshot, starts: its bits depend on both.
        raise ValueError(f"deterministic mode does not cover hybrid linear-attention models yet "
                         f"({mc.architecture}); leave out --deterministic for this model")
    if mc.quantization is not None and mc.quantization.fmt != "fp8":
        # The 4-bit GEMMs (ops/gemm/w4.py, their skinny loaders) choose their tiles and splits, or
        # their path, by M. FP8 weights run in the skinny FP8 kernel's order at every M (ops/gemm/dispatch.py
        # _fp8_deterministic).
        raise ValueError(f"deterministic mode does not cover {mc.quantization.fmt.upper()} weights yet: use a "
                         "16-bit or FP8 checkpoint")
    if tp.size > 1:
        import os

        # NCCL picks its algorithm and protocol by message size and topology: pin them, so an
        # all-reduce's summation order does not change with the batch's token count.
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NCCL_PROTO", "Simple")
