"""Prompt-lookup (n-gram) drafting: the longest suffix of a request's context, between
`min_n` and `max_n` tokens long, that occurred earlier in the context proposes the tokens
that followed its most recent earlier occurrence.

Vectorized over the batch in numpy: contexts are right-aligned in one [B, P + W] matrix (W =
the longest context, P = max_n columns of padding, padding = -1), and one comparison per
suffix offset t < max_n marks, for every earlier end position e, whether the match run ending
at e reaches length t + 1. The best end has the longest run, then the largest e. If the match
ends right before the context does (period p = W - 1 - e small), the continuation runs into
tokens not generated yet; the draft then repeats the period (token j = ctx[e + 1 + j % p]),
the natural guess for a loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from minisgl.speculative.drafter import Drafter, DraftRequest


def ngram_drafts(contexts: Sequence[np.ndarray], ks: Sequence[int], min_n: int, max_n: int) -> list[list[int]]:
    """Per context (1-D int array), up to ks[i] tokens ([] when nothing matches or k is 0)."""
    b = len(contexts)
    kmax = max(ks, default=0)
    if b == 0 or kmax == 0:
        return [[] for _ in range(b)]
    w = max(len(c) for c in contexts)
    if w < 2:
        return [[] for _ in range(b)]
    pad = max_n
    mat = np.full((b, pad + w), -1, dtype=np.int64)
    for i, c in enumerate(contexts):
        if len(c):
            mat[i, pad + w - len(c) :] = c
    ends = np.arange(w - 1)  # candidate end e of an earlier occurrence; it continues at e + 1
    run = np.zeros((b, w - 1), dtype=np.int64)
    alive = np.ones((b, w - 1), dtype=bool)
    for t in range(max_n):
        window = mat[:, pad + ends - t]  # left padding keeps e - t >= -max_n in range
        suffix = mat[:, pad + w - 1 - t][:, None]
        alive &= (window >= 0) & (window == suffix)  # a padding token never matches
        if not alive.any():
            break
        run += alive
    score = np.where(run >= min_n, run * w + ends[None, :], -1)
    best = score.argmax(axis=1)
    found = score[np.arange(b), best] >= 0
    period = (w - 1) - best  # >= 1
    js = np.arange(kmax)
    idx = pad + best[:, None] + 1 + js[None, :] % period[:, None]
    drafts = np.take_along_axis(mat, idx, axis=1)
    return [drafts[i, : ks[i]].tolist() if found[i] else [] for i in range(b)]


class _History:
    """A request's tokens as a growing numpy array (appended to, never rebuilt per step)."""

    def __init__(self) -> None:
        self.buf = np.empty(64, dtype=np.int64)
        self.n = 0

    def sync(self, req: DraftRequest) -> np.ndarray:
        if req.length < self.n:  # not an extension of what we hold: start over
            self.n = 0
        new = req.tail(self.n)
        if self.n + len(new) > len(self.buf):
            grown = np.empty(max(2 * len(self.buf), self.n + len(new)), dtype=np.int64)
            grown[: self.n] = self.buf[: self.n]
            self.buf = grown
        self.buf[self.n : self.n + len(new)] = new
        self.n += len(new)
        return self.buf[: self.n]


class NgramDrafter(Drafter):
    name = "ngram"

    def __init__(self, min_n: int, max_n: int) -> None:
        self.min_n, self.max_n = min_n, max_n
        self._hist: dict[int, _History] = {}

    def propose(self, reqs: list[DraftRequest]) -> list[list[int]]:
        contexts = [self._hist.setdefault(r.key, _History()).sync(r) for r in reqs]
        return ngram_drafts(contexts, [r.k for r in reqs], self.min_n, self.max_n)

    def release(self, key: int) -> None:
        self._hist.pop(key, None)
