"""Per-step timing lines and the scheduler's hops of traced requests (MINISGL_TRACE_REQUESTS=1,
see message/trace.py), logged when the host has read the step's tokens:

    step 12 extend reqs=1 tokens=16 graph=16 host=0.31 ready=6.95 gpu=6.72 decodes=0 at=5123.456789 built=0.2

host: ms from the start of building the step to its launch returning (scheduling, sampling
inputs, index upload, graph replay or eager forward, sampling launch); ready: ms from that
start until the host saw the tokens (with overlap it reads them only after launching the next
step, so this is at least the next step's host time); gpu: ms of the stream from the step's
first device work to its tokens on the host (CUDA events; includes any gap the host leaves).
An eager step says why: `eager="no captured extend graph fits ..."`. decodes: the rows that
had a token before (their inter-token gap ends here); at: when the host saw the tokens
(CLOCK_MONOTONIC seconds), so consecutive steps' gaps are the ITLs the server emits; built:
ms until the batch was built, the host work before the forward is issued (after an idle
spell the GPU waits for it).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.engine.face import StepResult
from minisgl.logging_setup import get_logger
from minisgl.message import trace
from minisgl.scheduler.request import Request

log = get_logger("minisgl.scheduler")


@dataclass
class StepTrace:
    step: int
    start: float
    events: tuple[torch.cuda.Event, torch.cuda.Event] | None  # (start, end) on CUDA
    mode: str = ""
    requests: int = 0
    tokens: int = 0
    graph: int | None = None  # the replayed graph's bucket (tokens or batch size)
    eager: str | None = None  # why the step ran eagerly
    launched: float = 0.0
    decodes: int = 0  # rows continuing a request that already had tokens
    built: float = 0.0  # when the batch was built (the forward is issued next)


def begin(step: int, cuda: bool) -> StepTrace:
    events = None
    if cuda:
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
    return StepTrace(step, trace.now(), events)


def launched(st: StepTrace, step: StepResult, reqs: list[Request], samples: list[bool], decodes: int) -> None:
    """After the launch: the step's shape, and the hops of the traced requests in it."""
    st.launched, st.decodes = trace.now(), decodes
    if st.events is not None:
        st.events[1].record()
    st.mode, st.requests, st.tokens = step.mode, step.requests, step.tokens
    st.graph, st.eager = step.graph, step.eager
    for req, sampled in zip(reqs, samples):
        if req.trace is not None:
            trace.stamp(req.trace, "admit", st.start, first=True)
            if sampled and "launched" not in req.trace:
                trace.stamp(req.trace, "launched", st.launched)
                req.trace["step"] = st.step


def ready(st: StepTrace, reqs: list[Request], samples: list[bool]) -> None:
    """The host has the step's tokens: the requests' first-token hop, and the step's line."""
    at = trace.now()
    for req, sampled in zip(reqs, samples):
        if sampled and req.trace is not None:
            trace.stamp(req.trace, "ready", at, first=True)
    gpu = ""
    if st.events is not None:
        st.events[1].synchronize()  # it has: the host read the tokens after it
        gpu = f" gpu={st.events[0].elapsed_time(st.events[1]):.3f}"
    how = f"graph={st.graph}" if st.graph is not None else f'eager="{st.eager}"'
    log.info("step %d %s reqs=%d tokens=%d %s host=%.3f ready=%.3f%s decodes=%d at=%.6f built=%.3f", st.step,
             st.mode, st.requests, st.tokens, how, (st.launched - st.start) * 1e3, (at - st.start) * 1e3, gpu,
             st.decodes, at, (st.built - st.start) * 1e3)
