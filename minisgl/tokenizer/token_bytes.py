"""Single tokens as raw bytes and display text, for logprobs (OpenAI's `token` and `bytes`).

`tok.decode([id])` cannot give a token's bytes: a byte-level BPE token that holds half of a
UTF-8 character decodes to U+FFFD. The bytes come from the vocabulary itself instead:
- byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2): each character of the token string stands
  for one byte through GPT-2's byte-to-unicode table;
- SentencePiece-style BPE with byte fallback (Llama 2, Mistral): `<0xHH>` is the byte HH and
  `▁` a space;
- added tokens (special or not) are their content's UTF-8;
- any other tokenizer: the UTF-8 of `decode([id])` (right for whole characters), said once in
  the log.
The display text is those bytes decoded with U+FFFD for an incomplete character, so text and
bytes always agree.
"""

from __future__ import annotations

import json
import re
from typing import Any

from minisgl.logging_setup import get_logger

log = get_logger("minisgl.tokenizer")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def backend_spec(tok: Any) -> dict[str, Any] | None:
    """The tokenizers-library JSON of a fast tokenizer (None for a slow one)."""
    backend = getattr(tok, "backend_tokenizer", None)
    return None if backend is None else json.loads(backend.to_str())


def _gpt2_byte_decoder() -> dict[str, int]:
    # GPT-2's table: printable bytes stand for themselves, the other 68 map to U+0100 onwards.
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    codes = list(printable)
    extra = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            codes.append(256 + extra)
            extra += 1
    return {chr(c): b for b, c in zip(printable, codes)}


def _decoder_types(spec: dict[str, Any] | None) -> set[str]:
    dec = (spec or {}).get("decoder") or {}
    parts = dec.get("decoders", [dec]) if dec.get("type") == "Sequence" else [dec]
    return {p.get("type") for p in parts if p}


class TokenTable:
    """id -> raw bytes / display text of one token, cached per id."""

    def __init__(self, tok: Any) -> None:
        self.tok = tok
        self.spec = backend_spec(tok)
        kinds = _decoder_types(self.spec)
        self.kind = "byte_level" if "ByteLevel" in kinds else "byte_fallback" if "ByteFallback" in kinds else "decode"
        if self.kind == "decode":
            log.info("tokenizer decoder %s: logprob bytes of split characters come out as U+FFFD", sorted(kinds))
        self.added = {i: s for s, i in tok.get_added_vocab().items()}
        self.byte_decoder = _gpt2_byte_decoder()
        self._cache: dict[int, bytes] = {}

    def _bytes_of(self, tid: int) -> bytes:
        if tid in self.added:
            return self.added[tid].encode()
        if self.kind == "decode":
            return self.tok.decode([tid]).encode()
        piece = self.tok.convert_ids_to_tokens(tid)
        if piece is None:  # the model's vocabulary may be larger than the tokenizer's
            return b""
        if self.kind == "byte_level":
            try:
                return bytes(self.byte_decoder[c] for c in piece)
            except KeyError:  # not a byte-level string after all
                return piece.encode()
        m = _BYTE_TOKEN.fullmatch(piece)
        return bytes([int(m.group(1), 16)]) if m else piece.replace("\u2581", " ").encode()

    def bytes_of(self, tid: int) -> bytes:
        b = self._cache.get(tid)
        if b is None:
            b = self._cache[tid] = self._bytes_of(tid)
        return b

    def text_of(self, tid: int) -> str:
        return self.bytes_of(tid).decode("utf-8", errors="replace")

    def max_token_bytes(self) -> int | None:
        """The most input bytes one token can stand for; None where the vocabulary does not say
        (then no length bound is derived from it)."""
        if self.kind == "decode":
            return None
        pieces = self.tok.convert_ids_to_tokens(list(range(len(self.tok))))
        longest = 0
        for tid, piece in enumerate(pieces):
            if piece is not None and len(piece.encode()) > longest:  # the string's UTF-8 bounds its bytes
                longest = max(longest, len(self.bytes_of(tid)))
        return max([longest, *(len(s.encode()) for s in self.added.values())])
