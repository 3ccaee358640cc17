"""Grammar rows advanced in one batched call and masked on several threads
(minisgl/grammar/threads.py) equal the one-row-at-a-time path: accepts (gate, rejection,
termination on a stop token) and filled masks, on rows in different states; and the host order
of a constrained step under overlap: the forward is launched before the previous step's tokens
are read, the matchers advanced and the mask filled, and the sampling comes after the mask
(CPU, tiny model)."""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from test_grammar import PROMPTS, SCHEMA, sampled

from minisgl import LLM
from minisgl.core.grammar_fields import GrammarSpec
from minisgl.grammar import threads as T
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.kernels.token_bitmask import unpack_bitmask_reference


@pytest.fixture(scope="module")
def llm(tiny_model_path: Callable[[str], Path]) -> LLM:
    return LLM(str(tiny_model_path("llama3")), device="cpu", max_model_len=256, num_pages=2048)


def test_batched_accept_and_threaded_fill_equal_one_row_at_a_time(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(T, "PARALLEL_MIN_ROWS", 4)
    comp = GrammarCompiler(lambda: llm.tokenizer, llm.engine.model_config.vocab_size)
    import json

    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    eos = llm.tokenizer.eos_token_id
    gate = 7
    vocab, words = comp.vocab_size, -(-comp.vocab_size // 32)
    rng = random.Random(3)
    host = torch.empty(24, words, dtype=torch.int32)
    threaded, single = T.MatcherThreads(3), T.MatcherThreads(1)
    short = GrammarSpec("regex", "[ab]{1,3}")  # completes within a few tokens: its rows terminate

    def row(i: int):  # noqa: ANN202 - a RowGrammar: some gated, some under the short regex
        return comp.matcher(short if i % 3 == 1 else spec, [eos], gate if i % 5 == 0 else None)

    pairs = [(row(i), row(i)) for i in range(24)]
    for step in range(12):
        a = [p[0] for p in pairs if not p[0].terminated]
        b = [p[1] for p in pairs if not p[1].terminated]
        assert len(a) == len(b) and [g.needs_mask for g in a] == [g.needs_mask for g in b]
        want = torch.empty(len(b), words, dtype=torch.int32)
        live = [j for j, g in enumerate(a) if g.needs_mask]
        threaded.fill([a[j] for j in live], host)
        single.fill([b[j] for j in live], want)
        assert torch.equal(host[: len(live)], want[: len(live)])
        allowed = unpack_bitmask_reference(want[: len(live)], vocab)
        # Gates: rows 0, 10, 20 open at step 2; 5 and 15 stay closed.
        tokens = [gate if not g.active and step == 2 and i % 2 == 0 else rng.randrange(vocab) for i, g in enumerate(b)]
        for n, j in enumerate(live):  # mostly allowed tokens; an EOS where allowed; some forbidden
            ids = allowed[n].nonzero().flatten().tolist()
            tokens[j] = eos if eos in ids and rng.random() < 0.5 else ids[rng.randrange(len(ids))]
            if rng.random() < 0.08:
                tokens[j] = next(t for t in range(vocab) if t not in set(ids))
        got = threaded.accept(a, tokens)
        assert got == [g.accept(t) for g, t in zip(b, tokens)]
        for x, y in zip(a, b):
            assert (x.active, x.rejected, x.terminated) == (y.active, y.rejected, y.terminated)
            assert y.terminated == y.matcher.is_terminated()
    seen = [(g.rejected, g.terminated, g.active) for g, _ in pairs]
    assert any(r for r, _, _ in seen) and any(t for _, t, _ in seen) and any(not a for _, _, a in seen)


def test_overlap_step_order_with_grammars(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each overlapped constrained decode step: forward N+1, then step N's tokens read and the
    matchers advanced, then the mask filled, then sampling N+1."""
    sched, eng = llm.scheduler, llm.engine
    assert sched.cfg.overlap
    events: list[str] = []

    def spy(obj: object, name: str, label: str) -> None:
        inner = getattr(obj, name)

        def wrapped(*a, **k):  # noqa: ANN002, ANN003, ANN202
            events.append(label)
            return inner(*a, **k)

        monkeypatch.setattr(obj, name, wrapped)

    spy(eng, "forward", "forward")
    spy(sched, "_process", "read")
    spy(sched.grammar, "advance", "advance")
    spy(sched.grammar.masks, "fill", "fill")
    spy(eng, "sample", "sample")
    out = llm.generate(PROMPTS[:3], sampled(3, json_schema=SCHEMA, cap=12), use_tqdm=False)
    assert all(len(o["token_ids"]) > 3 for o in out)
    seq = " ".join(events)
    # Prefill: forward, fill (no token in flight yet), sample; then every decode step reads the
    # step before it only after its own forward is launched.
    assert seq.startswith("forward fill sample forward read advance fill sample forward read advance fill sample")
    for step in seq.split("forward ")[2:]:  # the decode steps
        assert step.startswith("read advance fill sample") or "fill" not in step, seq
