"""Pauses speculation while its drafts are not accepted, so that a workload the drafter cannot
predict (n-gram on text that does not repeat its context, a poor draft model) runs as plain,
overlapped decode steps instead of verify steps that gain nothing.

A verify step of b requests costs about c x a plain decode step (c ~ 1.1-1.5 under graphs at
small batches, benchmarks/spec_verify.py; more where the draft table has not switched it off)
and it is not overlapped with the next step; it gains the accepted draft tokens. The gate keeps
an exponential average of the accepted draft tokens per drafting request and step; below
MIN_ACCEPTED it closes for a pause of plain steps (1, 2, 4, ... up to MAX_PAUSE), after which
one verify step probes again. A good probe reopens it and resets the pause. Decisions depend
only on accepted counts, identical on every TP rank, so the ranks stay in lockstep.
Pausing is lossless as speculation is: greedy output is unchanged and sampled output keeps its
distribution, but a seeded request's tokens depend on which of its steps verified (rejection
sampling draws otherwise than a plain decode) and so on the gate's state, which carries over from one
batch to the next.
"""

from __future__ import annotations

MIN_ACCEPTED = 0.5  # draft tokens accepted per drafting request and step worth a verify step
# Plain decode steps between probes at most. A probe costs a few plain steps (the in-flight step
# is drained, the verify is not overlapped): at 256 a workload that never accepts pays ~1%
# (the offline n-gram run on dummy weights), and one that starts accepting waits <= 256 steps.
MAX_PAUSE = 256


class SpecGate:
    def __init__(self, min_accepted: float | None = None, max_pause: int = MAX_PAUSE) -> None:
        self.min_accepted = MIN_ACCEPTED if min_accepted is None else min_accepted
        self.max_pause = max_pause
        self.average: float | None = None
        self.pause = 0  # the current pause length (0: open)
        self.left = 0  # plain steps left in it
        self.paused_steps = 0  # decode steps the gate turned into plain ones (cumulative)

    def open(self) -> bool:
        """Whether this decode step may speculate (called once per decode step that could)."""
        if self.left > 0:
            self.left -= 1
            self.paused_steps += 1
            return False
        return True

    def record(self, accepted: int, drafting: int) -> None:
        """After a verify step: `accepted` draft tokens over `drafting` requests that had drafts
        (0: no request drafted; counts as nothing accepted)."""
        rate = accepted / drafting if drafting else 0.0
        self.average = rate if self.average is None else 0.5 * (self.average + rate)
        if self.average >= self.min_accepted:
            self.pause = 0
            return
        self.pause = min(max(1, 2 * self.pause), self.max_pause)
        self.left = self.pause
