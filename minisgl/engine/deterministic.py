"""Deterministic mode's engine-side pieces (README "Determinism"): what it refuses, and its
sampler. The kernels' side is minisgl.ops.deterministic and the attention backends."""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.distributed.info import TPInfo
from minisgl.engine.config import EngineConfig
from minisgl.engine.sampler import SamplingTensors
from minisgl.models.config import ModelConfig


def check_deterministic(cfg: EngineConfig, mc: ModelConfig, tp: TPInfo) -> None:
    """Deterministic mode covers what its kernels cover; refuse the rest by name."""
    if mc.moe is not None:
        raise ValueError("deterministic mode does not cover MoE models yet (the grouped GEMM's tiles depend on M)")
    if cfg.quantization is not None or mc.quantization is not None:
        # The FP8 GEMMs (ops/fp8_gemm.py, the FP8 skinny kernel) choose their tiles and splits by M.
        raise ValueError("deterministic mode does not cover FP8 weights yet: leave out --quantization "
                         "(quantization=) or use a 16-bit checkpoint")
    if cfg.spec is not None:
        # A seeded request's tokens would depend on what the drafter proposed (rejection
        # sampling draws differently from plain sampling), and the drafter's proposals on its
        # batch; greedy output would be invariant, sampled output not.
        raise ValueError("deterministic mode does not cover speculative decoding yet: leave out "
                         "--speculative-algorithm (speculative_algorithm=) or --deterministic")
    if tp.size > 1:
        import os

        # NCCL picks its algorithm and protocol by message size and topology: pin them, so an
        # all-reduce's summation order does not change with the batch's token count.
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NCCL_PROTO", "Simple")


def sample_per_row(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic mode's sampler: each row alone. The GPU kernel (ops.sample) is one program
    per row already, greedy rows included (exact argmax; log_softmax by the row's own program),
    unlike torch's argmax/logsumexp, whose reduction split depends on the batch size. On the
    CPU the torch reference runs on one [1, V] row at a time."""
    if logits.device.type == "cuda":
        return ops.sample(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps)
    parts = [
        ops.sample(logits[i : i + 1], st.temperature[i : i + 1], st.top_k[i : i + 1], st.top_p[i : i + 1],
                   st.min_p[i : i + 1], st.seeds[i : i + 1], st.steps[i : i + 1])
        for i in range(logits.shape[0])
    ]
    return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])
