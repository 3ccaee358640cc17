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


def test_gemm_table_proposal_per_m() -> None:
    """determinism_kernels.propose_entries (the mode's GEMM table from measured us per M): the fastest
    option per M, kept on the previous choice within 2% and on the skinny kernel within 3%, and
    "skinny" never past its 32 rows (a config follows it by M 33 even where it would be fastest)."""
    import determinism_kernels as dk

    a, b, c = "[16, 64, 128, 4, 5]", "[64, 64, 64, 4, 4]", "[128, 128, 128, 8, 3]"
    per_m = {
        1: {"skinny": 10.2, a: 10.0},  # skinny within 3%: kept
        8: {"skinny": 12.0, a: 10.0},  # 20% slower: the Triton tile
        16: {"skinny": 13.0, a: 10.1, b: 10.0},  # b by 1%: stay on a
        24: {"skinny": 9.0, a: 11.0, b: 10.0},  # skinny fastest again at 24
        48: {a: 12.0, b: 10.0, c: 11.0},
        1024: {a: 90.0, b: 80.0, c: 50.0},
    }
    assert dk.propose_entries(per_m) == [[1, "skinny"], [8, [16, 64, 128, 4, 5]], [24, "skinny"],
                                         [33, [64, 64, 64, 4, 4]], [1024, [128, 128, 128, 8, 3]]]
    assert dk.propose_entries({1: {a: 1.0, "skinny": 2.0}, 48: {"skinny": 1.0, a: 2.0}}) == [
        [1, [16, 64, 128, 4, 5]]]  # a "skinny" time past 32 rows is not an option
    only_skinny = {1: {"skinny": 5.0, a: 9.0}, 32: {"skinny": 5.0, a: 9.0}}
    assert dk.propose_entries(only_skinny) == [[1, "skinny"], [33, [16, 64, 128, 4, 5]]]
