"""benchmarks/determinism.py gap_summary and exclusive_by_kernel (the batch-1 rows' "between kernels"
lines): the arithmetic of span, busy time, gaps, overlap and each kernel's exclusive time over kernel
spans (CPU, synthetic spans)."""

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


def test_exclusive_time_sums_to_span_minus_gaps() -> None:
    spans = [
        (0.0, 10.0, "norm"),
        (2.0, 30.0, "gemm"),  # launched early (PDL): adds only 20 us past the norm's end
        (31.0, 35.0, "rope"),  # after a 1 us gap
        (33.0, 34.0, "store"),  # wholly inside rope: adds nothing
        (34.5, 40.0, "gemm"),  # adds 5 us past rope's end
    ]
    rows = determinism.exclusive_by_kernel(spans)
    assert rows == [("gemm", 25.0, 2), ("norm", 10.0, 1), ("rope", 4.0, 1), ("store", 0.0, 1)]
    # 40 us of span, of which 1 us idle (30 -> 31); store -> gemm's 0.5 us is no idle time (rope runs)
    assert sum(us for _, us, _ in rows) == pytest.approx(40.0 - 1.0)
    assert determinism.exclusive_by_kernel([]) == []
