"""benchmarks/prefix_share.py (issue 34's prefix-sharing workload): one tiny run of both modes on
the CPU with a hybrid model (servers started by the script), so the GPU run does not find a
broken script: with snapshots the requests resume the shared prompt, without them none hits."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "prefix_share.py"
sys.path.insert(0, str(_PATH.parent))
_spec = importlib.util.spec_from_file_location("prefix_share_bench", _PATH)
ps = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ps)


def test_both_modes_on_a_hybrid_model_on_cpu(tiny_model_path, tmp_path, capsys) -> None:
    model = str(tiny_model_path("qwen3_next"))
    ps.main(["--requests", "7", "--prefix-tokens", "40", "--tail-tokens", "8", "--output-tokens", "3",
             "--rate", "20", "--warmup", "0.2", "--vocab", "4000", "--log-dir", str(tmp_path),
             "--", "--model", model, "--device", "cpu", "--dtype", "float32", "--page-size", "1"])
    out = capsys.readouterr().out
    rows = {r["label"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert set(rows) == {"on", "off"}, out
    assert all(r["requests"] == 7 for r in rows.values())
    assert rows["on"]["prefix_hit_rate"] >= 0.8 and rows["on"]["cached_share"] > 0.5, out
    assert rows["off"]["prefix_hit_rate"] == 0 and rows["off"]["cached_share"] == 0, out
    assert "| on |" in out and "| off |" in out


def test_documents_workload_resumes_from_interval_snapshots_on_cpu(tiny_model_path, tmp_path, capsys) -> None:
    """--documents with named modes: 16-token prefill chunks, snapshots every 16 tokens against
    none inside a prompt. The second question of a document resumes from the first's interval
    snapshots in the first mode and from nothing in the second (its only shared prefix is the
    document, where the first question left no prompt-end snapshot)."""
    model = str(tiny_model_path("qwen3_next"))
    chunks = "--max-prefill-tokens 16 --state-snapshot-interval"
    ps.main(["--documents", "3", "--prefix-tokens", "64", "--tail-tokens", "8", "--output-tokens", "3",
             "--rate", "20", "--vocab", "4000", "--log-dir", str(tmp_path),
             "--modes", f"i16={chunks} 16,none={chunks} 100000",
             "--", "--model", model, "--device", "cpu", "--dtype", "float32", "--page-size", "1"])
    out = capsys.readouterr().out
    rows = {r["label"]: r for r in (json.loads(line) for line in out.splitlines() if line.startswith("{"))}
    assert set(rows) == {"i16", "none"}, out
    assert all(r["requests"] == 3 for r in rows.values()), out
    assert rows["i16"]["cached_share"] > 0.3, out
    assert rows["none"]["cached_share"] == 0, out
