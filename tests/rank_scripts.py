"""Runs one script per rank (`python SCRIPT RANK PORT`) and collects their output. Scripts,
not functions of a test module: a spawned child cannot import a test module under pytest's
importlib mode."""

from __future__ import annotations

import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_ranks(script: str, world: int, timeout: float, args: Sequence[str] = ()) -> list[str]:
    """Each rank's output (`python SCRIPT RANK PORT *args`); fails with every rank's output tail
    if a rank failed or hung (a rank that failed leaves the others blocked in a collective: they
    are killed)."""
    path = str(Path(__file__).with_name(script))
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, path, str(r), port, *args], text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        for r in range(world)
    ]
    outs, hung = [], []
    for r, p in enumerate(procs):
        try:
            outs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            hung.append(r)
            p.kill()
            outs.append(p.communicate()[0])
    report = "\n".join(f"--- rank {r} (exit {p.returncode}):\n{o[-3000:]}" for r, (p, o) in enumerate(zip(procs, outs)))
    assert not hung and all(p.returncode == 0 for p in procs), f"hung ranks {hung}\n{report}"
    return outs
