"""KV-slot poisoning for graph tests: NaN in every slot before a run, then any slot written
that no request was handed (padding rows must write only the dummy slot) fails the test."""

from __future__ import annotations

import math

import torch

from minisgl import LLM
from minisgl.kvcache.pool import DUMMY_SLOT


def poison_and_track(llm: LLM) -> set[int]:
    """NaN in every KV slot (target's and drafter's); returns the set of slots handed out."""
    eng = llm.engine
    pools = [eng.pool] + ([eng.drafter.pool] if eng.drafter is not None and eng.drafter.has_model else [])
    for pool in pools:
        pool._k.fill_(math.nan)
        pool._v.fill_(math.nan)
    handed_out: set[int] = set()
    allocate = eng.allocator.allocate

    def allocate_and_record(n: int) -> list[int]:
        pages = allocate(n)
        handed_out.update(eng.allocator.slot_ids(pages))
        return pages

    eng.allocator.allocate = allocate_and_record
    return handed_out


def assert_no_stray_writes(llm: LLM, handed_out: set[int]) -> None:
    eng = llm.engine
    pools = [eng.pool] + ([eng.drafter.pool] if eng.drafter is not None and eng.drafter.has_model else [])
    for pool in pools:
        written = (~torch.isnan(pool._k)).any(-1).any(-1).any(0)  # [slots]: written in some layer
        stray = set(written.nonzero().flatten().tolist()) - handed_out - {DUMMY_SLOT}
        assert not stray, f"padding wrote KV slots {sorted(stray)[:8]} that no request owns"
