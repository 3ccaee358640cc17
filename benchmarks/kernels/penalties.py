"""Penalties / logit bias / bans (kernels/penalties.py) and batched top-k logprobs (issue 14),
each against a named baseline timed in the same run; plus what they add to a decode step.

    python benchmarks/kernels/penalties.py [--sweep]

Formulas. Penalty op, dense rows: bytes = V * (4 logits + 4 counts [+ 1 prompt when a
repetition penalty reads it]) read + 4 per changed logit written; sparse rows (bias / bans
only): a few bytes per id (shown as "-"). Ceiling: the read GB/s of a 1 GiB fp32 sum measured
in this run. Top-k logprobs: bytes = rows * V * 4 (one read of the rows; the op reads them
twice: logsumexp and topk). Times: medians of CUDA-graph replays over rotated input sets
(_bench.py); "eager" where the op cannot be captured (the torch reference syncs the host).
Tile candidates (--sweep) print side by side; the best goes to kernels/penalties.py
default_config.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls

from minisgl import ops
from minisgl.core.logits_spec import LogitsSpec
from minisgl.core.sampling_params import SamplingParams
from minisgl.kernels import penalties as K
from minisgl.sampling.logits_plan import LogitsPlan, sample_with_plan
from minisgl.sampling.penalty_state import PenaltyState
from minisgl.sampling.sampler import SamplingTensors

DEV = "cuda"
B, V = 256, 151_936
CONFIGS = [
    None,
    {"CHUNK": 1 << 30, "BLOCK": 4096, "num_warps": 8},
    {"CHUNK": 4096, "BLOCK": 1024, "num_warps": 4},
    {"CHUNK": 8192, "BLOCK": 2048, "num_warps": 8},
    {"CHUNK": 32768, "BLOCK": 4096, "num_warps": 8},
]


def timed(make: Callable[[int], Callable[[], object]], nbytes: int) -> tuple[float, str]:
    fns = [make(i) for i in range(num_sets(nbytes))]
    try:
        return time_calls(fns), "graph"
    except RuntimeError:
        torch.cuda.synchronize()
        return time_calls(fns, use_graph=False), "eager"


def history(gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Counts of 512 generated tokens and a 2048-token prompt per row (a long decode)."""
    counts = torch.zeros(B + 1, V, dtype=torch.int32, device=DEV)
    ids = torch.randint(0, V, (B + 1, 512), device=DEV, generator=gen)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.int32))
    prompt = torch.zeros(B + 1, V, dtype=torch.uint8, device=DEV)
    prompt.scatter_(1, torch.randint(0, V, (B + 1, 2048), device=DEV, generator=gen), 1)
    return counts, prompt


def penalty_args(n: int, dense: bool, nbias: int, gen: torch.Generator, counts, prompt) -> dict:
    i32, f32 = dict(dtype=torch.int32, device=DEV), dict(dtype=torch.float32, device=DEV)
    ids = torch.stack([torch.randperm(V, device=DEV, generator=gen)[:nbias] for _ in range(n)]) if nbias else None
    return dict(
        rows=torch.arange(n, **i32) * (B // n), state_rows=torch.arange(n, **i32), counts=counts, prompt=prompt,
        rep=torch.full((n,), 1.2 if dense else 1.0, **f32), pres=torch.full((n,), 0.5 if dense else 0.0, **f32),
        freq=torch.full((n,), 0.3 if dense else 0.0, **f32),
        bias_ptr=torch.arange(0, n * nbias + 1, max(nbias, 1), **i32)[: n + 1] if nbias else torch.zeros(n + 1, **i32),
        bias_ids=ids.flatten().to(torch.int32) if ids is not None else torch.zeros(0, **i32),
        bias_vals=torch.full((n * nbias,), -float("inf") if nbias <= 2 else 1.5, **f32),
    )


def bench_penalties(sweep: bool, read_gbs: float) -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    logit_sets = [torch.randn(B, V, device=DEV, generator=gen) for _ in range(num_sets(B * V * 4))]
    counts, prompt = history(gen)
    changed = int(((counts[0] > 0) | (prompt[0] > 0)).sum())
    rows = []
    for name, n, dense, nbias in (
        ("rep+pres+freq, all rows", B, True, 0), ("rep+pres+freq, 32 rows", 32, True, 0),
        ("rep+pres+freq, 1 row", 1, True, 0), ("logit_bias 16 ids, all rows", B, False, 16),
        ("min_tokens ban 2 ids, all rows", B, False, 2),
    ):
        n = min(n, B)
        args = penalty_args(n, dense, nbias, gen, counts, prompt)
        nbytes = n * (V * 9 + changed * 4) if dense else 0

        def ref(i: int, args=args) -> Callable[[], object]:
            return lambda: K.apply_penalties_reference(logit_sets[i % len(logit_sets)], **args)

        t_ref, _ = timed(ref, max(nbytes, B * V * 4))
        for cfg in CONFIGS if sweep else CONFIGS[:1]:

            def ours(i: int, args=args, cfg=cfg) -> Callable[[], object]:
                return lambda: K.apply_penalties(logit_sets[i % len(logit_sets)], **args, config=cfg)

            t, how = timed(ours, max(nbytes, B * V * 4))
            gbs = nbytes / t / 1e3 if nbytes else 0.0
            label = "default" if cfg is None else f"{min(cfg['CHUNK'], V)}/{cfg['BLOCK']}/w{cfg['num_warps']}"
            rows.append([name, label, f"{t:.1f}", how, f"{gbs:,.0f}" if nbytes else "-",
                         f"{gbs / read_gbs:.0%}" if nbytes else "-", f"{t_ref:.0f}", f"{t_ref / t:.1f}x"])
    print_table(
        f"Penalty op, fp32 logits {B} x {V:,} in place; history: 512 generated + 2048 prompt tokens per row; "
        "baseline: the torch reference (eager)",
        ["rows", "CHUNK/BLOCK/warps", "us", "timing", "GB/s", "of read", "torch us", "speedup"], rows,
    )


def bench_top_logprobs(read_gbs: float) -> None:
    gen = torch.Generator(DEV).manual_seed(1)
    rows = []
    for n, k in ((B, 20), (32, 5), (1, 20)):
        sets = [torch.randn(n, V, device=DEV, generator=gen) for _ in range(num_sets(n * V * 4))]
        nbytes = n * V * 4
        t, how = timed(lambda i, sets=sets, k=k: (lambda: ops.top_logprobs(sets[i % len(sets)], k)), nbytes)
        t_ref, _ = timed(lambda i, sets=sets, k=k: (lambda: torch.log_softmax(sets[i % len(sets)], -1).topk(k)), nbytes)
        gbs = nbytes / t / 1e3
        rows.append([str(n), str(k), f"{t:.1f}", how, f"{gbs:,.0f}", f"{gbs / read_gbs:.0%}", f"{t_ref:.1f}",
                     f"{t_ref / t:.2f}x"])
    print_table(
        f"Top-k logprobs (ops.top_logprobs: topk + logsumexp), fp32 rows of {V:,}; "
        "baseline: log_softmax + topk (writes [n, V])",
        ["rows", "k", "us", "timing", "GB/s", "of read", "baseline us", "speedup"], rows,
    )


def bench_step() -> None:
    """A greedy decode step's sampling of B rows: plain, vs every row penalized + biased +
    top-20 logprobs through the engine's own code (sample_with_plan: raw copy, penalty op,
    sampling, raw logprobs, count update)."""
    gen = torch.Generator(DEV).manual_seed(2)
    sets = [torch.randn(B, V, device=DEV, generator=gen) for _ in range(num_sets(B * V * 4))]
    work = torch.empty(B, V, device=DEV)
    st = SamplingTensors.build([0.0] * B, [-1] * B, [1.0] * B, [0.0] * B, [0] * B, [8] * B, torch.device(DEV))
    state = PenaltyState(B + 1, V, torch.device(DEV))
    state.reset(list(range(B)), [list(range(64))] * B, [list(range(2048))] * B)

    def greedy(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        tokens = logits.argmax(dim=-1)
        return tokens, logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)

    rows = []
    for name, sp in (
        ("plain greedy", None),
        ("rep+pres+freq", SamplingParams(repetition_penalty=1.2, presence_penalty=0.5, frequency_penalty=0.3)),
        ("+ logit_bias 16 ids + top-20", SamplingParams(repetition_penalty=1.2, presence_penalty=0.5,
                                                         frequency_penalty=0.3, top_logprobs=20,
                                                         logit_bias={t: 1.0 for t in range(0, 1600, 100)})),
    ):
        plan = None
        if sp is not None:
            spec = LogitsSpec(sp, frozenset({2}), V)
            plan = LogitsPlan.build([spec] * B, [8] * B, [True] * B, list(range(B)), [], 0, torch.device(DEV))

        def step(i: int, plan=plan) -> Callable[[], object]:
            def run() -> object:
                work.copy_(sets[i % len(sets)])  # the kernel works in place: fresh logits each call
                if plan is None:
                    return greedy(work, st)
                return sample_with_plan(work, st, plan, state, greedy)

            return run

        t, how = timed(step, B * V * 4)
        rows.append([name, f"{t:.0f}", how])
    print_table(f"Sampling part of a greedy decode step, {B} rows x {V:,} (includes a {B}x{V} copy_ of fresh logits)",
                ["rows ask for", "us", "timing"], rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    args = ap.parse_args()
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    bench_penalties(args.sweep, read_gbs)
    bench_top_logprobs(read_gbs)
    bench_step()


if __name__ == "__main__":
    main()
