"""One request's grammar state: an xgrammar matcher plus an optional gate.

The gate serves reasoning models: with `after_token` set (Qwen3's `</think>`), tokens up to and
including the first `after_token` are free (the reasoning), and the grammar constrains what
follows (the answer). Invariant: the matcher has accepted exactly the request's output tokens
after the gate opened, so its mask is the one for the request's next token.
"""

from __future__ import annotations

from typing import Any


class RowGrammar:
    __slots__ = ("matcher", "after_token", "active", "rejected")

    def __init__(self, compiled: Any, stop_ids: list[int], after_token: int | None) -> None:
        import xgrammar as xgr

        # The request's own stop tokens (its EOS ids, stop_token_ids) end the grammar: they are
        # allowed exactly where the grammar is complete.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_ids)) or None)
        self.after_token = after_token
        self.active = after_token is None  # False: inside the free prefix (the gate is closed)
        self.rejected = False

    @property
    def terminated(self) -> bool:
        return self.matcher.is_terminated()

    @property
    def needs_mask(self) -> bool:
        return self.active and not self.rejected and not self.matcher.is_terminated()

    def accept(self, token: int) -> bool:
        """Advances on a sampled token; False if the grammar forbids it (then `rejected`)."""
        if not self.active:
            self.active = token == self.after_token
            return True
        if self.rejected or not self.matcher.accept_token(token):
            self.rejected = True
            return False
        return True

    def fill(self, bitmask: Any, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)
