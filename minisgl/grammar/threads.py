"""Advancing and masking many grammar rows at once.

Per constrained row and step, xgrammar's mask fill costs ~5-50 us of host time (a JSON schema
over a 152k vocabulary; more inside strings) and accept_token a few us; both sit between a
step's forward and its sampling. Fills run through xgrammar's threaded batch fill (it releases
the GIL and splits the rows over its own threads); accepts are one batched call on the calling
thread: handing them to a thread pool cost more than it saved (H100 host, benchmarks/grammar.py:
0.39 ms per step at 256 rows on one thread, 3.8 ms on eight). Below PARALLEL_MIN_ROWS rows a
plain loop fills faster than xgrammar's threads.

`THREADS` is data: benchmarks/grammar.py prints the fill time at 1-16 threads and the offline
workload's throughput at 1, 4 and 8.
"""

from __future__ import annotations

import os
from typing import Any

from minisgl.grammar.matcher import RowGrammar

THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # half the cores (xgrammar's own default), at most 8
PARALLEL_MIN_ROWS = 8


class MatcherThreads:
    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or THREADS
        self._filler: Any = None

    @staticmethod
    def accept(grammars: list[RowGrammar], tokens: list[int]) -> list[bool]:
        """grammars[i].accept(tokens[i]) for every i (False: the grammar forbids the token)."""
        ok = [True] * len(grammars)
        taking = []
        for i, g in enumerate(grammars):
            if g.takes_tokens:
                taking.append(i)
            else:
                ok[i] = g.accept(tokens[i])  # the gate (no matcher call), or already rejected
        if len(taking) < 2:
            for i in taking:
                ok[i] = grammars[i].accept(tokens[i])
            return ok
        import xgrammar as xgr

        toks = [tokens[i] for i in taking]
        answers = xgr.BatchGrammarMatcher.batch_accept_token([grammars[i].matcher for i in taking], toks)
        for i, answer in zip(taking, answers):
            ok[i] = grammars[i].record(tokens[i], answer)
        return ok

    def fill(self, grammars: list[RowGrammar], host: Any) -> None:
        """Row j of the int32 [>= k, W] `host` becomes the mask of grammars[j]'s next token."""
        if len(grammars) < PARALLEL_MIN_ROWS or self.threads == 1:
            for j, g in enumerate(grammars):
                g.fill(host, j)
            return
        import xgrammar as xgr

        if self._filler is None:
            self._filler = xgr.BatchGrammarMatcher(self.threads)
        self._filler.batch_fill_next_token_bitmask([g.matcher for g in grammars], host)
