"""The scheduler's side of structured output: each constrained request's grammar state, kept
in step with its tokens, and the mask of every constrained row applied before sampling.

Overlap: step N+1's forward is launched before the host reads step N's tokens, but a
constrained row's mask for step N+1 depends on its token from step N. So the mask is made
between the forward and the sampling of step N+1 (the step plan's LogitsMask, which runs after
the penalties and before sampling: engine/logits_plan.py sample_with_plan): if a
constrained row still has a token in flight, the host first reads the steps in flight (step N
finished on the device before step N+1's forward began, so this waits for nothing the device
still has to do), advances the grammars, then fills the masks while the forward runs. Batches
without constrained rows keep the plain overlap path and pay nothing.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from minisgl.engine.logits_plan import LogitsMask
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.masks import GrammarMasks
from minisgl.grammar.spec import grammar_spec
from minisgl.logging_setup import get_logger
from minisgl.scheduler.request import Request

log = get_logger("minisgl.scheduler")


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler | None, vocab_size: int, max_rows: int, device: torch.device):
        self.compiler = compiler
        self.masks = GrammarMasks(vocab_size, max_rows, device)

    def attach(self, req: Request) -> None:
        """Gives `req` its grammar state if it asks for one (waits for the compile: on rank 0 the
        request is only added once its grammar is compiled; other ranks compiled it meanwhile)."""
        spec = grammar_spec(req.params)
        if spec is None or req.grammar is not None:
            return
        if self.compiler is None:
            raise ValueError(f"{spec.kind}: structured output is not available here (no grammar compiler)")
        stops = [*req.eos_ids, *(req.params.stop_token_ids or [])]
        req.grammar = self.compiler.matcher(spec, stops, req.params.grammar_after_token)

    def step_mask(
        self, reqs: list[Request], samples: list[bool], drain: Callable[[], None]
    ) -> tuple[LogitsMask, list[bool]] | None:
        """A batch's mask and which of its rows it may change, or None when no row that samples
        has a grammar."""
        masked = [s and r.grammar is not None for r, s in zip(reqs, samples)]
        idx = [i for i, m in enumerate(masked) if m]
        if not idx:
            return None

        def mask(logits: torch.Tensor) -> None:
            if any(reqs[i].num_pending for i in idx):
                drain()  # their in-flight tokens decide this step's masks
            rows = [i for i in idx if not reqs[i].finished and reqs[i].grammar.needs_mask]
            if rows:
                self.masks.apply(logits, rows, [reqs[i].grammar for i in rows])

        return mask, masked

    @staticmethod
    def advance(req: Request, token: int) -> None:
        """After `req` appended `token` and is still running: the grammar takes it. A grammar that
        terminated (its stop token, e.g. with ignore_eos) or that rejected the token ends it."""
        g = req.grammar
        if not g.accept(token):
            # Only a row whose mask allowed nothing can get here (e.g. min_tokens banning the
            # EOS that a complete grammar requires).
            log.warning("request %d: token %d is outside its grammar; finishing it", req.uid, token)
            req.finish_reason = "stop"
        elif g.active and g.terminated:
            req.finish_reason = "stop"
