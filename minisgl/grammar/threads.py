"""Advancing and masking many grammar rows at once, on several cores.

Per constrained row and step, xgrammar's accept_token and mask fill each cost ~5-20 us of host
time (a JSON schema over a 152k vocabulary; benchmarks/grammar.py measures them), and both sit
between a step's forward and its sampling: at batch 256 a single thread would take milliseconds.
Both calls release the GIL, so rows are split into one contiguous chunk per thread: accepts run
as one batched call per chunk on a small thread pool, fills through xgrammar's own threaded
batch fill. Below PARALLEL_MIN_ROWS rows a plain loop on the calling thread is cheaper than
handing work to threads.

`THREADS` is data: benchmarks/grammar.py prints fill and accept times for 1 to 16 threads.
"""

from __future__ import annotations

import os
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from minisgl.grammar.matcher import RowGrammar

THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))  # half the cores (xgrammar's own default), at most 8
PARALLEL_MIN_ROWS = 8


def _chunks(n: int, parts: int) -> list[range]:
    step = -(-n // parts)
    return [range(i, min(n, i + step)) for i in range(0, n, step)]


class MatcherThreads:
    def __init__(self, threads: int = THREADS) -> None:
        self.threads = threads
        self._pool: ThreadPoolExecutor | None = None
        self._filler: Any = None

    def accept(self, grammars: list[RowGrammar], tokens: list[int]) -> list[bool]:
        """grammars[i].accept(tokens[i]) for every i (False: the grammar forbids the token)."""
        ok = [True] * len(grammars)
        taking = []
        for i, g in enumerate(grammars):
            if g.takes_tokens:
                taking.append(i)
            else:
                ok[i] = g.accept(tokens[i])  # the gate (no matcher call), or already rejected
        if len(taking) < PARALLEL_MIN_ROWS or self.threads == 1:
            for i in taking:
                ok[i] = grammars[i].accept(tokens[i])
            return ok
        import xgrammar as xgr

        if self._pool is None:
            self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="grammar-rows")
        parts = _chunks(len(taking), self.threads)
        matchers = [grammars[i].matcher for i in taking]
        toks = [tokens[i] for i in taking]
        futures = [self._pool.submit(xgr.BatchGrammarMatcher.batch_accept_token, matchers[r.start : r.stop],
                                     toks[r.start : r.stop]) for r in parts]
        answers = [a for f in futures for a in f.result()]
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
