"""Structured-output overhead (Qwen3-0.6B shapes, dummy weights), all in one run:

1. grammar compile: a new JSON schema (first compile, which also builds the vocabulary tables;
   then a second new schema) and a cached one, and the first-token delay of a request with a
   new schema, a cached schema and none;
2. per-step mask time at batch 1, 64 and 256: the host fill (xgrammar, every row constrained)
   and the device apply (our Triton kernel at each BLOCK candidate, and xgrammar's own Triton
   kernel as the baseline); apply GB/s = rows * (V * 4 written at most + V / 8 mask read) /
   time, against the device copy ceiling measured here;
3. the offline standard workload (benchmarks/offline.py) with every request under a typical
   nested JSON schema vs none. Constrained requests end when their JSON completes (even with
   ignore_eos), so both runs report output tok/s. Target: <= 10% loss at batch 256.

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
from minisgl.grammar.masks import GrammarMasks  # noqa: E402
from minisgl.grammar.spec import GrammarSpec  # noqa: E402

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
    full_ms = timed(lambda: masks.apply(logits, list(range(bs)), grammars))
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


def throughput(llm: LLM, n: int, max_in: int, max_out: int) -> None:
    prompts, params = workload(n, max_in, max_out)
    schema = json.dumps(SCHEMA)
    rows = []
    rate = {}
    for label, kw in (("none", {}), ("json_schema", {"json_schema": schema})):
        ps = [SamplingParams(temperature=p.temperature, ignore_eos=True, max_tokens=p.max_tokens, **kw)
              for p in params]
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = llm.generate(prompts, ps, use_tqdm=False)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
        toks = sum(len(o["token_ids"]) for o in out)
        rate[label] = toks / dt
        rows.append([label, str(len(out)), str(toks), f"{dt:.2f}", f"{toks / dt:,.0f}"])
    loss = 1 - rate["json_schema"] / rate["none"]
    title = f"offline standard workload ({n} requests): loss under the schema {loss * 100:.1f}% (target <= 10%)"
    print_table(title, ["grammar", "requests", "output tokens", "s", "output tok/s"], rows)


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


if __name__ == "__main__":
    main()
