"""The scheduler: radix prefix cache, chunked prefill, estimate-based admission, retraction
under KV pressure, and overlap of host work with device work.

Step policy: with nothing decoding, a prefill step takes up to `max_prefill_tokens` prompt
tokens. While requests decode and prompts wait, each step is mixed: every decode plus a
prefill chunk of at most `mixed_chunk_tokens` tokens in one forward (one CUDA graph), so a new
prompt costs the running streams a somewhat longer step, never a stall of a whole prefill.
The chunk size is a latency budget (DESIGN.md §4). `mixed_chunk_tokens=0` instead alternates
prefill steps and decode steps.

Overlap: step N+1 is scheduled and launched before the host reads step N's tokens. Decode
inputs come from the engine's device-side token buffer, and everything the host needs to
schedule (lengths, length limits) is known without the token values. A request that ends on
EOS or a stop token is found one step late; its extra token is computed and dropped.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch

from minisgl.core.logits_spec import LogitsSpec
from minisgl.core.sampling_params import RequestError
from minisgl.engine.engine import Engine
from minisgl.engine.face import Step, StepResult
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.kvcache.events import CacheEvents
from minisgl.kvcache.select import make_prefix_cache
from minisgl.logging_setup import get_logger, startup_phase
from minisgl.message import trace
from minisgl.scheduler import step_trace
from minisgl.scheduler.config import SchedulerConfig
from minisgl.scheduler.grammar_rows import GrammarRows
from minisgl.scheduler.kv import RequestKV
from minisgl.scheduler.pooling import run_pool_step, split_pooling
from minisgl.scheduler.prefill import PrefillPlan, admit, finish_admitted
from minisgl.scheduler.priority import preemption_victims, retraction_order
from minisgl.scheduler.queues import RequestQueues
from minisgl.scheduler.request import Request
from minisgl.scheduler.spec_step import SpecStep
from minisgl.scheduler.step_sampling import add_prompt_logprobs, fresh_histories, prompt_logprob_targets

log = get_logger("minisgl.scheduler")


@dataclass
class _InFlight:
    reqs: list[Request]
    samples: list[bool]  # False for a prefill chunk that samples nothing
    step: StepResult  # its output's host copies (filled asynchronously on CUDA)
    prompt_targets: dict[int, list[int]]  # rows whose prompt logprobs the step computes (in row order)
    trace: step_trace.StepTrace | None = None  # timing, when tracing (MINISGL_TRACE_REQUESTS)


class Scheduler:
    def __init__(
        self, engine: Engine, cfg: SchedulerConfig | None = None, grammars: GrammarCompiler | None = None,
        events: CacheEvents | None = None,
    ) -> None:
        self.engine = engine
        self.cfg = cfg or SchedulerConfig()
        mc, ec = engine.model_config, engine.cfg
        self.grammar = GrammarRows(grammars, mc.vocab_size, ec.max_running_requests, engine.device)
        states = getattr(engine, "state_pool", None)
        self.cache = make_prefix_cache(self.cfg.cache, ec.page_size, events, getattr(engine, "swa_window", 0),
                                       snapshots=states is not None and states.num_snapshots > 0)
        self.kv = RequestKV(engine, self.cache, self.cfg.host_kv_cache_gb)
        self.queues = RequestQueues(self.cfg.scheduling_policy)
        self.inflight: deque[_InFlight] = deque()
        self.new_token_ratio = self.cfg.init_new_token_ratio
        self._decode_next = False
        self._pending_done: list[Request] = []  # processed early (by a drain) during step()
        self.num_retractions = 0
        self.num_steps = 0  # steps launched (the step number of trace lines)
        # Prompt positions whose logits one step may compute for prompt logprobs: they are
        # [rows, vocab] fp32 (~300 MB at 512 x 152k), so long prompts that ask take more steps.
        self.prompt_logprob_rows = 512
        # (start, end) CUDA events around each step's device work, when a benchmark asks.
        self.gpu_timeline: list[tuple[str, int, torch.cuda.Event, torch.cuda.Event]] | None = None
        # Speculative decoding (minisgl/speculative/): decode steps become verify steps.
        self.spec = SpecStep(engine, self.kv, self.grammar, self._release) if engine.cfg.spec is not None else None
        if engine.device.type == "cuda":
            # Everything the serving path runs is compiled (and captured) before it serves (the
            # sampling kernel, and with speculation the acceptance kernel).
            if self.cfg.cuda_graph and engine.task != "embed":  # an embedding model's steps run eagerly
                with startup_phase("scheduler: CUDA graphs captured"):
                    engine.enable_cuda_graphs(self.cfg.cuda_graph_max_bs, *self.graph_max_tokens)
            with startup_phase("scheduler: sampling kernels compiled"):
                engine.warm_up_sampling()

    @property
    def graph_max_tokens(self) -> tuple[int, int]:
        """The largest prefill step and the largest mixed step (0: none) this scheduler forms:
        the tops of the extend and mixed graph ladders, unless `cuda_graph_max_tokens` caps them."""
        cfg = self.cfg
        chunk = min(cfg.mixed_chunk_tokens, cfg.max_prefill_tokens)
        mixed = self.engine.cfg.max_running_requests + chunk if chunk else 0
        cap = cfg.cuda_graph_max_tokens
        return (cfg.max_prefill_tokens, mixed) if cap is None else (min(cfg.max_prefill_tokens, cap), min(mixed, cap))

    # ---- requests in and out ----

    @property
    def has_work(self) -> bool:
        return bool(self.queues or self.inflight)

    # Read-only views of the queues (tests and stats read them; only RequestQueues moves requests).
    @property
    def waiting(self) -> deque[Request]:
        return self.queues.waiting

    @property
    def running(self) -> list[Request]:
        return self.queues.running

    @property
    def prefilling(self) -> Request | None:
        return self.queues.prefilling

    def add_check(self, req: Request) -> None:
        """Raises ValueError if `req` could never run: it must fit the KV pool alone. (Its
        sampling fields were validated where it was made: the API process, the offline LLM.)
        A priority other than 0 needs the priority policy (RequestError naming it)."""
        if req.params.priority and not self.queues.by_priority:
            raise RequestError(f"priority: {req.params.priority} needs --scheduling-policy priority; this server "
                               "schedules first come, first served", "priority")
        self.kv.check_fits(req, self.cfg.max_prefill_tokens)

    def add(self, req: Request) -> None:
        self.add_check(req)
        self.grammar.attach(req)
        req.logits_spec = LogitsSpec.of(req.params, req.eos_ids, self.engine.model_config.vocab_size)
        self.queues.add(req)

    def finish(self, req: Request, reason: str, keep_tokens: int | None = None) -> None:
        """Ends a request early (stop string found by the caller, or abort) and frees its KV.
        `keep_tokens`: output tokens to keep (a stop string inside a multi-token step); the KV
        of the dropped ones is freed, not cached."""
        if req.finished and req.match is None:
            return
        req.finish_reason = reason
        if keep_tokens is not None and keep_tokens < len(req.output):
            del req.output[keep_tokens:], req.logprobs[keep_tokens:], req.top_logprobs[keep_tokens:]
            req.cached_len = min(req.cached_len, req.total_len)
        self._release(req)

    def stats(self) -> dict[str, int]:
        total = self.engine.allocator.total_pages * self.engine.cfg.page_size
        free = self.engine.allocator.free_pages * self.engine.cfg.page_size
        return {
            "running": self.queues.num_active,
            "queued": len(self.queues.waiting),
            "kv_slots_total": total,
            "kv_slots_used": total - free - self.cache.evictable_pages * self.engine.cfg.page_size,
            "kv_slots_cached": self.cache.cached_pages * self.engine.cfg.page_size,
            **self.kv.swa_stats(), **self.kv.state_stats(), "retractions": self.num_retractions,
            **(self.spec.stats() if self.spec is not None else {}),
        }

    def check_integrity(self) -> None:
        self.kv.check_integrity(self.queues.active)

    def flush_cache(self) -> str | None:
        """Empties the prefix cache (POST /flush_cache); returns why not, or None once flushed."""
        return self.kv.flush_cache(self.queues.active)

    # ---- one step ----

    def step(self) -> list[Request]:
        """Schedules and launches one batch; returns the requests whose new token the host has
        read this call (with overlap, those of the previous batch)."""
        launched = self._launch_next()
        keep = 1 if (launched and self.cfg.overlap) else 0
        done, self._pending_done = self._pending_done, []
        while len(self.inflight) > keep:
            done.extend(self._process(self.inflight.popleft()))
        if self.cfg.debug_checks and not self.has_work:
            self.check_integrity()
        return done

    def _launch_next(self) -> bool:
        q = self.queues
        if q.by_priority and q.waiting and preemption_victims(q, self.kv, self.new_token_ratio):
            self._drain()  # retraction needs every token value on the host; some may finish here
            for victim in preemption_victims(q, self.kv, self.new_token_ratio):
                self._retract(victim)
        want_prefill = bool(q.waiting or q.prefilling)
        if want_prefill and self.cfg.mixed_chunk_tokens > 0 and self._decodable():
            return self._launch_mixed()
        if want_prefill and not (self._decode_next and self._decodable()):
            if self._launch_prefill():
                self._decode_next = True
                return True
        self._decode_next = False
        if self.spec is not None:
            reqs = self._decodable()
            # Grammar-constrained requests draft nothing (their one verify row is masked);
            # a batch of nothing else decodes plainly.
            if reqs and any(r.grammar is None for r in reqs) and self.spec.should_verify(len(reqs)):
                return self._launch_verify()
        return self._launch_decode()

    def _decodable(self) -> list[Request]:
        # A request at its length limit waits for its last token; it is never extended.
        return [r for r in self.queues.running if r.seq_len < r.max_total_len]

    def _admit(self, budget: int) -> PrefillPlan:
        return admit(self.queues, self.kv, budget, self.new_token_ratio, self.prompt_logprob_rows)

    def _launch_prefill(self) -> bool:
        plan = self._admit(self.cfg.max_prefill_tokens)
        if not plan.reqs:
            return False
        plan = self._pool(plan)
        if plan.reqs:
            self._launch("extend", plan.reqs, plan.prefix, plan.new, plan.samples)
            finish_admitted(self.kv, plan)
        return True

    def _pool(self, plan: PrefillPlan) -> PrefillPlan:
        """Runs the plan's embedding requests (scheduler/pooling.py); returns the rest of it."""
        if all(r.pooling is None for r in plan.reqs):  # a generation server's every step: no copy
            return plan
        pooled, rest = split_pooling(plan)
        if pooled.reqs:
            self.kv.flush()
            for req in run_pool_step(self.engine, pooled):
                self._release(req)
                self._pending_done.append(req)
        return rest

    def _launch_mixed(self) -> bool:
        """Every decode plus a prefill chunk in one step (the decodes first: their KV slots
        are secured before the chunk's admission takes pages)."""
        decodes = self._ensure_decode_slots(self._decodable())
        plan = self._pool(self._admit(self._mixed_chunk(len(decodes))))
        if not plan.reqs:
            return self._launch_decode(decodes)
        if not decodes:
            self._launch("extend", plan.reqs, plan.prefix, plan.new, plan.samples)
        else:
            self._start_decodes(decodes)
            self._launch("mixed", decodes + plan.reqs, [r.seq_len - 1 for r in decodes] + plan.prefix,
                         [None] * len(decodes) + plan.new, [True] * len(decodes) + plan.samples)
            self._end_decodes(decodes)
        finish_admitted(self.kv, plan)
        return True

    def _mixed_chunk(self, num_decodes: int) -> int:
        """Prompt tokens for a mixed step beside `num_decodes` decodes: at most the budget
        (`mixed_chunk_tokens`), trimmed so that the whole step fills the largest captured mixed
        bucket within it rather than padding up to the next one (7 decodes + 512 tokens would
        replay the 640-token graph; 7 + 505 fill the 512 one). The prompt's rest rides in a
        later step, whose decodes had to run anyway."""
        budget = min(self.cfg.mixed_chunk_tokens, self.cfg.max_prefill_tokens)
        buckets = self.engine.mixed_graph_tokens()
        if not buckets:
            return budget
        fit = max((t for t in buckets if t <= num_decodes + budget), default=0) - num_decodes
        return fit if fit > 0 else budget

    def _launch_decode(self, reqs: list[Request] | None = None) -> bool:
        reqs = self._ensure_decode_slots(self._decodable()) if reqs is None else reqs
        if not reqs:
            return False
        self._start_decodes(reqs)
        self._launch("decode", reqs, [r.seq_len - 1 for r in reqs], None, [True] * len(reqs))
        self._end_decodes(reqs)
        return True

    def _start_decodes(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.cached_len = r.seq_len

    def _end_decodes(self, reqs: list[Request]) -> None:
        for r in reqs:
            r.num_pending += 1
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay)

    def _launch_verify(self) -> bool:
        """A speculative step (scheduler/spec_step.py), synchronous: drafting needs every
        token on the host, so the in-flight step is read first."""
        self._drain()
        reqs = self._decodable()
        if not reqs:
            return False
        reqs = self._ensure_decode_slots(reqs)
        timed = self.gpu_timeline is not None and self.engine.device.type == "cuda"
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        self._pending_done.extend(self.spec.run(reqs))
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.gpu_timeline.append(("verify", len(reqs), start, end))
        self.new_token_ratio = max(self.cfg.min_new_token_ratio, self.new_token_ratio - self.cfg.new_token_ratio_decay)
        return True

    def _ensure_decode_slots(self, reqs: list[Request]) -> list[Request]:
        """Every decoding request needs a slot for its next token. Out of KV: retract the
        requests with the least progress (their KV goes to the prefix cache, they requeue at
        the front) until the rest fit."""
        if not reqs:
            return reqs
        ok = [r for r in reqs if self.kv.grow(r, r.seq_len)]
        if len(ok) == len(reqs):
            return reqs
        self._drain()  # retraction needs every token value on the host
        reqs = self._decodable()
        victims = retraction_order(reqs, self.queues.by_priority)
        while True:
            if all(self.kv.grow(r, r.seq_len) for r in reqs):
                return reqs
            victim = victims.pop(0) if len(victims) > 1 else None
            if victim is None:  # one request left: it fits alone (checked at add)
                if self.queues.prefilling is not None:
                    self._retract(self.queues.prefilling)
                    continue
                raise RuntimeError("KV pool exhausted by a single request that was admitted as fitting")
            self._retract(victim)
            reqs.remove(victim)

    def _retract(self, req: Request) -> None:
        self.num_retractions += 1
        self.new_token_ratio = self.cfg.init_new_token_ratio
        self.queues.remove(req)
        self.kv.release(req)
        req.cached_len = 0
        self.queues.requeue(req)

    def _launch(
        self, mode: str, reqs: list[Request], prefix: list[int], new: list[list[int] | None] | None,
        samples: list[bool],
    ) -> None:
        eng = self.engine
        self.num_steps += 1
        traced = step_trace.begin(self.num_steps, eng.device.type == "cuda") if trace.ENABLED else None
        timed = self.gpu_timeline is not None and eng.device.type == "cuda"
        if timed:
            start = torch.cuda.Event(enable_timing=True)
            start.record()
        self.kv.flush()
        mask = self.grammar.step_mask(reqs, samples, self._drain)
        targets = prompt_logprob_targets(reqs, prefix, new)
        generated = [len(r.output) + r.num_pending for r in reqs]  # exact under overlap: values unknown
        launched = eng.step(Step(mode, reqs, prefix, new, samples, generated, targets, fresh_histories(reqs), mask,
                                 traced is not None))
        if traced is not None:
            traced.built = launched.built
        if timed:
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.gpu_timeline.append((mode, len(reqs), start, end))
        launched.copy_to_host()
        if traced is not None:
            decodes = len(reqs) if new is None else sum(t is None for t in new)
            step_trace.launched(traced, launched, reqs, samples, decodes)
        self.inflight.append(_InFlight(reqs, samples, launched, targets, traced))

    def _process(self, item: _InFlight) -> list[Request]:
        item.step.wait()
        if item.trace is not None:
            step_trace.ready(item.trace, item.reqs, item.samples)
        out = item.step.read()
        add_prompt_logprobs(item.reqs, item.prompt_targets, out)
        tops = out.alternatives
        done = []
        constrained: list[Request] = []  # still running with a grammar: it takes the token
        tokens: list[int] = []
        for i, (req, sampled, tok, lp) in enumerate(zip(item.reqs, item.samples, out.tokens, out.logprobs)):
            if not sampled:
                continue
            req.num_pending -= 1
            if req.finished:  # ended (abort, stop string, EOS) while this step was in flight
                continue
            req.append(tok, lp, tops[i][: req.params.top_logprobs] if i in tops else None)
            done.append(req)
            if req.finished:
                self._release(req)
            elif req.grammar is not None:
                constrained.append(req)
                tokens.append(tok)
        if constrained:  # all rows at once: one batched matcher call
            for req in self.grammar.advance(constrained, tokens):
                self._release(req)
        return done

    def _drain(self) -> None:
        while self.inflight:
            self._pending_done.extend(self._process(self.inflight.popleft()))

    def _release(self, req: Request) -> None:
        self.queues.remove(req)
        self.kv.release(req)
        self.engine.release_request(req.uid)  # a drafter's state (nothing without one)
