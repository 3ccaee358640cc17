"""What the radix cache stores and drops, page by page, for KV-cache events (`--kv-events-config`).

A cluster scheduler (llm-d's precise prefix-cache scorer, SMG) keeps its own index of which
engine holds which prefix, from events alone: a block (one KV page) is named by a chained hash
of the tokens up to and including it, so the index can hash a new prompt itself and look its
blocks up without asking the engine.

The hash (what llm-d's token processor computes; vLLM's `sha256_cbor` with 64-bit hashes):

    root     = low64(sha256(cbor(hash_seed)))                    hash_seed: a text string, default ""
    block[i] = low64(sha256(cbor([block[i-1] or root, [t_0, ..., t_{page_size-1}], null])))

where cbor is canonical CBOR (RFC 8949 §4.2: shortest integer heads) and low64 the digest's last
8 bytes read big-endian. A block's parent is the block before it; the first block's parent is
the root. Set `hash_seed` to what the index uses (llm-d: `hashSeed`, vLLM: PYTHONHASHSEED).

The cache reports its changes as plain tuples, drained once per scheduler step by whoever
publishes them (message/kv_events.py holds the wire format):
    ("stored", hashes, parent hash or None, token ids)   a run of new pages, parent first
    ("removed", hashes)                                  pages evicted
    ("cleared",)                                         the whole cache dropped (a flush)
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any


def _head(major: int, value: int) -> bytes:
    """A CBOR item head with its argument in the fewest bytes (canonical); per token of every
    stored page, so plain branches (struct was 3x slower here)."""
    m = major << 5
    if value < 24:
        return bytes((m | value,))
    for info, size in ((24, 1), (25, 2), (26, 4), (27, 8)):
        if value < 1 << (8 * size):
            return bytes((m | info,)) + value.to_bytes(size, "big")
    raise ValueError(f"{value} does not fit a CBOR integer head")


def _text(value: str) -> bytes:
    data = value.encode()
    return _head(3, len(data)) + data


def low64(data: bytes) -> int:
    return int.from_bytes(hashlib.sha256(data).digest()[24:], "big")


class CacheEvents:
    """Hashes the cache's pages and queues its changes (see the module docstring)."""

    def __init__(self, page_size: int, hash_seed: str = "") -> None:
        if page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {page_size}")
        self.page_size = page_size
        self.root = low64(_text(hash_seed))
        self._pending: list[tuple[Any, ...]] = []

    def block_hashes(self, parent: int | None, token_ids: Sequence[int]) -> list[int]:
        """The chained hashes of the whole pages of `token_ids`, which follow block `parent`
        (None: they start the sequence)."""
        ps = self.page_size
        out, h = [], self.root if parent is None else parent
        triple, page = _head(4, 3), _head(4, ps)  # the list heads of [parent, [tokens...], null]
        for start in range(0, len(token_ids) - ps + 1, ps):
            tokens = b"".join(_head(0, t) for t in token_ids[start : start + ps])
            h = low64(triple + _head(0, h) + page + tokens + b"\xf6")
            out.append(h)
        return out

    def stored(self, hashes: list[int], parent: int | None, token_ids: Sequence[int]) -> None:
        self._pending.append(("stored", hashes, parent, list(token_ids)))

    def removed(self, hashes: list[int]) -> None:
        self._pending.append(("removed", hashes))

    def cleared(self) -> None:
        self._pending.append(("cleared",))

    def drain(self) -> list[tuple[Any, ...]]:
        out, self._pending = self._pending, []
        return out
