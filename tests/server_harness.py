"""Runs `python -m minisgl.serve` as a subprocess for the server tests (CPU, a free port)."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

_READY = re.compile(r"serving .* at (http://[^\s]+)")


def child_pids(pid: int) -> set[int]:
    """Every live descendant of `pid` (from /proc)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
        except OSError:
            continue
        # The command name may hold spaces; ppid is the 2nd field after the closing paren.
        parents[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
    out, frontier = set(), {pid}
    while frontier:
        frontier = {p for p, pp in parents.items() if pp in frontier} - out
        out |= frontier
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, just not reaped


class Server:
    def __init__(
        self, *args: str, cwd: Path, timeout: float = 180.0, stdin: str | None = None, wait_ready: bool = True
    ) -> None:
        cmd = [sys.executable, "-m", "minisgl.serve", "--device", "cpu", *args]
        if "--shell" not in args and "--port" not in args:
            cmd += ["--port", "0"]
        # cwd is a temp dir: `-m` must import the installed minisgl, not a source checkout.
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        self.proc = subprocess.Popen(
            cmd,
            cwd=cwd,
            env=env,
            text=True,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL,
        )
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        self._reader = threading.Thread(target=self._pump, daemon=True)
        self._reader.start()
        if stdin is not None:
            assert self.proc.stdin is not None
            self.proc.stdin.write(stdin)
            self.proc.stdin.flush()
        if wait_ready:
            self.wait_ready(timeout)

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            self.lines.append(line)
            m = _READY.search(line)
            if m and self.url is None:
                self.url = m.group(1)
                self._ready.set()
        self._ready.set()

    @property
    def output(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float) -> None:
        self._ready.wait(timeout)
        if self.url is None:
            self.stop(signal.SIGKILL)
            raise RuntimeError(f"server did not become ready; output:\n{self.output}")

    def wait_exit(self, timeout: float) -> int:
        try:
            code = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            raise
        self._reader.join(10)  # the output up to the exit, all of it
        return code

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
        return self.wait_exit(timeout)


def model_variant(src: Path, dst: Path, generation: dict[str, Any], config: dict[str, Any] | None = None) -> Path:
    """A copy of the model folder `src` with entries added to its generation_config.json
    (e.g. temperature 0: greedy by default) and config.json."""
    import shutil

    shutil.copytree(src, dst)
    for name, extra in (("generation_config.json", generation), ("config.json", config or {})):
        path = dst / name
        path.write_text(json.dumps({**json.loads(path.read_text()), **extra}))
    return dst


def wait_for(predicate, timeout: float, interval: float = 0.05) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def greedy(llm: Any, prompts: list, max_tokens: int, **kw: Any) -> list[dict]:
    """The offline LLM's greedy outputs: the reference the server must match."""
    from minisgl import SamplingParams

    return llm.generate(prompts, SamplingParams(max_tokens=max_tokens, temperature=0.0, **kw), use_tqdm=False)


def metric(http: Any, name: str, labels: str = "") -> float:
    text = http.get("/metrics").text
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, f"{name}{labels} not in /metrics"
    return float(m.group(1))


def sse_events(lines: list[str]) -> list:
    """Checks the exact SSE framing (`data: {json}` + blank line, `data: [DONE]` last)."""
    assert lines[-2:] == ["data: [DONE]", ""], lines[-3:]
    events = []
    for i in range(0, len(lines) - 2, 2):
        assert lines[i].startswith("data: ") and lines[i + 1] == "", lines[i : i + 2]
        events.append(json.loads(lines[i][6:]))
    return events
