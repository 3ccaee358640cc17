"""Incremental, UTF-8-safe decoding with stop strings, per request (the detokenizer
process and the offline LLM both use it).

Text is decoded over a sliding window of tokens (as vLLM and SGLang do): `decode(ids[p:])`
minus `decode(ids[p:r])`, where ids[p:r] last decoded cleanly. A window whose text ends in
U+FFFD holds a character still split across tokens, so it is held until the rest arrives.
Stop strings are searched in the decoded text; while the text ends with the beginning of
a stop string, that tail is held back, so a stop string is never partly sent. At finish,
the whole output is decoded once more and everything not yet sent is sent: nothing is held.
"""

from __future__ import annotations

from functools import lru_cache
from typing import Any

from minisgl.message import DetokInit

_REPLACEMENT = "\ufffd"


@lru_cache(maxsize=8)
def _added_ids(tok: Any) -> frozenset[int]:
    return frozenset(tok.get_added_vocab().values())


def decode_spaced(tok: Any, ids: list[int]) -> str:
    """transformers' slow-tokenizer rule for spaces_between_special_tokens: text between
    added tokens is decoded in runs, and runs and added tokens are joined with spaces (fast
    tokenizers ignore the flag, so it is done here)."""
    added, parts, run = _added_ids(tok), [], []
    for t in ids:
        if t in added:
            if run:
                parts.append(tok.decode(run))
                run = []
            parts.append(tok.decode([t]))
        else:
            run.append(t)
    if run:
        parts.append(tok.decode(run))
    return " ".join(parts)


class DecodeState:
    def __init__(self, tokenizer: Any, init: DetokInit) -> None:
        self.tok = tokenizer
        self.init = init
        self.ids: list[int] = []
        self.prefix_offset = 0
        self.read_offset = 0
        self.text = ""  # decoded so far (complete characters only until finish)
        self.sent = 0  # characters of `text` already sent
        self.searched = 0  # characters of `text` already searched for stop strings
        self.stops = init.stop or []
        self.max_stop = max((len(s) for s in self.stops), default=0)
        self.stop_end = 0  # where the stop string find_stop found ends
        self.spaced = bool(init.spaces_between_special_tokens) and not init.skip_special_tokens

    def _decode(self, ids: list[int]) -> str:
        if self.spaced:
            return decode_spaced(self.tok, ids)
        return self.tok.decode(ids, skip_special_tokens=self.init.skip_special_tokens)

    def add(self, ids: list[int]) -> None:
        self.ids.extend(ids)
        prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
        window = self._decode(self.ids[self.prefix_offset :])
        if len(window) > len(prefix) and not window.endswith(_REPLACEMENT):
            self.text += window[len(prefix) :]
            self.prefix_offset, self.read_offset = self.read_offset, len(self.ids)

    def add_until_stop(self, ids: list[int]) -> int | None:
        """Adds `ids` one at a time, stopping after the token that completes a stop string (a
        speculative step brings several tokens; the ones after a stop are not output). Returns
        where the stop string starts in `text` (then `ids` holds that token last), or None."""
        if not self.stops:
            self.add(ids)
            return None
        for i in ids:
            self.add([i])
            cut = self.find_stop()
            if cut is not None:
                return cut
        return None

    def find_stop(self) -> int | None:
        """Index in `text` where the first stop string starts, if one is complete now."""
        if not self.stops:
            return None
        # A match must end in the part not yet searched (earlier ones were found then).
        start = max(0, self.searched - self.max_stop + 1)
        self.searched = len(self.text)
        hits = [(i, i + len(s)) for s in self.stops if (i := self.text.find(s, start)) >= 0]
        if not hits:
            return None
        begin, self.stop_end = min(hits)
        return begin

    def finalize(self) -> None:
        """The request ended: decode everything, including a trailing partial character."""
        full = self._decode(self.ids)
        if full.startswith(self.text[: self.sent]):
            self.text = full  # the offline LLM's text exactly
        else:  # window and full decode disagree: finish the client's version instead
            prefix = self._decode(self.ids[self.prefix_offset : self.read_offset])
            self.text += self._decode(self.ids[self.prefix_offset :])[len(prefix) :]
        self.searched = min(self.searched, self.sent)

    def _held_back(self) -> int:
        """Length of the longest tail of `text` that begins some stop string."""
        for k in range(min(self.max_stop - 1, len(self.text) - self.sent), 0, -1):
            tail = self.text[-k:]
            if any(s.startswith(tail) for s in self.stops):
                return k
        return 0

    def take(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        delta = self.text[self.sent : end] if end > self.sent else ""
        self.sent = max(self.sent, end)
        return delta
