"""The offline LLM: the engine and scheduler in-process, no server."""

from __future__ import annotations

import copy
import dataclasses
import functools
import multiprocessing as mp
import random
import socket
import weakref
from collections.abc import Sequence
from typing import Any

import torch
from tqdm import tqdm

from minisgl.core.grammar_fields import grammar_spec
from minisgl.core.sampling_params import SamplingParams
from minisgl.distributed.placement import share_cpu
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.grammar.compiler import GrammarCompiler
from minisgl.grammar.spec import check_grammar
from minisgl.message import DetokInit
from minisgl.offline.replicas import ReplicaPool, replica_options
from minisgl.scheduler.config import SchedulerConfig, offline_mixed_chunk, scheduler_config
from minisgl.scheduler.request import Request
from minisgl.scheduler.scheduler import Scheduler
from minisgl.scheduler.tp_sync import Input, InputSync, apply_inputs
from minisgl.tokenizer.incremental import DecodeState
from minisgl.tokenizer.load import load_tokenizer

_ENGINE_OPTIONS = {f.name for f in dataclasses.fields(EngineConfig)} - {"model", "device", "dtype"}
_SCHED_OPTIONS = {f.name for f in dataclasses.fields(SchedulerConfig)}
_LLM_OPTIONS = {"chat_template", "tokenizer", "disable_overlap", "disable_cuda_graph", "dp_size"}


class LLM:
    """`LLM(model=None, *, device=..., dtype="auto", **options)`: model is an HF folder, a
    .gguf file or a folder holding one; None means the built-in SmolLM2-135M-Instruct.

    Options: the EngineConfig fields (max_model_len, page_size, num_pages, max_running_requests,
    attention_backend, load_format, seed, ...), the SchedulerConfig fields (cache,
    max_prefill_tokens, overlap, cuda_graph, cuda_graph_max_bs, ...), disable_overlap,
    disable_cuda_graph, chat_template (a file) and tokenizer (a folder, default: the model's).
    mixed_chunk_tokens defaults to max_prefill_tokens here (the server's 384 is a latency budget).

    dp_size=N runs N replicas (this process and N - 1 more, each with tp_size GPUs: replica r's
    TP rank t on GPU base_gpu_id + r * tp_size + t); `generate` splits the prompts across them
    and returns the results in input order (minisgl/offline/replicas.py)."""

    def __init__(self, model: str | None = None, *, device: str | None = None, dtype: str = "auto", **options: Any):
        unknown = set(options) - _ENGINE_OPTIONS - _SCHED_OPTIONS - _LLM_OPTIONS
        if unknown:
            raise ValueError(f"unknown LLM option(s): {', '.join(sorted(unknown))}")
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        dp_size = options.pop("dp_size", 1)
        if model is None:
            from minisgl.models.source import default_model_path

            default_model_path()  # fetched here if needed, once, before any replica or TP rank starts
        # Throughput, not inter-token latency: TP ranks and DP replicas get the same options.
        options.setdefault("mixed_chunk_tokens", offline_mixed_chunk(options))
        engine_opts = {k: v for k, v in options.items() if k in _ENGINE_OPTIONS}
        cfg = EngineConfig(model=model, device=device, dtype=dtype, **engine_opts)
        self._workers: list[mp.process.BaseProcess] = []
        self._closed = False
        self._replicas: ReplicaPool | None = None
        if dp_size != 1:
            self._replicas = self._start_replicas(dp_size, cfg, options)
        try:
            self._init_replica0(cfg, options)
            if self._replicas is not None:
                self._replicas.wait_ready()
        except BaseException:
            if self._replicas is not None:
                self._replicas.shutdown()
            raise
        if self._replicas is not None:
            self._replica_finalizer = weakref.finalize(self, self._replicas.shutdown)

    def _start_replicas(self, dp_size: int, cfg: EngineConfig, options: dict[str, Any]) -> ReplicaPool:
        if not isinstance(dp_size, int) or isinstance(dp_size, bool) or dp_size < 1:
            raise ValueError(f"dp_size must be an integer >= 1, got {dp_size!r}")
        if torch.device(cfg.device).index is not None:
            raise ValueError(f"device {cfg.device!r} names one GPU; with dp_size give device='cuda' (and base_gpu_id)")
        if cfg.dist_init_addr is not None or cfg.nnodes > 1:
            raise ValueError("dp_size > 1 runs on one machine: give neither dist_init_addr nor nnodes")
        return ReplicaPool(dp_size, functools.partial(_replica, cfg.model, cfg.device, cfg.dtype, options), cfg.device)

    def _init_replica0(self, cfg: EngineConfig, options: dict[str, Any]) -> None:
        if self._replicas is not None:
            share_cpu(cfg.device, len(self._replicas.procs) + 1)
        if cfg.tp_size > 1:
            cfg = self._start_tp_workers(cfg, options)
        self.engine = Engine(cfg)
        try:
            self._init_scheduler(options)
        except BaseException:
            if cfg.tp_size == 1:  # (with TP the teardown is collective: the ranks' exit does it)
                self.engine.shutdown()  # a failed start must not pin the GPU memory it took
            raise

    def _init_scheduler(self, options: dict[str, Any]) -> None:
        self.tokenizer = load_tokenizer(self.engine.source, options.get("chat_template"), options.get("tokenizer"))
        mc = self.engine.model_config
        tok_eos = self.tokenizer.eos_token_id
        extra = () if tok_eos is None or tok_eos in mc.eos_token_ids else (tok_eos,)
        self.model_config = dataclasses.replace(mc, eos_token_ids=mc.eos_token_ids + extra)
        self.grammars = GrammarCompiler(lambda: self.tokenizer, mc.vocab_size)
        self.scheduler = Scheduler(
            self.engine, scheduler_config(options, self.engine.attn.name, self.engine.device.type), self.grammars
        )
        self._sync = InputSync(self.engine.tp.rank, self.engine.tp.size, self.engine.cpu_group)
        self._requests: dict[int, Request] = {}
        self._inputs: list[Input] = []
        self._next_uid = 0
        self._rng = random.Random(self.engine.cfg.seed)
        # With TP: shut the ranks down when this LLM is collected or at exit, whichever comes
        # first (a finalizer, so that it holds no reference to the LLM itself).
        self._finalizer = (
            weakref.finalize(self, _shutdown_ranks, self._sync, self.engine, self._workers)
            if self.engine.tp.size > 1
            else None
        )

    def _start_tp_workers(self, cfg: EngineConfig, options: dict[str, Any]) -> EngineConfig:
        from minisgl.models.loading import load_model_config
        from minisgl.models.source import resolve_model
        from minisgl.scheduler.tp_worker import run_tp_worker

        load_model_config(resolve_model(cfg.model)).check_tp(cfg.tp_size)  # fail before spawning
        if cfg.dist_init_addr is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                cfg = dataclasses.replace(cfg, dist_init_addr=f"127.0.0.1:{s.getsockname()[1]}")
        ctx = mp.get_context("spawn")  # CUDA cannot be forked
        # This machine's ranks; on a multi-node run the other machines start theirs with
        # `python -m minisgl.serve --node-rank K`.
        for rank in range(1, cfg.tp_size // cfg.nnodes):
            rank_cfg = dataclasses.replace(cfg, tp_rank=rank)
            proc = ctx.Process(target=run_tp_worker, args=(rank_cfg, options), daemon=True)
            proc.start()
            self._workers.append(proc)
        return cfg

    def shutdown(self) -> None:
        """Frees this LLM's engine at once (weights, KV pool, CUDA graphs, scratch: the GPU
        memory is back when it returns, no `gc.collect()` needed), stops the other replicas
        (dp_size) and the tensor-parallel ranks. Idempotent; `generate` afterwards raises.
        Also done on leaving a `with LLM(...) as llm:` block; when the LLM is garbage-collected
        or at exit, for the replicas and TP ranks."""
        if self._closed:
            return
        self._closed = True
        if self._replicas is not None:
            self._replica_finalizer()  # runs once
        if self._finalizer is not None:
            self._finalizer()  # runs once; shuts this rank's engine down with the others
        else:
            self.engine.shutdown()
        # The engine is freed already; dropping the references also lets the scheduler's
        # pending step results go (and anything still holding this LLM no longer pins them).
        for name in ("engine", "scheduler", "_sync", "_finalizer"):
            self.__dict__.pop(name, None)
        self._requests.clear()
        self._inputs.clear()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def _step(self) -> list[Request]:
        """One lockstep step: broadcast this step's inputs to every rank, apply, step."""
        inputs, self._inputs = self._inputs, []
        apply_inputs(self.scheduler, self._sync.exchange(inputs), self._requests)
        return self.scheduler.step() if self.scheduler.has_work else []

    def _make_request(self, prompt: str | Sequence[int], params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt).input_ids
        elif isinstance(prompt, Sequence) and all(isinstance(t, int) for t in prompt):
            ids = list(prompt)
        else:
            raise ValueError("each prompt must be a string or a list of token ids")
        self.engine.check_prompt(ids)
        params.validate()
        vocab = self.model_config.vocab_size
        outside = sorted(t for t in (params.logit_bias or {}) if t >= vocab)
        if outside:
            raise ValueError(f"logit_bias: token id {outside[0]} is outside the vocabulary of {vocab} tokens")
        if params.max_tokens is None:  # the rest of the context (a copy: the params may serve other prompts)
            params = copy.copy(params)
            params.resolve_max_tokens(self.engine.max_model_len - len(ids))
        spec = grammar_spec(params)
        if spec is not None:
            check_grammar(spec)
            self.grammars.compiled(spec)  # raises GrammarError (a ValueError) if it does not compile
        uid, self._next_uid = self._next_uid, self._next_uid + 1
        limit = min(len(ids) + params.max_tokens, self.engine.max_model_len)
        seed = params.seed if params.seed is not None else self._rng.getrandbits(63)
        return Request(uid, ids, params, seed, frozenset(self.model_config.eos_token_ids), limit)

    def generate(
        self,
        prompts: Sequence[str] | Sequence[Sequence[int]] | str,
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[dict[str, Any]]:
        """One dict per prompt, in input order, of the generated part: "text", "token_ids",
        "finish_reason", "logprobs" (of each chosen token under the raw logits), and where asked
        "top_logprobs" (per token, [(token_id, logprob), ...] most likely first) and
        "prompt_logprobs" (per prompt position: None at 0, else (logprob, [(id, logprob), ...]))."""
        if self._closed:
            raise RuntimeError("this LLM was shut down; make a new one")
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            params = list(sampling_params)
            if len(params) != len(prompts):
                raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        reqs = [self._make_request(p, sp) for p, sp in zip(prompts, params)]
        for r in reqs:
            self.scheduler.add_check(r)
        with tqdm(total=len(reqs), desc="generate", disable=not use_tqdm) as bar:
            if self._replicas is None:
                return self._run(reqs, bar)
            out = self._replicas.generate(reqs, lambda local: self._run(local, bar))
            bar.update(len(reqs) - bar.n)  # the other replicas' requests, done now
            return out

    def _run(self, reqs: list[Request], bar: tqdm) -> list[dict[str, Any]]:
        """Runs checked requests on this replica to the end; one result per request, in order."""
        specs = {s for s in (grammar_spec(r.params) for r in reqs) if s is not None}
        self._inputs.extend(("grammar", s) for s in specs)  # other TP ranks compile meanwhile
        self._inputs.extend(("add", r) for r in reqs)
        texts: dict[int, str] = {}
        kept: dict[int, int] = {}  # output tokens up to a stop string's last
        # Requests with stop strings decode incrementally, as the server's detokenizer does.
        decoders = {r.uid: DecodeState(self.tokenizer, DetokInit(len(r.prompt), r.params.stop)) for r in reqs
                    if r.params.stop}
        while self._inputs or self.scheduler.has_work:
            for req in self._step():
                if self._check_stop_strings(req, decoders, texts, kept) or req.finished:
                    bar.update(1)
        for r in reqs:
            self._requests.pop(r.uid, None)
        return [self._result(r, texts, kept.get(r.uid, len(r.output))) for r in reqs]

    def _result(self, r: Request, texts: dict[int, str], n: int) -> dict[str, Any]:
        """`n`: output tokens kept (fewer than made when a stop string ended a multi-token step)."""
        out: dict[str, Any] = {
            "text": texts[r.uid] if r.uid in texts else self._decode(r.output), "token_ids": r.output[:n],
            "finish_reason": "stop" if r.uid in texts else r.finish_reason, "logprobs": r.logprobs[:n],
        }
        if r.params.top_logprobs:
            out["top_logprobs"] = r.top_logprobs[:n]
        if r.params.prompt_logprobs is not None:
            out["prompt_logprobs"] = list(r.prompt_logprobs or [])
        return out

    def _decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def _check_stop_strings(
        self, req: Request, decoders: dict[int, DecodeState], texts: dict[int, str], kept: dict[int, int]
    ) -> bool:
        """True when a stop string ended `req`: now (the scheduler frees it next step), or in the
        tokens that finished it anyway (length or EOS), as the server's detokenizer sees it."""
        state = decoders.get(req.uid)
        if state is None or req.uid in texts:
            return False
        # One token at a time: a speculative step brings several, and those after the one
        # that completes a stop string are dropped (from the output and from the KV cache).
        cut = state.add_until_stop(req.output[len(state.ids) :])
        if cut is None and req.finished:
            state.finalize()
            cut = state.find_stop()
        if cut is None:
            return False
        texts[req.uid] = state.text[:cut]  # the stop string itself is not returned
        kept[req.uid] = len(state.ids)
        if not req.finished:
            self._inputs.append(("finish", req.uid, "stop", len(state.ids)))
        return True


def _shutdown_ranks(sync: InputSync, engine: Engine, workers: list[mp.process.BaseProcess]) -> None:
    sync.exchange([("shutdown",)])
    # Every rank tears down now, together: NCCL teardown is collective, so waiting for the
    # workers first would deadlock. It also lets a later LLM here start a fresh group.
    engine.shutdown()
    for proc in workers:
        proc.join(timeout=30)
        if proc.is_alive():
            proc.kill()


def _replica(model: str | None, device: str, dtype: str, options: dict[str, Any], dp_rank: int) -> LLM:
    """Replica `dp_rank` of an LLM(dp_size=N), built in its own process (ReplicaPool)."""
    return LLM(model, device=device, dtype=dtype, **replica_options(options, dp_rank))
