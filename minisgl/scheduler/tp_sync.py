"""Lockstep inputs across tensor-parallel ranks.

Only rank 0 sees the outside world (new requests, aborts, stop strings found on text).
Before every scheduler step it broadcasts what changed; every rank applies the same inputs
in the same order and then steps, so the deterministic schedulers form identical batches
without shipping batches around.

The broadcast goes over the ranks' gloo group, not the ZMQ PUB socket DESIGN.md sketches: a
collective every rank enters once per step is the lockstep itself (no rank can run ahead or
miss a message), and gloo's TCP rendezvous already spans nodes.
"""

from __future__ import annotations

from typing import Any

import torch.distributed as dist

from minisgl.scheduler.request import Request

# Inputs: ("add", Request) | ("finish", uid, reason[, output tokens to keep]) | ("grammar", GrammarSpec)
# | ("flush", request id) | ("shutdown",). "grammar" starts compiling a grammar on every rank as soon as rank 0 sees a
# request that needs it; rank 0 sends the request's "add" once its own compile is done.
Input = tuple[Any, ...]


class InputSync:
    def __init__(self, rank: int, size: int, group: object) -> None:
        self.rank, self.size, self.group = rank, size, group

    def exchange(self, inputs: list[Input] | None) -> list[Input]:
        if self.size == 1:
            return inputs or []
        box = [inputs if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0] or []


def apply_inputs(
    scheduler, inputs: list[Input], requests: dict[int, Request], flushed: list | None = None
) -> bool:
    """Applies broadcast inputs to `scheduler` (rank 0 applies its own inputs the same way);
    `requests` maps uid -> this rank's copy; `flushed` gets (request id, why not or None) per
    cache flush, for rank 0 to answer. Returns False on shutdown."""
    for item in inputs:
        if item[0] == "add":
            req = item[1]
            requests[req.uid] = req
            scheduler.add(req)
        elif item[0] == "finish":
            req = requests.pop(item[1], None)
            if req is not None:
                scheduler.finish(req, item[2], *item[3:])
        elif item[0] == "grammar":
            if scheduler.grammar.compiler is not None:
                scheduler.grammar.compiler.prefetch(item[1])
        elif item[0] == "flush":
            refused = scheduler.flush_cache()
            if flushed is not None:
                flushed.append((item[1], refused))
        elif item[0] == "shutdown":
            return False
    return True
