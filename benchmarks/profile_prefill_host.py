"""Host time of a prefill: where the CPU goes while one short request is prefilled eagerly.

A short prompt's prefill is bound by the host, not the GPU: the time to first token is then
the time Python takes to launch every layer's kernels. This prints the wall time of
`LLM.generate(prompt, max_tokens=1)` (one prefill step, end to end on the host), the GPU
time of the same forward (CUDA events), and a cProfile of the host calls.

    python benchmarks/profile_prefill_host.py --model benchmarks/configs/qwen3-8b --tokens 16
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch
from profile_decode_step import time_ms  # benchmarks/ is on sys.path when run as a script

from minisgl import LLM, SamplingParams


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-8b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tokens", type=int, nargs="+", default=[16, 1024])
    ap.add_argument("--reps", type=int, default=10)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer)
    eng = llm.engine
    one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    for n in args.tokens:
        prompts = [[1000 + (7 * i + j) % 50000 for j in range(n)] for i in range(args.reps + 2)]
        llm.generate(prompts[:2], one, use_tqdm=False)  # warm up (compiles) on other prompts
        walls = []
        for p in prompts[2:]:
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            llm.generate([p], one, use_tqdm=False)
            walls.append((time.perf_counter() - t0) * 1e3)
        # GPU time of the bare forward on the same shape (rows from the table, fresh slots).
        row = eng.table.allocate_row()
        pages = eng.allocator.allocate(-(-n // eng.cfg.page_size))
        slots = eng.allocator.slot_ids(pages)[:n]
        eng.write_slots([row] * n, list(range(n)), slots)
        batch = eng.build_batch("extend", [row], [0], [prompts[0]])
        gpu_ms = time_ms(lambda b=batch: eng.forward(b), reps=5)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        eng.forward(batch)
        launch = (time.perf_counter() - t0) * 1e3
        torch.cuda.synchronize()
        eng.allocator.free(pages)
        eng.table.free_row(row)
        print(f"prefill of {n} tokens: generate(max_tokens=1) wall {statistics.median(walls):.2f} ms (median of "
              f"{len(walls)}), forward GPU {gpu_ms:.2f} ms, forward host launch {launch:.2f} ms")
        fresh = [[2000 + (11 * i + j) % 50000 for j in range(n)] for i in range(3)]  # not in the radix cache
        prof = cProfile.Profile()
        prof.enable()
        for p in fresh:
            llm.generate([p], one, use_tqdm=False)
        prof.disable()
        pstats.Stats(prof).sort_stats("tottime").print_stats(25)


if __name__ == "__main__":
    main()
