"""Compiling grammars off the scheduler's critical path, cached by spec.

Compiling precomputes, for every grammar state, which of the vocabulary's tokens may follow:
tens of milliseconds to a second for a JSON schema over a 150k-token vocabulary. It runs on
one worker thread (xgrammar's C++ compile, itself multi-threaded, lets the scheduler thread run
meanwhile), so a request waiting for its grammar never stalls the batch. Each spec compiles
once: later requests (and the other choices of an n > 1 request) get the cached result, or
wait on the same future while it compiles.
"""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from minisgl.core.grammar_fields import GrammarSpec
from minisgl.grammar.matcher import RowGrammar
from minisgl.grammar.spec import build_grammar, xgrammar_message
from minisgl.logging_setup import get_logger

log = get_logger("minisgl.grammar")
CACHE_ENTRIES = 1024  # compiled grammars kept (least recently used dropped first)
# xgrammar's own threads for one compile: half the cores (the other half run the scheduler,
# the tokenizers and the mask fills), at most 8.
COMPILE_THREADS = max(1, min(8, (os.cpu_count() or 2) // 2))


class GrammarError(ValueError):
    """A grammar that could not be compiled (the request gets this message as a 400)."""


class GrammarCompiler:
    """`load_tokenizer` is called once, on the worker thread, the first time a grammar is
    compiled: a server that never sees a grammar never builds the vocabulary tables.
    `vocab_size` is the model's (logits width), which may exceed the tokenizer's: ids past the
    tokenizer are never allowed by a grammar."""

    def __init__(self, load_tokenizer: Callable[[], Any], vocab_size: int) -> None:
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None
        self._compiler: Any = None
        self._cache: OrderedDict[GrammarSpec, Future] = OrderedDict()
        self._lock = threading.Lock()

    def prefetch(self, spec: GrammarSpec) -> Future:
        """Starts compiling `spec` unless it is cached or compiling; its future either way."""
        with self._lock:
            fut = self._cache.get(spec)
            if fut is not None:
                self._cache.move_to_end(spec)
                return fut
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar")
            fut = self._pool.submit(self._compile, spec)
            self._cache[spec] = fut
            while len(self._cache) > CACHE_ENTRIES:
                self._cache.popitem(last=False)
            return fut

    def _compile(self, spec: GrammarSpec) -> Any:
        import xgrammar as xgr

        if self._compiler is None:
            tok = self._load_tokenizer()
            info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=self.vocab_size)
            self._compiler = xgr.GrammarCompiler(info, max_threads=COMPILE_THREADS)
        try:
            return self._compiler.compile_grammar(build_grammar(spec))
        except Exception as e:  # noqa: BLE001 - xgrammar raises RuntimeError and pydantic errors
            # The failed future stays cached: the same spec fails the same way, without a rerun.
            raise GrammarError(f"{spec.kind}: invalid ({xgrammar_message(e)})") from e

    def compiled(self, spec: GrammarSpec, timeout: float | None = None) -> Any:
        """The compiled grammar (waits for it); GrammarError when it does not compile."""
        return self.prefetch(spec).result(timeout)

    def matcher(self, spec: GrammarSpec, stop_ids: list[int], after_token: int | None) -> RowGrammar:
        return RowGrammar(self.compiled(spec), stop_ids, after_token)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
