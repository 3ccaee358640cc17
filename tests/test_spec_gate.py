"""The speculation gate: it pauses speculation (plain, overlapped decode steps) while drafts are
not accepted, for pauses that double up to MAX_PAUSE between probes, and reopens on a good
probe; through the LLM, a workload the n-gram drafter cannot predict runs mostly plain steps,
and its output is unchanged."""

from __future__ import annotations

import random

import spec_models

from minisgl import LLM, SamplingParams
from minisgl.speculative.gate import SpecGate


def plain_steps(gate: SpecGate, n: int) -> int:
    return sum(not gate.open() for _ in range(n))


def test_gate_pauses_doubles_and_reopens() -> None:
    gate = SpecGate(min_accepted=0.5, max_pause=8)
    assert gate.open()
    gate.record(accepted=4, drafting=2)  # 2 per drafting request: stays open
    gate.record(accepted=1, drafting=2)  # average (2 + 0.5) / 2: still open
    assert plain_steps(gate, 5) == 0
    pauses = []
    for _ in range(6):  # nothing accepted: the average halves, then pauses of 1, 2, 4, 8, 8 steps
        gate.record(accepted=0, drafting=3)
        pauses.append(_pause_then_probe(gate))
    assert pauses == [0, 1, 2, 4, 8, 8]
    gate.record(accepted=0, drafting=0)  # nobody drafted: nothing gained either
    assert _pause_then_probe(gate) == 8
    gate.record(accepted=6, drafting=2)  # a good probe: the average (~0 + 3) / 2 clears 0.5
    assert plain_steps(gate, 10) == 0 and gate.pause == 0
    assert gate.paused_steps == 1 + 2 + 4 + 8 + 8 + 8


def _pause_then_probe(gate: SpecGate) -> int:
    n = 0
    while not gate.open():
        n += 1
    return n


def test_unpredictable_workload_runs_plain_steps(tiny_model_path) -> None:
    path = str(tiny_model_path("llama3"))
    rng = random.Random(1)
    prompts = [[rng.randrange(300, 3000) for _ in range(12)] for _ in range(2)]
    sp = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    want = LLM(path, device="cpu", dtype="float32").generate(prompts, sp, use_tqdm=False)
    llm = LLM(path, device="cpu", dtype="float32", speculative_algorithm="ngram", speculative_num_draft_tokens=3)
    gate = llm.scheduler.spec.gate
    gate.min_accepted = 0.5  # as served (the test suite keeps it open elsewhere)
    spec_models.assert_same_outputs(llm.generate(prompts, sp, use_tqdm=False), want)
    st = llm.scheduler.stats()
    assert st["spec_accepted"] == 0, "random tiny model: n-gram drafts are never accepted"
    assert st["spec_paused_steps"] > st["spec_verified"] > 0, st
