"""Models given as a GGUF file: where the file is and its config, from the metadata alone.

Torch-free (the launcher resolves the model with it; DESIGN.md §2): the weights are read by
gguf_weights.py, the tokenizer is converted once by minisgl/tokenizer/gguf_tokenizer.py. Only
the Llama-family GGUF layout ("llama" and "qwen2"/"qwen3" architectures) is mapped.
"""

from __future__ import annotations

import functools
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

_ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def find_gguf(path: Path) -> Path | None:
    """The .gguf file `path` names, or the single one in the folder `path`, else None."""
    if path.is_file() and path.suffix == ".gguf":
        return path
    if path.is_dir():
        found = sorted(path.glob("*.gguf"))
        if len(found) > 1:
            raise ValueError(f"{path} holds several .gguf files; name one: {[f.name for f in found]}")
        return found[0] if found else None
    return None


# GGUF value types (the format's own numbering) -> struct format; 8 is a string, 9 an array.
_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_STRING, _ARRAY = 8, 9


@dataclass(frozen=True)
class GgufTensor:
    name: str
    qtype: int  # gguf.GGMLQuantizationType value
    shape: tuple[int, ...]  # row-major (HF order: GGUF lists dims fastest-first)
    data: np.ndarray  # the raw bytes of the tensor, uint8 [rows, bytes per row] (a view of the file)


@dataclass
class GgufFile:
    """The metadata (scalars and strings; an array's length only, unless it is small or
    numeric) and the tensors of a GGUF file, memory-mapped."""

    fields: dict[str, Any]
    tensors: list[GgufTensor]


class _Cursor:
    def __init__(self, buf: memoryview) -> None:
        self.buf, self.pos = buf, 0

    def unpack(self, fmt: str) -> Any:
        value = struct.unpack_from("<" + fmt, self.buf, self.pos)[0]
        self.pos += struct.calcsize(fmt)
        return value

    def string(self) -> str:
        n = self.unpack("Q")
        self.pos += n
        return bytes(self.buf[self.pos - n : self.pos]).decode("utf-8", errors="replace")

    def skip_string(self) -> None:
        n = self.unpack("Q")  # (not `pos += unpack()`: that would read pos before unpack moves it)
        self.pos += n

    def value(self, kind: int) -> Any:
        if kind in _SCALARS:
            return self.unpack(_SCALARS[kind])
        if kind == _STRING:
            return self.string()
        if kind != _ARRAY:
            raise ValueError(f"unknown GGUF value type {kind}")
        elem, count = self.unpack("I"), self.unpack("Q")
        if elem in _SCALARS:  # numeric: one buffer read
            dtype = np.dtype("<" + _SCALARS[elem])
            out = np.frombuffer(self.buf, dtype, count, self.pos)
            self.pos += count * dtype.itemsize
            return out.tolist() if count <= 64 else out
        if elem == _STRING and count > 64:  # a vocabulary: its length is all the metadata needs
            for _ in range(count):
                self.skip_string()
            return Skipped(count)
        return [self.value(elem) for _ in range(count)]


@dataclass(frozen=True)
class Skipped:
    """A long string array read past (the tokenizer's vocabulary and merges)."""

    count: int

    def __len__(self) -> int:
        return self.count


@functools.lru_cache(maxsize=2)
def gguf_file(path: Path) -> GgufFile:
    """The file's metadata and tensors. gguf's own GGUFReader reads every string of the
    vocabulary into Python objects (about 3 s for SmolLM2's 49k tokens and merges, on the
    server's critical path); this reads past them, and maps the tensor data once."""
    from gguf.constants import GGML_QUANT_SIZES, GGMLQuantizationType

    raw = np.memmap(path, dtype=np.uint8, mode="r")
    cur = _Cursor(memoryview(raw))
    if cur.unpack("I") != 0x46554747:  # "GGUF"
        raise ValueError(f"{path} is not a GGUF file")
    version = cur.unpack("I")
    if version not in (2, 3):
        raise ValueError(f"{path}: GGUF version {version} is not supported")
    n_tensors, n_fields = cur.unpack("Q"), cur.unpack("Q")
    fields = {}
    for _ in range(n_fields):
        key = cur.string()
        fields[key] = cur.value(cur.unpack("I"))
    infos = []
    for _ in range(n_tensors):
        name = cur.string()
        dims = [cur.unpack("Q") for _ in range(cur.unpack("I"))]
        infos.append((name, dims, cur.unpack("I"), cur.unpack("Q")))
    align = int(fields.get("general.alignment", 32))
    start = -(-cur.pos // align) * align
    tensors = []
    for name, dims, qtype, offset in infos:
        block, size = GGML_QUANT_SIZES[GGMLQuantizationType(qtype)]
        per_row = dims[0] // block * size  # bytes of one row of the fastest dim
        rows = int(np.prod(dims[1:], dtype=np.int64)) if len(dims) > 1 else 1
        data = raw[start + offset : start + offset + rows * per_row].reshape(rows, per_row)
        tensors.append(GgufTensor(name, qtype, tuple(int(d) for d in reversed(dims)), data))
    return GgufFile(fields, tensors)


def gguf_field(f: GgufFile, key: str, default: Any = None) -> Any:
    return f.fields.get(key, default)


def gguf_config(path: Path) -> dict[str, Any]:
    """An HF-style config dict from the GGUF metadata."""
    r = gguf_file(path)
    arch = gguf_field(r, "general.architecture")
    if arch not in _ARCH:
        raise ValueError(f"unknown GGUF architecture {arch!r} in {path.name}; supported: {', '.join(_ARCH)}")
    names = {t.name for t in r.tensors}
    heads = int(gguf_field(r, f"{arch}.attention.head_count"))
    hidden = int(gguf_field(r, f"{arch}.embedding_length"))
    vocab = gguf_field(r, f"{arch}.vocab_size") or len(gguf_field(r, "tokenizer.ggml.tokens", []))
    head_dim = gguf_field(r, f"{arch}.attention.key_length") or hidden // heads
    return {
        "architectures": [_ARCH[arch]],
        "vocab_size": int(vocab),
        "hidden_size": hidden,
        "intermediate_size": int(gguf_field(r, f"{arch}.feed_forward_length")),
        "num_hidden_layers": int(gguf_field(r, f"{arch}.block_count")),
        "num_attention_heads": heads,
        "num_key_value_heads": int(gguf_field(r, f"{arch}.attention.head_count_kv", heads)),
        "head_dim": int(head_dim),
        "rms_norm_eps": float(gguf_field(r, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)),
        "rope_theta": float(gguf_field(r, f"{arch}.rope.freq_base", 10000.0)),
        "max_position_embeddings": int(gguf_field(r, f"{arch}.context_length", 4096)),
        "tie_word_embeddings": "output.weight" not in names,
        "attention_bias": "blk.0.attn_q.bias" in names,
        "eos_token_id": gguf_field(r, "tokenizer.ggml.eos_token_id"),
        "bos_token_id": gguf_field(r, "tokenizer.ggml.bos_token_id"),
        "_gguf_arch": arch,
    }
