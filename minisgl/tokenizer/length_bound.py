"""A proven lower bound on the tokens of a text, from its UTF-8 length alone, so a text that
cannot fit the context is refused before it is tokenized (tokenizing 50 MB takes a minute
and gigabytes).

The argument: in a BPE tokenizer that keeps every input byte (byte-level, or SentencePiece
with byte fallback, and no pre-tokenizer that drops text), every byte of the normalized
text lies in exactly one token, and one token stands for at most `max_token_bytes` bytes
(the longest entry of the vocabulary or added tokens). Normalizers may shrink text: NFC/NFKC
and lowercasing by at most 4x per byte (U+1D400 is 4 bytes, its NFKC form "A" one), a
literal Replace by its pattern/content ratio. So

    tokens >= ceil(utf8_bytes / (max_token_bytes * shrink)).

Anything this module cannot vouch for (WordPiece, Unigram, stripping normalizers, regex
replaces, whitespace-dropping pre-tokenizers, slow tokenizers) gets no bound: such text is
only limited by --max-request-bytes.
"""

from __future__ import annotations

from typing import Any

_UNICODE_SHRINK = 4.0  # NFC/NFKC/lowercase: at most 4 UTF-8 bytes become 1
_KEEPING_PRE_TOKENIZERS = {"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"}


def _shrink(norm: dict[str, Any] | None) -> float | None:
    """How many times the normalizer may shrink text's UTF-8 length at most; None: unknown."""
    if not norm:
        return 1.0
    kind = norm.get("type")
    if kind == "Sequence":
        total = 1.0
        for part in norm.get("normalizers", []):
            s = _shrink(part)
            if s is None:
                return None
            total *= s
        return total
    if kind in ("NFD", "NFKD", "Prepend"):
        return 1.0  # these only add
    if kind in ("NFC", "NFKC", "Lowercase"):
        return _UNICODE_SHRINK
    if kind == "Replace":
        pattern, content = norm.get("pattern", {}), norm.get("content", "")
        literal = pattern.get("String") if isinstance(pattern, dict) else None
        if not literal or not content:
            return None
        return max(1.0, len(literal.encode()) / len(content.encode()))
    return None  # Strip, StripAccents, BertNormalizer, Precompiled, ...: may drop text


def _keeps_all_text(pre: dict[str, Any] | None) -> bool:
    if not pre:
        return True
    kind = pre.get("type")
    if kind == "Sequence":
        return all(_keeps_all_text(p) for p in pre.get("pretokenizers", []))
    if kind == "Split":
        return pre.get("behavior") != "Removed"
    return kind in _KEEPING_PRE_TOKENIZERS


def bytes_per_token_bound(spec: dict[str, Any] | None, max_token_bytes: int | None) -> float | None:
    """The most UTF-8 input bytes one token can account for; None when unproven."""
    if spec is None or max_token_bytes is None:
        return None
    model = spec.get("model") or {}
    keeps_bytes = model.get("type") == "BPE" and (
        model.get("byte_fallback") or "ByteLevel" in str(spec.get("pre_tokenizer"))
    )
    if not keeps_bytes or model.get("fuse_unk") or not _keeps_all_text(spec.get("pre_tokenizer")):
        return None
    shrink = _shrink(spec.get("normalizer"))
    return None if shrink is None else max_token_bytes * shrink


def min_tokens(text_bytes: int, bound: float | None) -> int:
    """A lower bound on the tokens of a text of `text_bytes` UTF-8 bytes (0: none known)."""
    if bound is None or bound <= 0:
        return 0
    return int(text_bytes / bound)  # floor, not ceil: float rounding must not overshoot
