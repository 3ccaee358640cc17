"""n-gram drafting: the vectorized batch search against a plain loop over each context."""

from __future__ import annotations

import random

import numpy as np

from minisgl.speculative.drafter import DraftRequest
from minisgl.speculative.ngram import NgramDrafter, ngram_drafts


def loop_reference(ctx: list[int], k: int, min_n: int, max_n: int) -> list[int]:
    """Longest suffix n in [min_n, max_n] seen earlier; its latest earlier end e; the k tokens
    after e, the period W - 1 - e repeating past the end of the context."""
    w = len(ctx)
    for n in range(min(max_n, w - 1), min_n - 1, -1):
        suffix = ctx[w - n :]
        for e in range(w - 2, n - 2, -1):
            if ctx[e - n + 1 : e + 1] == suffix:
                period = w - 1 - e
                return [ctx[e + 1 + j % period] for j in range(k)]
    return []


def test_matches_loop_reference_on_random_contexts() -> None:
    rng = random.Random(0)
    for trial in range(40):
        b = rng.randint(1, 6)
        vocab = rng.choice([3, 5, 20])  # small vocabularies: many matches, ties, periods
        ctxs = [[rng.randrange(vocab) for _ in range(rng.choice([0, 1, 2, 3, 7, 30, 61]))] for _ in range(b)]
        ks = [rng.choice([0, 1, 3, 5]) for _ in range(b)]
        min_n, max_n = rng.choice([(1, 1), (1, 3), (2, 4), (3, 3)])
        got = ngram_drafts([np.array(c, dtype=np.int64) for c in ctxs], ks, min_n, max_n)
        want = [loop_reference(c, k, min_n, max_n) for c, k in zip(ctxs, ks)]
        assert got == want, f"trial {trial}: {ctxs} {ks} {min_n}-{max_n}"


def test_copies_a_repeated_passage_and_extends_a_loop() -> None:
    passage = [11, 12, 13, 14, 15, 16, 17, 18]
    ctx = [1, 2] + passage + [3, 4] + passage[:3]
    assert ngram_drafts([np.array(ctx)], [4], 2, 4) == [[14, 15, 16, 17]]
    loop = [7, 8, 9] * 3
    assert ngram_drafts([np.array(loop)], [5], 1, 3) == [[7, 8, 9, 7, 8]]
    assert ngram_drafts([np.array([1, 2, 3, 4])], [3], 1, 3) == [[]]  # nothing repeats


def test_drafter_keeps_histories_incrementally() -> None:
    d = NgramDrafter(1, 3)
    ctx = [5, 6, 7, 5, 6]
    assert d.propose([DraftRequest(key=1, row=0, prompt=ctx[:3], output=ctx[3:], k=2)]) == [[7, 5]]
    ctx += [7, 9, 5]
    assert d.propose([DraftRequest(key=1, row=0, prompt=ctx[:3], output=ctx[3:], k=2)]) == [[6, 7]]
    d.release(1)
    assert 1 not in d._hist
