"""One request's grammar state: an xgrammar matcher plus an optional gate.

The gate serves reasoning models: with `after_token` set (Qwen3's `</think>`), tokens up to and
including the first `after_token` are free (the reasoning), and the grammar constrains what
follows (the answer). Invariant: the matcher has accepted exactly the request's output tokens
after the gate opened, so its mask is the one for the request's next token.

`terminated` is kept as a flag rather than asked of xgrammar each step (a call per row per step
adds up at batch 256): the matcher terminates only on accepting one of its stop tokens, so it
is asked only then.
"""

from __future__ import annotations

from typing import Any


class RowGrammar:
    __slots__ = ("matcher", "after_token", "active", "rejected", "terminated", "stop_ids")

    def __init__(self, compiled: Any, stop_ids: list[int], after_token: int | None) -> None:
        import xgrammar as xgr

        # The request's own stop tokens (its EOS ids, stop_token_ids) end the grammar: they are
        # allowed exactly where the grammar is complete.
        self.matcher = xgr.GrammarMatcher(compiled, override_stop_tokens=sorted(set(stop_ids)) or None)
        self.stop_ids = frozenset(self.matcher.stop_token_ids)  # the tokenizer's when the request has none
        self.after_token = after_token
        self.active = after_token is None  # False: inside the free prefix (the gate is closed)
        self.rejected = False
        self.terminated = False

    @property
    def needs_mask(self) -> bool:
        return self.active and not self.rejected and not self.terminated

    @property
    def takes_tokens(self) -> bool:
        """Whether the next token goes to the matcher (the gate is open and nothing ended it)."""
        return self.active and not self.rejected

    def accept(self, token: int) -> bool:
        """Advances on a sampled token; False if the grammar forbids it (then `rejected`)."""
        if not self.active:
            self.active = token == self.after_token
            return True
        if self.rejected:
            return False
        return self.record(token, self.matcher.accept_token(token))

    def record(self, token: int, ok: bool) -> bool:
        """Takes the matcher's answer for `token` (accepted or not), as accept() does."""
        if not ok:
            self.rejected = True
            return False
        if token in self.stop_ids:
            self.terminated = self.matcher.is_terminated()
        return True

    def fill(self, bitmask: Any, index: int) -> None:
        self.matcher.fill_next_token_bitmask(bitmask, index)
