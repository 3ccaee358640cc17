"""benchmarks/determinism.py gap_summary (the batch-1 rows' "between kernels" lines): the arithmetic
of span, busy time, gaps and overlap over kernel spans (CPU, synthetic spans)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))

import determinism  # noqa: E402


def test_gap_summary_counts_overlap_gaps_and_step_boundaries() -> None:
    spans = [
        (0.0, 10.0, "gemm"),
        (8.0, 20.0, "gemm"),  # starts 2 us before the first ends: overlap
        (21.0, 30.0, "norm"),  # a 1 us kernel boundary
        (30.5, 40.0, "gemm"),  # 0.5 us
        (240.0, 250.0, "norm"),  # 200 us: a step boundary on the host
        (249.0, 260.0, "gemm"),  # 1 us overlap
    ]
    g = determinism.gap_summary(spans)
    assert g["span"] == 260.0
    assert g["busy"] == 10 + 12 + 9 + 9.5 + 10 + 11
    assert g["gaps"] == pytest.approx(1.5) and g["step_gaps"] == 200.0
    assert g["overlap"] == pytest.approx(3.0)
    assert g["boundaries"] == [("gemm -> norm", 1.0, 1), ("norm -> gemm", 0.5, 1)]
