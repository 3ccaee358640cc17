"""Finding where a JSON value ends in text that arrives in pieces (no parsing of values)."""

from __future__ import annotations


class JsonValueEnd:
    """Feed characters of one JSON object or array (starting at its `{` or `[`); `end` becomes
    the offset just past the value once its closing bracket arrives. Strings and escapes are
    tracked, so brackets inside strings do not count."""

    __slots__ = ("depth", "in_string", "escaped", "seen", "end")

    def __init__(self) -> None:
        self.depth = 0
        self.in_string = False
        self.escaped = False
        self.seen = 0  # characters consumed
        self.end: int | None = None

    def feed(self, text: str) -> None:
        for ch in text:
            if self.end is not None:
                return
            self.seen += 1
            if self.in_string:
                if self.escaped:
                    self.escaped = False
                elif ch == "\\":
                    self.escaped = True
                elif ch == '"':
                    self.in_string = False
            elif ch == '"':
                self.in_string = True
            elif ch in "{[":
                self.depth += 1
            elif ch in "}]":
                self.depth -= 1
                if self.depth == 0:
                    self.end = self.seen
