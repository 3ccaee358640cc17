"""The scheduler's side of structured output: each constrained request's grammar state, kept
in step with its tokens, and the mask of every constrained row applied before sampling.

Overlap: step N+1's forward is launched before the host reads step N's tokens, but a
constrained row's mask for step N+1 depends on its token from step N. So the mask is made
between the forward and the sampling of step N+1 (the step plan's LogitsMask, which runs after
the penalties and before sampling: sampling/logits_plan.py sample_with_plan): if a
constrained row still has a token in flight, the host first reads the steps in flight (step N
finished on the device before step N+1's forward began, so this waits for nothing the device
still has to do), advances the grammars, then fills the masks while the forward runs. Batches
without constrained rows keep the plain overlap path and pay nothing.

Host order of one constrained step N+1 (overlap), and why it is this one:
  launch forward N+1 (no mask needed) -> [mask callback] read step N's tokens -> advance every
  constrained row's matcher (one batched call) -> fill step N+1's bitmask (threaded, pinned
  buffer) -> copy it (on a side stream: the copy overlaps the forward too) -> mask, sample
  N+1 -> schedule and launch step N+2.
The device runs forward N+1 meanwhile; it idles only when the host's share of a step (reading,
advancing, filling, scheduling) outlasts the device's.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch

from minisgl.core.grammar_fields import grammar_spec
from minisgl.core.logits_spec import LogitsMask
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.masks import GrammarMasks
from minisgl.grammar.threads import MatcherThreads
from minisgl.logging_setup import get_logger
from minisgl.scheduler.request import Request

log = get_logger("minisgl.scheduler")


class GrammarRows:
    def __init__(self, compiler: GrammarCompiler | None, vocab_size: int, max_rows: int, device: torch.device):
        self.compiler = compiler
        self.masks = GrammarMasks(vocab_size, max_rows, device)
        # Host seconds spent on grammar work, for benchmarks: inside the mask callback, the wait
        # for in-flight tokens and their processing ("drain", advancing included) and the mask
        # (fill, copy, launch); advancing matchers, wherever it runs.
        self.host_s = {"drain": 0.0, "advance": 0.0, "fill": 0.0, "masked_steps": 0.0}

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

    def step_mask(self, reqs: list[Request], samples: list[bool], drain: Callable[[], None]) -> LogitsMask | None:
        """A batch's mask, or None when no row that samples has a grammar."""
        idx = [i for i, (r, s) in enumerate(zip(reqs, samples)) if s and r.grammar is not None]
        if not idx:
            return None

        def mask(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
            t0 = time.perf_counter()
            if any(reqs[i].num_pending for i in idx):
                drain()  # their in-flight tokens decide this step's masks
            t1 = time.perf_counter()
            rows = [i for i in idx if not reqs[i].finished and reqs[i].grammar.needs_mask]
            out = None
            if rows:
                out = self.masks.apply(logits, rows, [reqs[i].grammar for i in rows], with_lse=True)
            h = self.host_s
            h["drain"] += t1 - t0
            h["fill"] += time.perf_counter() - t1
            h["masked_steps"] += 1
            return out

        return mask

    def advance(self, reqs: list[Request], tokens: list[int]) -> list[Request]:
        """After each of `reqs` appended its token and is still running: the grammars take them
        (all rows in one batched call). A grammar that terminated (its stop token, e.g. with
        ignore_eos) or that rejected the token ends its request. Returns the requests it ended."""
        t0 = time.perf_counter()
        ok = MatcherThreads.accept([r.grammar for r in reqs], tokens)
        ended = []
        for req, tok, accepted in zip(reqs, tokens, ok):
            if not accepted:
                # Only a row whose mask allowed nothing can get here (e.g. min_tokens banning the
                # EOS that a complete grammar requires).
                log.warning("request %d: token %d is outside its grammar; finishing it", req.uid, tok)
            elif not (req.grammar.active and req.grammar.terminated):
                continue
            req.finish_reason = "stop"
            ended.append(req)
        self.host_s["advance"] += time.perf_counter() - t0
        return ended
