"""Structured-output overhead (Qwen3-0.6B shapes, dummy weights), all in one run:

1. grammar compile: a new JSON schema (first compile, which also builds the vocabulary tables;
   then a second new schema) and a cached one, and the first-token delay of a request with a
   new schema, a cached schema and none;
2. per-step mask time at batch 1, 64 and 256: the host fill (xgrammar, every row constrained)
   and the device apply (our Triton kernel at each BLOCK candidate, and xgrammar's own Triton
   kernel as the baseline); apply GB/s = rows * (V * 4 written at most + V / 8 mask read) /
   time, against the device copy ceiling measured here; then the host fill per step at 1-16
   threads (grammar/threads.py THREADS takes the best) and the batched accept, rows at random
   depths;
3. the offline standard workload (benchmarks/offline.py) with every request under a typical
   nested JSON schema vs none. Constrained requests end when their JSON completes (even with
   ignore_eos), so the like-for-like baseline is "none" with each request's max_tokens set to
   its constrained output's length: the same steps at the same batch sizes. Every run starts
   cold (its prompts' first token differs per run: no prefix-cache hits from an earlier run).
   The schema runs at 1, 4 and THREADS fill threads. Target: <= 10% loss at batch 256. Also
   the device idle share of the decode phase, decode device ms per step (which includes any
   wait inside a step for the host's mask) and the host's grammar time per masked step
   (scheduler GrammarRows.host_s).

    python benchmarks/grammar.py                       # about 2-4 minutes on an H100
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parent))
sys.path.insert(0, str(Path(__file__).parent / "kernels"))
from _bench import ceilings, print_table, time_calls  # noqa: E402
from offline import qwen_tokenizer_dir, workload  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402
from minisgl.core.grammar_fields import GrammarSpec  # noqa: E402
from minisgl.grammar.masks import GrammarMasks  # noqa: E402
from minisgl.grammar.threads import THREADS, MatcherThreads  # noqa: E402

ITEM = {
    "type": "object",
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 100000},
        "name": {"type": "string"},
        "kind": {"enum": ["person", "place", "thing"]},
        "score": {"type": "number", "minimum": 0, "maximum": 1},
        "tags": {"type": "array", "items": {"type": "string"}},
        "where": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                  "required": ["lat", "lon"]},
    },
    "required": ["id", "name", "kind", "tags", "where"],
}
SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": ITEM}, "total": {"type": "integer"}},
          "required": ["items", "total"]}


def timed(fn, reps: int = 20) -> float:
    """Median ms of fn() with the device synchronized around each call."""
    out = []
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        out.append((time.perf_counter() - t) * 1e3)
    return statistics.median(out)


def compile_delays(llm: LLM) -> None:
    comp = llm.grammars
    rows = []
    cases = (("new schema (+ vocabulary tables)", SCHEMA), ("another new schema", ITEM), ("cached schema", SCHEMA))
    for label, schema in cases:
        t = time.perf_counter()
        comp.compiled(GrammarSpec("json_schema", json.dumps(schema)))
        rows.append([label, f"{(time.perf_counter() - t) * 1e3:.1f}"])
    print_table("grammar compile (ms)", ["case", "ms"], rows)
    rows = []
    cases = (("no grammar", None), ("new schema", {**ITEM, "title": "fresh"}), ("cached schema", SCHEMA))
    for label, schema in cases:
        kw = {} if schema is None else {"json_schema": schema}
        t = time.perf_counter()
        llm.generate([[1] * 64], SamplingParams(max_tokens=1, temperature=0.6, **kw), use_tqdm=False)
        rows.append([label, f"{(time.perf_counter() - t) * 1e3:.1f}"])
    print_table("first-token delay, one 64-token request (ms)", ["case", "ms"], rows)


def mask_row(llm: LLM, bs: int, copy_gbs: float) -> list[str]:
    import xgrammar as xgr

    from minisgl.kernels import token_bitmask as K

    vocab = llm.engine.model_config.vocab_size
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    grammars = [llm.grammars.matcher(spec, [], None) for _ in range(bs)]
    masks = GrammarMasks(vocab, bs, llm.engine.device)
    for g in grammars:  # walk each row a few tokens into the schema (a middle allowed token each time)
        for _ in range(6):
            host, _ = masks.fill([g])
            allowed = K.unpack_bitmask_reference(host, vocab)[0].nonzero()
            g.accept(int(allowed[len(allowed) // 2]))
    fill_ms = timed(lambda: masks.fill(grammars))
    logits = torch.randn(bs, vocab, device="cuda")
    dev = masks.fill(grammars)[0].to("cuda")
    rows_t = torch.arange(bs, dtype=torch.int32, device="cuda")
    full_ms = timed(lambda: masks.apply(logits, list(range(bs)), grammars, with_lse=True))
    bytes_moved = bs * (vocab * 4 + vocab / 8)
    line = [str(bs), f"{fill_ms:.3f}", f"{full_ms:.3f}"]
    for block in (1024, 2048, 4096, 8192):
        us = time_calls([lambda b=block: K.apply_token_bitmask(logits, dev, rows_t, block=b)], reps=50)
        line.append(f"{us:.1f} us ({bytes_moved / us / 1e3 / copy_gbs * 100:.0f}%)")
    # xgrammar's wrapper builds an index tensor per call: timed eagerly.
    us = time_calls([lambda: xgr.apply_token_bitmask_inplace(logits, dev, indices=rows_t)], reps=50, use_graph=False)
    line.append(f"{us:.1f} us")
    return line


def mask_times(llm: LLM, copy_gbs: float) -> None:
    vocab = llm.engine.model_config.vocab_size
    rows = [mask_row(llm, bs, copy_gbs) for bs in (1, 64, 256)]
    print_table(
        f"per-step mask time, every row constrained (V = {vocab}); kernel: % of the {copy_gbs:.0f} GB/s copy ceiling",
        ["batch", "host fill ms", "fill+copy+apply ms", "ours B=1024", "ours B=2048", "ours B=4096", "ours B=8192",
         "xgrammar triton"], rows)


def thread_times(llm: LLM) -> None:
    """Host fill per step at 1-16 threads and the batched accept, rows at random depths into the
    schema (a random allowed token each time), every row advancing by one token as in decoding."""
    import random

    from minisgl.kernels import token_bitmask as K

    vocab = llm.engine.model_config.vocab_size
    spec = GrammarSpec("json_schema", json.dumps(SCHEMA))
    rng = random.Random(0)
    out = []
    for bs in (64, 256):
        grammars = [llm.grammars.matcher(spec, [], None) for _ in range(bs)]
        walker = GrammarMasks(vocab, 1, torch.device("cpu"), MatcherThreads(1))
        for g in grammars:
            for _ in range(rng.randrange(0, 60)):
                allowed = K.unpack_bitmask_reference(walker.fill([g])[0], vocab)[0].nonzero().flatten().tolist()
                if g.terminated or len(allowed) < 2:
                    break
                g.accept(allowed[rng.randrange(len(allowed))])
        grammars = [g for g in grammars if g.needs_mask]
        host = torch.empty(len(grammars), -(-vocab // 32), dtype=torch.int32)
        MatcherThreads(1).fill(grammars, host)
        bits = K.unpack_bitmask_reference(host, vocab)
        tokens = [int(rng.choice(bits[j].nonzero().flatten().tolist())) for j in range(len(grammars))]
        line = [str(len(grammars))]
        for n in (1, 2, 4, 8, 16):
            threads = MatcherThreads(n)
            fill = statistics.median(_wall(lambda t=threads, g=grammars, h=host: t.fill(g, h)) for _ in range(10))
            line.append(f"{fill:.3f}")
        accepts = []
        for _ in range(5):
            forks = [copy_grammar(g) for g in grammars]
            accepts.append(_wall(lambda f=forks, k=tokens: MatcherThreads.accept(f, k)))
        out.append([*line, f"{statistics.median(accepts):.3f}"])
    print_table(f"host ms per step: fill by threads (THREADS = {THREADS} here), batched accept",
                ["rows", "fill 1", "fill 2", "fill 4", "fill 8", "fill 16", "accept"], out)


def copy_grammar(g):  # noqa: ANN001, ANN201 - a RowGrammar in the same state (its matcher forked)
    twin = object.__new__(type(g))
    for name in type(g).__slots__:
        setattr(twin, name, getattr(g, name))
    twin.matcher = g.matcher.fork()
    return twin


def _wall(fn) -> float:  # noqa: ANN001
    t = time.perf_counter()
    fn()
    return (time.perf_counter() - t) * 1e3


def throughput(llm: LLM, n: int, max_in: int, max_out: int) -> None:
    from offline import gpu_breakdown

    prompts, params = workload(n, max_in, max_out)
    schema = json.dumps(SCHEMA)
    rows = []
    rate = {}
    lengths: list[int] = []
    sched = llm.scheduler
    labels = {"json_schema": THREADS, "json_schema, 4 threads": 4, "json_schema, 1 thread": 1,
              "none, same lengths": 0, "none": 0}
    for run, (label, n_threads) in enumerate(labels.items()):
        kw = {"json_schema": schema} if label.startswith("json_schema") else {}
        caps = lengths if label == "none, same lengths" else [p.max_tokens for p in params]
        sched.grammar.masks.threads = MatcherThreads(n_threads or None)
        cold = [[11000 + run, *p[1:]] for p in prompts]  # no prefix-cache hit from an earlier run
        # Seeded: both schema runs make the same tokens (the same steps, only the threads differ).
        ps = [SamplingParams(temperature=p.temperature, ignore_eos=True, max_tokens=c, seed=i, **kw)
              for i, (p, c) in enumerate(zip(params, caps))]
        sched.gpu_timeline = []
        sched.grammar.host_s = dict.fromkeys(sched.grammar.host_s, 0.0)
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate(cold, ps, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        if label == "json_schema":
            lengths = [max(1, len(o["token_ids"])) for o in out]
        toks = sum(len(o["token_ids"]) for o in out)
        rate[label] = toks / dt
        gb = gpu_breakdown(sched.gpu_timeline)
        h = sched.grammar.host_s
        per = max(1.0, h["masked_steps"])
        host = "-" if not h["masked_steps"] else (
            f"{h['drain'] / per * 1e3:.2f} / {h['advance'] / per * 1e3:.2f} / {h['fill'] / per * 1e3:.2f}")
        dec = "-" if gb is None else f"{gb['decode_ms'] / max(1, gb['decode_steps']):.2f} ({gb['decode_mean_bs']:.0f})"
        rows.append([label, str(len(out)), str(toks), f"{dt:.2f}", f"{toks / dt:,.0f}",
                     "-" if gb is None else f"{gb['idle'] * 100:.1f}%", dec, host])
    sched.gpu_timeline = None
    loss = 1 - rate["json_schema"] / rate["none, same lengths"]
    title = (f"offline standard workload ({n} requests): loss under the schema {loss * 100:.1f}% against the same "
             f"lengths unconstrained (target <= 10%); {(1 - rate['json_schema'] / rate['none']) * 100:.1f}% "
             "against the workload's own lengths")
    print_table(title, ["grammar", "requests", "output tokens", "s", "output tok/s", "GPU idle (decode)",
                        "decode ms/step (mean batch)", "grammar host ms/masked step: drain / advance / mask"], rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", tokenizer=qwen_tokenizer_dir(), max_running_requests=256)
    llm.generate([[1] * 32] * 8, SamplingParams(max_tokens=8, temperature=0.6), use_tqdm=False)  # warm-up
    copy_gbs, _ = ceilings()
    compile_delays(llm)
    mask_times(llm, copy_gbs)
    throughput(llm, args.num_requests, args.max_input_len, args.max_output_len)
    thread_times(llm)


if __name__ == "__main__":
    main()
