"""Process lifecycle: a dead child takes the server down, startup failures exit non-zero
with the reason, and the --shell chat."""

from __future__ import annotations

import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from server_harness import Server, alive, child_pids, wait_for

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def model_dir(tiny_model_path: Callable[[str], Path]) -> Path:
    return tiny_model_path("llama3")


def test_dead_child_takes_the_server_down(model_dir: Path, tmp_path: Path) -> None:
    s = Server("--model", str(model_dir), cwd=tmp_path)
    try:
        assert httpx.get(f"{s.url}/health").status_code == 200
        pid = int(re.search(r"scheduler ready \(pid (\d+)\)", s.output).group(1))
        folder = re.search(r"IPC sockets in (\S+)", s.output).group(1)
        kids = child_pids(s.proc.pid)
        result: dict[str, object] = {}

        def long_request() -> None:  # in flight when the scheduler dies: must not hang
            try:
                r = httpx.post(
                    f"{s.url}/v1/completions", timeout=60, json={"prompt": "hi", "max_tokens": 400, "ignore_eos": True}
                )
                result["status"] = r.status_code
            except httpx.HTTPError as e:
                result["status"] = type(e).__name__

        t = threading.Thread(target=long_request)
        t.start()
        assert wait_for(lambda: "minisgl_num_requests_running 1.0" in httpx.get(f"{s.url}/metrics").text, 10)
        os.kill(pid, signal.SIGKILL)
        assert s.wait_exit(30) == 1
        t.join(30)
        assert not t.is_alive() and result["status"] != 200
        assert re.search(r"the scheduler process \(pid \d+, exit code -9\) died", s.output)
        assert wait_for(lambda: not any(alive(p) for p in kids), 10)
        assert not Path(folder).exists()
    finally:
        s.stop(signal.SIGKILL)


def test_startup_failure_exits_nonzero(model_dir: Path, tmp_path: Path) -> None:
    s = Server("--model", str(model_dir), "--max-running-requests", "0", cwd=tmp_path, wait_ready=False)
    assert s.wait_exit(120) == 1
    assert "scheduler failed to start" in s.output and "max_running_requests" in s.output


def test_taken_port_fails_fast(model_dir: Path, tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = Server("--model", str(model_dir), "--port", str(port), cwd=tmp_path, wait_ready=False)
        assert s.wait_exit(60) == 1
    assert f"cannot listen on 127.0.0.1:{port}" in s.output


def test_bad_model_path_is_refused(tmp_path: Path) -> None:
    s = Server("--model", str(tmp_path / "nope"), cwd=tmp_path, wait_ready=False)
    assert s.wait_exit(60) == 2 and "does not exist" in s.output


def test_shell_chat(model_dir: Path, tmp_path: Path) -> None:
    # A short context keeps the random model's answers short.
    script = "Hello there\n/reset\n/help\n/set temperature 0\n/set top_p 7\n/show\nSecond question\n/exit\n"
    s = Server(
        "--model",
        str(model_dir),
        "--shell",
        "--num-tokenizers",
        "0",
        "--max-model-len",
        "80",
        cwd=tmp_path,
        stdin=script,
        wait_ready=False,
    )
    assert s.wait_exit(120) == 0, s.output
    out = s.output
    assert "minisgl shell: chatting with llama3" in out
    assert "(history cleared)" in out and "commands: /set FIELD VALUE" in out
    assert "sampling: temperature=1.0" in out  # the settings in force, at the start
    assert "sampling: temperature=0.0" in out  # /set took
    assert "error: top_p must be in (0, 1]" in out  # /set refused, settings kept
    assert out.count("> ") >= 8  # one prompt per line read
