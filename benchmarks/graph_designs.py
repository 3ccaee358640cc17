"""Which CUDA-graph design for prefill, extend and mixed steps: both prototypes measured in one
run (benchmarks/graph_prototypes.py holds them; DESIGN.md §4 records the choice).

Qwen3-8B shapes, dummy weights, bf16. For each T: one request of T new tokens ("single"),
and one chunk of T tokens plus `--decodes` decoding requests at `--decode-context` tokens
("mixed", T + decodes tokens). Designs, each on the same steps:
  eager-checked  the engine's model layer by layer with every op checking its arguments (as
                 main did before the step was checked once)
  eager          engine.forward_eager: the same, the step checked once, the ops' checks skipped;
                 the baseline
  a-tiles        (a) whole forward in one graph per token bucket; every attention row,
                 decode rows included, as extend-kernel tiles from a device-side tile map
  a-decode       (a) with the decode rows of a mixed step through the paged decode kernel
                 over min(bucket, max requests) rows in the same graph; tiles for the rest
                 (here in the single-request graphs too; the engine captures its prefill
                 graphs without those rows, and only its mixed graphs have them)
  b-piecewise    (b) 37 graphs per bucket (the pieces between attention calls), attention
                 (KV store + extend kernel) launched eagerly between them
  engine         the engine's own graphs (the real path, built from the choice): its token-bucket
                 ladder (so a step may run padded in a larger bucket) and mixed steps as "mixed"
Columns: host = time to submit the step (host lists -> device buffers -> replay/launches),
GPU = CUDA events around the step (an eager step bound by the host shows its host time
here too), wall = submit until the step's results are ready. Buckets are the step sizes
themselves (no padding, but for "engine"), so the rows compare designs, not padding. The logits of every
design are checked against eager's (max |diff| / max |eager logit|); the last line gives the
rounding baseline for the mixed rows (the same decodes as a decode step vs one-row tiles).

    python benchmarks/graph_designs.py                        # the H100 run (~3-5 minutes)
    python benchmarks/graph_designs.py --tiny --device cpu    # shape logic on the CPU
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
from graph_prototypes import Piecewise, StaticMeta, Step, WholeGraph  # benchmarks/ is on sys.path

from minisgl import ops
from minisgl.engine.config import EngineConfig
from minisgl.engine.engine import Engine
from minisgl.ops import _checks

TINY = {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "head_dim": 64, "hidden_size": 256,
        "intermediate_size": 512, "max_position_embeddings": 8192, "num_attention_heads": 4,
        "num_hidden_layers": 2, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "rope_theta": 1e6,
        "tie_word_embeddings": False, "vocab_size": 1000}


def timed(fn, reps: int, cuda: bool) -> tuple[float, float, float]:  # noqa: ANN001
    """Medians (host submit ms, GPU ms by events or nan, wall ms)."""
    fn()
    host, gpu, wall = [], [], []
    for _ in range(reps):
        if cuda:
            torch.cuda.synchronize()
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
        t0 = time.perf_counter()
        fn()
        t1 = time.perf_counter()
        if cuda:
            e.record()
            e.synchronize()
            gpu.append(s.elapsed_time(e))
        wall.append((time.perf_counter() - t0) * 1e3)
        host.append((t1 - t0) * 1e3)
    return statistics.median(host), statistics.median(gpu) if gpu else float("nan"), statistics.median(wall)


def build_engine(args: argparse.Namespace, max_tokens: int) -> Engine:
    model = args.model
    if args.tiny:
        model = tempfile.mkdtemp(prefix="tiny-qwen3-")
        (Path(model) / "config.json").write_text(json.dumps(TINY))
    slots = args.decodes * (args.decode_context + 2) + max_tokens + 64
    cfg = EngineConfig(model=model, device=args.device, load_format="dummy", max_model_len=args.max_model_len,
                       num_pages=slots, page_size=1, max_running_requests=args.max_running)
    eng = Engine(cfg)
    gen = torch.Generator(device=eng.device).manual_seed(0)
    eng.pool._k.normal_(generator=gen)  # the decodes' cached contexts: finite, not zeros
    eng.pool._v.normal_(generator=gen)
    return eng


def make_steps(eng: Engine, args: argparse.Namespace) -> list[tuple[str, int, Step]]:
    dec_rows = [eng.table.allocate_row() for _ in range(args.decodes)]
    chunk_row = eng.table.allocate_row()
    rows, cols, slots = [], [], []
    for r in dec_rows:  # context + the one new token
        ids = eng.allocator.slot_ids(eng.allocator.allocate(args.decode_context + 1))
        rows += [r] * len(ids)
        cols += range(len(ids))
        slots += ids
    ids = eng.allocator.slot_ids(eng.allocator.allocate(max(args.tokens)))
    eng.write_slots(rows + [chunk_row] * len(ids), cols + list(range(len(ids))), slots + ids)
    vocab = eng.model_config.vocab_size
    gen = torch.Generator().manual_seed(1)
    out = []
    for t in args.tokens:
        chunk = torch.randint(0, vocab, (t,), generator=gen).tolist()
        out.append(("single", t, Step([chunk_row], [0], [chunk])))
        toks = torch.randint(0, vocab, (args.decodes,), generator=gen).tolist()
        out.append(("mixed", t, Step(dec_rows + [chunk_row], [args.decode_context] * args.decodes + [0],
                                     [[x] for x in toks] + [chunk], num_decodes=args.decodes)))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-8b")
    ap.add_argument("--tiny", action="store_true", help="a 2-layer Qwen3 config instead (CPU shape checks)")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 128, 1024, 4096])
    ap.add_argument("--decodes", type=int, default=64)
    ap.add_argument("--decode-context", type=int, default=640)
    ap.add_argument("--max-model-len", type=int, default=8192)
    ap.add_argument("--max-running", type=int, default=256, help="requests a step may hold (the servers' default)")
    ap.add_argument("--reps", type=int, default=10)
    ap.add_argument("--designs", nargs="+", default=["a-tiles", "a-decode", "b-piecewise", "engine"])
    args = ap.parse_args()
    eng = build_engine(args, max(args.tokens))
    cuda = eng.device.type == "cuda"
    steps = make_steps(eng, args)
    block_m = ops.extend_block_m(eng.model_config.head_dim, eng.dtype, eng.device)
    print(f"{eng.model_config.architecture}, {eng.model_config.num_layers} layers, {eng.dtype}, {eng.device}, "
          f"attention {eng.attn.name}, extend BLOCK_M {block_m}; mixed = chunk + {args.decodes} decodes at "
          f"context {args.decode_context}")
    results: dict[tuple[str, int, str], tuple[float, float, float, float]] = {}
    ref: dict[tuple[str, int], torch.Tensor] = {}
    baseline: dict[int, float] = {}
    for case, t, step in steps:
        def eager(step: Step = step) -> torch.Tensor:
            return eng.forward_eager(eng.build_batch("extend", step.rows, step.prefix, step.new, use_graphs=False))

        def eager_checked(step: Step = step) -> torch.Tensor:
            batch = eng.build_batch("extend", step.rows, step.prefix, step.new, use_graphs=False)
            assert _checks.enabled()
            eng.attn.prepare(batch)
            return eng.model(batch, eng.attn)

        with torch.inference_mode():
            ref[(case, t)] = eager().float().clone()
            if step.num_decodes:
                baseline[t] = decode_step_baseline(eng, step, ref[(case, t)])
            results[(case, t, "eager-checked")] = (*timed(eager_checked, args.reps, cuda), 0.0)
            results[(case, t, "eager")] = (*timed(eager, args.reps, cuda), 0.0)

    captures = [measure(eng, args, d, steps, block_m, ref, results) for d in args.designs if d != "engine"]
    if "engine" in args.designs:
        try:
            if cuda:
                captures.append(measure_engine(eng, args, steps, ref, results))
            else:
                print("engine: its CUDA graphs need a GPU (skipped)")
                args.designs.remove("engine")
        except Exception as e:  # the prototypes' numbers above still print
            print(f"engine design failed: {type(e).__name__}: {e}")
            args.designs.remove("engine")
    print_tables(args, results, captures)
    if baseline:
        worst = max(baseline.values())
        print(f"rounding baseline: the mixed steps' decodes run alone as an eager decode step (the decode kernel) "
              f"vs eager's one-row tiles: up to {worst:.1e}. Two correct kernels of different rounding differ by "
              "this much after the dummy layers (the tiles round P to the cache dtype before P.V, the decode kernel "
              "keeps fp32): a-decode's and engine's mixed rows may differ from eager by about as much; far more "
              "would be a bug")


def decode_step_baseline(eng: Engine, step: Step, want: torch.Tensor) -> float:
    """max |diff| / max |logit| between the step's decode rows in `want` (eager: one-row
    extend tiles) and the same decodes run as an eager decode step (the decode kernel): what
    two correct kernels of different rounding give after 36 dummy layers."""
    nd = step.num_decodes
    batch = eng.build_batch("decode", step.rows[:nd], step.prefix[:nd], step.new[:nd], use_graphs=False)
    got = eng.forward_eager(batch).float()
    return ((got - want[:nd]).abs().max() / want[:nd].abs().max()).item()


def measure(eng: Engine, args: argparse.Namespace, design: str, steps: list, block_m: int, ref: dict,
            results: dict) -> tuple[str, int, float, float, float]:
    """Captures `design` for every step size (largest first), times each step, checks logits;
    returns (design, buckets, warm-up + capture seconds, graph memory allocated / reserved GiB)."""
    cuda = eng.device.type == "cuda"
    decode_kernel = design == "a-decode"
    by_bucket: dict[int, Step] = {}
    for _, _, step in steps:
        by_bucket.setdefault(step.num_tokens, step)
    buckets = sorted(by_bucket)
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    meta = StaticMeta(eng, args.max_running, args.max_running, block_m)
    meta.allocate(buckets, decode_kernel)
    logits = torch.empty(args.max_running, eng.model_config.vocab_size, dtype=torch.float32, device=eng.device)
    if design == "b-piecewise":
        runner = Piecewise(eng, meta, logits, max(buckets))
    else:
        runner = WholeGraph(eng, meta, logits, decode_kernel)
    pool = torch.cuda.graph_pool_handle() if cuda else None
    stream = torch.cuda.Stream(eng.device) if cuda else None
    t0 = time.perf_counter()
    if cuda:
        stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream) if cuda else torch.inference_mode():
        for b in reversed(buckets):  # largest first: the others reuse its pool memory
            runner.capture(b, by_bucket[b], pool, stream)
    if cuda:
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    nan = float("nan")
    alloc, res = (torch.cuda.memory_allocated() - alloc0, torch.cuda.memory_reserved() - res0) if cuda else (nan, nan)
    for case, t, step in steps:
        got = runner.run(step, step.num_tokens).float()
        want = ref[(case, t)]
        diff = ((got - want).abs().max() / want.abs().max()).item()
        results[(case, t, design)] = (*timed(lambda s=step: runner.run(s, s.num_tokens), args.reps, cuda), diff)
    return design, len(buckets), seconds, alloc / 2**30, res / 2**30


def measure_engine(eng: Engine, args: argparse.Namespace, steps: list, ref: dict, results: dict) -> tuple:
    """The real path: Engine.enable_cuda_graphs (one decode graph, the prefill and mixed ladders
    up to the largest step), then build_batch + forward per step; mixed steps as mode "mixed"."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # the prototypes' graphs are gone
    alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
    t0 = time.perf_counter()
    largest = max(step.num_tokens for _, _, step in steps)
    eng.enable_cuda_graphs(1, largest, largest)
    seconds = time.perf_counter() - t0
    alloc, res = torch.cuda.memory_allocated() - alloc0, torch.cuda.memory_reserved() - res0
    for case, t, step in steps:
        nd = step.num_decodes
        if nd:  # decodes read their input from the token buffer, as the scheduler's do
            ids = torch.tensor([x[0] for x in step.new[:nd]], device=eng.device)
            eng.token_buffer[torch.tensor(step.rows[:nd], device=eng.device)] = ids
        mode = "mixed" if nd else "extend"
        new = [None] * nd + step.new[nd:]

        def run(step: Step = step, mode: str = mode, new: list = new) -> torch.Tensor:
            return eng.forward(eng.build_batch(mode, step.rows, step.prefix, new))

        with torch.inference_mode():
            got = run().float()
            want = ref[(case, t)]
            diff = ((got - want).abs().max() / want.abs().max()).item()
            results[(case, t, "engine")] = (*timed(run, args.reps, True), diff)
    return "engine", len(eng.graphs.graphs), seconds, alloc / 2**30, res / 2**30


def print_tables(args: argparse.Namespace, results: dict, captures: list) -> None:
    designs = ["eager-checked", "eager", *args.designs]
    print("\n| case | new tokens | design | host submit ms | GPU ms | wall ms | wall vs eager | logits rel. diff |")
    print("|---|---|---|---|---|---|---|---|")
    for case in ("single", "mixed"):
        for t in args.tokens:
            base = results[(case, t, "eager")][2]
            for d in designs:
                host, gpu, wall, diff = results[(case, t, d)]
                total = t + (args.decodes if case == "mixed" else 0)
                print(f"| {case} | {total} | {d} | {host:.2f} | {gpu:.2f} | {wall:.2f} | {base / wall:.2f}x | "
                      f"{diff:.1e} |")
    print("\n| design | graphs captured | warm-up + capture s | graph memory allocated GiB | reserved GiB |")
    print("|---|---|---|---|---|")
    for design, n, seconds, alloc, res in captures:
        print(f"| {design} | {n} | {seconds:.2f} | {alloc:.3f} | {res:.3f} |")
    worst = max(r[3] for r in results.values())
    print(f"\nlargest logits difference vs eager: {worst:.1e} (bf16: expect <= ~2e-2; fp32: <= ~1e-4)")


if __name__ == "__main__":
    main()
