"""A tensor-parallel rank > 0 (of the offline LLM or the server): its own engine and scheduler, stepping in
lockstep with rank 0 on the inputs rank 0 broadcasts."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.scheduler.request import Request
from minisgl.scheduler.tp_sync import InputSync, apply_inputs


def run_tp_worker(
    engine_cfg: EngineConfig, options: dict[str, Any], on_ready: Callable[[], None] | None = None
) -> None:
    from minisgl.grammar.compiler import GrammarCompiler
    from minisgl.scheduler.config import scheduler_config
    from minisgl.scheduler.scheduler import Scheduler
    from minisgl.tokenizer.load import load_tokenizer

    engine = Engine(engine_cfg)
    # Every rank keeps its own grammar states: it compiles each grammar itself (the tokenizer
    # loads the first time one is needed).
    grammars = GrammarCompiler(
        lambda: load_tokenizer(engine.source, None, options.get("tokenizer")), engine.model_config.vocab_size
    )
    scheduler = Scheduler(engine, scheduler_config(options, engine.attn.name, engine.device.type), grammars)
    if on_ready is not None:
        on_ready()
    sync = InputSync(engine.tp.rank, engine.tp.size, engine.cpu_group)
    requests: dict[int, Request] = {}
    while apply_inputs(scheduler, sync.exchange(None), requests):
        if scheduler.has_work:
            for req in scheduler.step():  # finished ones leave the map (aborts left in apply)
                if req.finished:
                    requests.pop(req.uid, None)
    engine.shutdown()  # collective: rank 0 does the same after sending the shutdown input
