"""A GGUF model's tokenizer as a plain Hugging Face tokenizer folder, converted once and cached.

transformers builds a tokenizer from GGUF metadata only through its GGUF integration, which
needs torch (transformers/integrations/gguf), and the tokenizer workers and the detokenizer
never load torch (DESIGN.md §2). So the tokenizer is converted once, by a short-lived child
process that may import torch, into a folder under the cache directory (save_pretrained, chat
template included), keyed by the file's path, size and mtime; every process then loads that
folder, torch or not, so all of them tokenize alike. A file lock makes workers that start
together wait for one conversion instead of each doing their own.

`python -m minisgl.tokenizer.gguf_tokenizer GGUF OUT` is the child's side.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

from minisgl import env
from minisgl.logging_setup import get_logger

log = get_logger("minisgl.tokenizer")
CONVERT_TIMEOUT_S = 600.0


def gguf_tokenizer_folder(gguf: Path) -> Path:
    """The folder holding `gguf`'s tokenizer, converting it first if no process has yet."""
    gguf = gguf.resolve()  # a symlink and its target share one folder
    st = gguf.stat()
    key = hashlib.sha256(f"{gguf}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()[:16]
    folder = Path(env.CACHE_DIR) / "gguf_tokenizers" / f"{gguf.stem}-{key}"
    if folder.is_dir():  # renamed into place whole: a folder that exists is complete
        return folder
    from filelock import FileLock

    folder.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(f"{folder}.lock"):
        if not folder.is_dir():  # else another process converted it while we waited
            # One name, used only under the lock: whatever a killed or timed-out conversion left
            # there is removed by the next one (a per-process name would pile up).
            tmp = folder.with_name(f"{folder.name}.tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            _convert_in_child(gguf, tmp)
            os.replace(tmp, folder)
    return folder


def _convert_in_child(gguf: Path, out: Path) -> None:
    log.info("converting the tokenizer of %s into %s (once)", gguf.name, out.parent)
    # The child must import this same minisgl: it gets this process's module path, in order
    # (as multiprocessing's spawn does; "" is the current directory, which the child shares).
    path = os.pathsep.join(p or os.getcwd() for p in sys.path)
    cmd = [sys.executable, "-m", "minisgl.tokenizer.gguf_tokenizer", str(gguf), str(out)]
    try:
        done = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": path}, capture_output=True, text=True,
                              timeout=CONVERT_TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        raise RuntimeError(f"converting the tokenizer of {gguf} took over {CONVERT_TIMEOUT_S:.0f} s") from e
    if done.returncode != 0:
        shutil.rmtree(out, ignore_errors=True)
        tail = "\n".join(done.stderr.strip().splitlines()[-5:])
        raise RuntimeError(f"converting the tokenizer of {gguf} failed (exit code {done.returncode}):\n{tail}")


def convert(gguf: Path, out: Path) -> None:
    """The tokenizer (with its chat template) rebuilt from the GGUF metadata by transformers,
    saved as a Hugging Face tokenizer folder."""
    from transformers import AutoTokenizer

    from minisgl.models.gguf_meta import gguf_field, gguf_file

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    if not getattr(tok, "chat_template", None):
        template = gguf_field(gguf_file(gguf), "tokenizer.chat_template")
        if template:
            tok.chat_template = template
    tok.save_pretrained(str(out))


if __name__ == "__main__":
    convert(Path(sys.argv[1]), Path(sys.argv[2]))
