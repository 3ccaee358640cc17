"""The processes that need no torch do not load it while they run (DESIGN.md §2): after serving
chat, streams, logprobs, structured output and /tokenize, no libtorch (nor Triton) shared
object is mapped in the launcher (which is the API server's process), the tokenizer workers,
the detokenizer or the DP controller; only the scheduler ranks map them. For an HF folder's
tokenizer (tokenizer-only transformers) and for a GGUF's, which every process loads from the
folder one child converted (once, however many workers start together)."""

from __future__ import annotations

import re
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from server_harness import Server, child_pids

pytestmark = pytest.mark.slow
_READY = re.compile(r"INFO minisgl\.server\] (.+) ready \(pid (\d+)\)")
# libtorch.so, libtorch_cpu.so, libtorch_python.so, ...; triton/_C/libtriton.so
_HEAVY = re.compile(r"/(libtorch\w*\.so|triton/)")
SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def heavy_libraries(pid: int) -> set[str]:
    """The torch / Triton shared objects mapped into process `pid`."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {Path(line.split()[-1]).name for line in lines if _HEAVY.search(line)}


def exercise(url: str) -> None:
    """What would pull torch into the API process or a tokenizer if anything still did."""
    http = httpx.Client(base_url=url, timeout=300)
    hi = [{"role": "user", "content": "hi"}]
    r = http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 3, "logprobs": True, "top_logprobs": 2})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 4, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}})
    assert r.status_code == 200, r.text
    r = http.post("/v1/chat/completions", json={"messages": hi, "max_tokens": 4, "regex": "a("})
    assert r.status_code == 400 and r.json()["error"]["param"] == "regex", r.text
    with http.stream("POST", "/v1/completions", json={"prompt": "Once upon", "max_tokens": 3, "stream": True}) as s:
        assert s.status_code == 200 and any(line.startswith("data: ") for line in s.iter_lines())
    ids = http.post("/tokenize", json={"prompt": "hello"}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).status_code == 200


def check_processes(server: Server, expected: set[str]) -> None:
    names = {int(pid): name for name, pid in _READY.findall(server.output)}
    assert set(names.values()) == expected, server.output
    running = child_pids(server.proc.pid)
    assert set(names) <= running
    for pid in sorted(running | {server.proc.pid}):
        name = names.get(pid, "launcher" if pid == server.proc.pid else f"pid {pid}")
        try:
            found = heavy_libraries(pid)
        except OSError:
            continue  # a short-lived child (large inputs) that is gone
        if "scheduler" in name:
            assert "libtorch_cpu.so" in found, f"{name}: the check sees no torch where there is some"
        else:
            assert not found, f"the {name} process maps {sorted(found)}"


def test_hf_tokenizer_processes_stay_torch_free(tiny_model_path: Callable[[str], Path], tmp_path: Path) -> None:
    s = Server("--model", str(tiny_model_path("qwen3")), "--num-tokenizers", "2", "--dp", "2", cwd=tmp_path)
    try:
        exercise(s.url)
        check_processes(s, {"replica 0 scheduler", "replica 1 scheduler", "dp controller", "detokenizer",
                            "tokenizer0", "tokenizer1"})
    finally:
        s.stop()


def test_gguf_tokenizer_converted_once_and_loaded_torch_free(
    smollm2_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A fresh cache: the three processes that load the tokenizer at start find no folder, and
    # one of them converts it while the others wait on the lock.
    monkeypatch.setenv("MINISGL_CACHE_DIR", str(tmp_path / "cache"))
    s = Server("--model", str(smollm2_gguf), "--num-tokenizers", "2", "--max-model-len", "2048", cwd=tmp_path,
               timeout=400)
    try:
        assert s.output.count("converting the tokenizer of") == 1, s.output
        exercise(s.url)
        check_processes(s, {"scheduler", "detokenizer", "tokenizer0", "tokenizer1"})
    finally:
        s.stop()
    (folder,) = (p for p in (tmp_path / "cache" / "gguf_tokenizers").iterdir() if p.is_dir())
    assert {p.name for p in folder.iterdir()} >= {"tokenizer.json", "tokenizer_config.json"}
