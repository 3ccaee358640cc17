"""Runs a router in front of minisgl servers: sglang-router 0.3.2 (`python -m
sglang_router.launch_router`) or its successor, the SGLang model gateway (SMG, `python -m
smg.launch_router`), which take the same flags for what the tests use."""

from __future__ import annotations

import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Router:
    def __init__(
        self,
        worker_urls: list[str],
        log: Path,
        *extra: str,
        timeout: float = 120.0,
        module: str = "sglang_router.launch_router",
    ) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log = log
        cmd = [
            sys.executable,
            "-m",
            module,
            "--worker-urls",
            *worker_urls,
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--prometheus-host",
            "127.0.0.1",
            "--prometheus-port",
            str(free_port()),
            "--log-level",
            "warn",
            *extra,
        ]
        self._log_file = log.open("w")
        self.proc = subprocess.Popen(cmd, stdout=self._log_file, stderr=subprocess.STDOUT)
        self.http = httpx.Client(base_url=self.url, timeout=120)
        if not self.wait_workers(len(worker_urls), timeout):
            self.stop()
            raise RuntimeError(f"the router did not register {worker_urls}; its log:\n{self.output}")

    @property
    def output(self) -> str:
        return self.log.read_text()

    def workers(self) -> list[dict]:
        try:
            return self.http.get("/workers").json()["workers"]
        except (httpx.HTTPError, ValueError, KeyError):
            return []

    def wait_workers(self, n: int, timeout: float, model: str | None = None) -> bool:
        """True once the router lists n healthy workers (with metadata read, so a model id)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.proc.poll() is None:
            ws = self.workers()
            if len(ws) == n and all(w["is_healthy"] and w["model_id"] != "unknown" for w in ws):
                return True
            time.sleep(0.2)
        return False

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self.http.close()
        self._log_file.close()
