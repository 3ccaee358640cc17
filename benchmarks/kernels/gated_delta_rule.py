"""Gated DeltaNet chunked prefill (kernels/gated_delta_prefill.py) against flash-linear-attention's
chunk_gated_delta_rule, timed in the same run, plus the batch decode step.

    python benchmarks/kernels/gated_delta_rule.py [--tokens 1024,4096,32768] [--seqs 1]
        [--profile 32768]   CUDA time per kernel, ours and FLA's, and our kernels' registers
        [--sweep]           eager time and per-kernel time under each change in SWEEP of the
                            kernels' launch table (kernels/gated_delta_prefill.py: LAUNCH)

Shapes: Qwen3-Next-80B-A3B's linear-attention layer: 16 q/k heads, 32 v-heads, d_k = d_v = 128,
bf16 inputs, fp32 state; q/k l2-normalised in the kernel, state read from and written to a
pool slot (FLA: initial_state in, final state out). `--seqs S` splits the tokens into S equal
sequences (cu_seqlens).

Formulas (per token and v-head, the chunked algorithm with chunk C = 64):
  FLOPs = 2*C*(3*d_k + 2*d_v) (K K^T, W, Q K^T; U, attn V) + 6*d_k*d_v (W S, Q S, K^T V) ;
  bytes = q, k (2 B each per k-head element), v and o (2 B), g (4 B) and beta (2 B), plus the
          state read and written once per sequence (4 B each).
Times: medians of replays (_bench.py). Ours is captured in a CUDA graph (it reads no host
value); FLA syncs the host for its chunk indices with cu_seqlens, so both are timed eagerly
as well, and the ratio uses the eager times: ours and FLA alternate over ROUNDS rounds of 10
calls each; the table gives the medians over rounds, their ratio and the range of the
per-round ratios. The FLA row is absent when `fla` is not
importable (the table says so).
"""

from __future__ import annotations

import argparse
import statistics

import torch
from _bench import num_sets, print_table, time_calls

from minisgl.kernels import gated_delta_prefill as P
from minisgl.kernels import gated_delta_rule as K
from minisgl.kernels import gated_delta_solve as S

DEV = "cuda"
HK, HV, D = 16, 32, 128
ROUNDS = 5


def make_inputs(t: int, seqs: int, gen: torch.Generator) -> dict:
    bf = dict(device=DEV, dtype=torch.bfloat16)
    lens = [t // seqs] * seqs
    lens[-1] += t - sum(lens)
    cu = torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=DEV)
    return dict(
        q=torch.randn(t, HK, D, generator=gen, **bf), k=torch.randn(t, HK, D, generator=gen, **bf),
        v=torch.randn(t, HV, D, generator=gen, **bf),
        g=-torch.rand(t, HV, generator=gen, device=DEV) * 0.1,
        beta=torch.rand(t, HV, generator=gen, **bf),
        states=torch.randn(seqs, HV, D, D, generator=gen, device=DEV) * 0.1,
        slots=torch.arange(seqs, dtype=torch.int32, device=DEV),
        cu=cu, has=torch.ones(seqs, dtype=torch.bool, device=DEV),
    )


def ours(a: dict):
    return lambda: P.gated_delta_rule_prefill(a["q"], a["k"], a["v"], a["g"], a["beta"], a["states"],
                                              a["slots"], a["cu"], a["has"])


def fla_call(a: dict):
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    cu = a["cu"].long()
    q, k, v = (a[n][None] for n in ("q", "k", "v"))
    g, beta, h0 = a["g"][None], a["beta"][None], a["states"]

    def run():
        return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    return run


def fla_available() -> str | None:
    try:
        import fla  # noqa: F401
    except ImportError as e:
        return f"flash-linear-attention is not importable ({e}): no FLA column"
    return None


def agree(a: dict) -> float:
    """Max |ours - FLA| over the outputs, from the same initial states (a sanity check)."""
    s0 = a["states"].clone()
    o_fla, _ = fla_call(a)()
    a["states"].copy_(s0)
    o = ours(a)()
    a["states"].copy_(s0)
    return (o.float() - o_fla[0].float()).abs().max().item()


def bench_prefill(tokens: list[int], seqs: int) -> None:
    gen = torch.Generator(DEV).manual_seed(0)
    missing = fla_available()
    rows = []
    for t in tokens:
        per_set = t * (2 * HK * D * 2 + HV * D * 2 * 2 + HV * 6) + seqs * HV * D * D * 8
        sets = [make_inputs(t, seqs, gen) for _ in range(min(num_sets(per_set), 4))]
        flops = t * HV * (2 * 64 * (3 * D + 2 * D) + 6 * D * D)
        with torch.inference_mode():
            graph_us = time_calls([ours(a) for a in sets], reps=20)
            # Eager times drift between repetitions (+-8% on the H100: each timed call starts on an
            # idle GPU); ours and FLA alternate over ROUNDS rounds, so drift hits both alike.
            ours_r, fla_r = [], []
            for _ in range(ROUNDS):
                ours_r.append(time_calls([ours(a) for a in sets], reps=10, use_graph=False))
                if missing is None:
                    fla_r.append(time_calls([fla_call(a) for a in sets], reps=10, use_graph=False))
            eager_us = statistics.median(ours_r)
            row = [f"{t:,}", f"{graph_us:,.0f}", f"{eager_us:,.0f}", f"{flops / eager_us / 1e6:.1f}",
                   f"{per_set / eager_us / 1e3:,.0f}"]
            if missing is None:
                ratios = [f / o for f, o in zip(fla_r, ours_r)]
                fla_us = statistics.median(fla_r)
                row += [f"{fla_us:,.0f}", f"{fla_us / eager_us:.2f}x", f"{min(ratios):.2f}-{max(ratios):.2f}",
                        f"{agree(sets[0]):.1e}"]
            else:
                row += ["-", "-", "-", "-"]
        rows.append(row)
    if missing:
        print(missing)
    print_table(
        f"Gated DeltaNet prefill, {seqs} sequence(s), Hk={HK} Hv={HV} d={D}, bf16 (us; TFLOP/s, GB/s from eager)",
        ["tokens", "ours graph", "ours eager", "TFLOP/s", "GB/s", "FLA eager", "FLA/ours", "per round", "max|diff|"],
        rows)


def bench_decode(batches: list[int]) -> None:
    gen = torch.Generator(DEV).manual_seed(1)
    rows = []
    for n in batches:
        a = make_inputs(n, n, gen)
        state_bytes = n * HV * D * D * 4 * 2
        us = time_calls([lambda a=a: K.gated_delta_rule_decode(a["q"], a["k"], a["v"], a["g"], a["beta"],
                                                                a["states"], a["slots"])], reps=50)
        rows.append([str(n), f"{us:.1f}", f"{state_bytes / us / 1e3:,.0f}"])
    print_table("Gated DeltaNet decode step (state read + written per request; us, GB/s)",
                ["batch", "us", "GB/s"], rows)


def triton_stats(fn) -> list[str]:  # noqa: ANN001 - a triton JITFunction
    """Registers, spills and shared memory of each compiled specialization of `fn`."""
    out = []
    for cache in getattr(fn, "device_caches", {}).values():
        for k in (cache[0] if isinstance(cache, tuple) else cache).values():
            meta = getattr(k, "metadata", None)
            out.append(f"{getattr(k, 'n_regs', '?')} registers, {getattr(k, 'n_spills', '?')} spilled, "
                       f"{getattr(meta, 'shared', '?')} B shared, {getattr(meta, 'num_warps', '?')} warps")
    return out


def profile(tokens: int) -> None:
    """Where the prefill's time goes: CUDA time per kernel (torch.profiler) for ours and FLA at
    `tokens`, and our Triton kernels' registers and spills."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    a = make_inputs(tokens, 1, torch.Generator(DEV).manual_seed(2))
    calls = [("ours", ours(a))] + ([("FLA", fla_call(a))] if fla_available() is None else [])
    for name, call in calls:
        call()
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            call()
            torch.cuda.synchronize()
        print(f"\n{name}, {tokens:,} tokens: CUDA time per kernel")
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=8, max_name_column_width=60))
    for fn in (S._gdr_kkt_solve_kernel, P._gdr_wu_kernel, P._gdr_state_kernel):
        print(fn.fn.__name__ if hasattr(fn, "fn") else fn, triton_stats(fn))


# One change from P.LAUNCH at a time; the table's choices come from this sweep.
SWEEP = [
    ("as committed", {}),
    ("wu 2 stages", {"wu": {"num_stages": 2}}),
    ("wu 8 warps", {"wu": {"num_warps": 8}}),
    ("state 2 stages", {"state": {"num_stages": 2}}),
    ("state 8 warps", {"state": {"num_warps": 8}}),
]


def sweep(tokens: list[int], seqs: int) -> None:
    """Eager prefill time under each launch-option change (P.LAUNCH), each kernel's CUDA time at
    the largest token count, so the best option per kernel can be read off, and each change's
    max |ours - FLA| at the smallest (Triton 3.6 miscompiled some options: RESULTS.md)."""
    import copy

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile
    from triton.runtime.errors import OutOfResources

    base = copy.deepcopy(P.LAUNCH)
    gen = torch.Generator(DEV).manual_seed(3)
    inputs = {t: make_inputs(t, seqs, gen) for t in tokens}
    names = ["kkt_solve", "wu", "state"]
    check = fla_available() is None
    rows = []
    for label, change in SWEEP:
        P.LAUNCH.clear()
        P.LAUNCH.update(copy.deepcopy(base))
        for kern, opts in change.items():
            P.LAUNCH[kern].update(opts)
        with torch.inference_mode():
            try:
                row = [label] + [f"{time_calls([ours(inputs[t])], reps=20, use_graph=False):,.0f}" for t in tokens]
            except OutOfResources as e:  # a tile or stage change that does not fit: say so, go on
                rows.append([label] + ["-"] * (len(tokens) + len(names)) + (["-"] if check else []))
                print(f"{label}: {e}")
                continue
            call = ours(inputs[tokens[-1]])
            call()
            torch.cuda.synchronize()
            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                call()
                torch.cuda.synchronize()
        per = {n: 0.0 for n in names}
        for e in prof.key_averages():
            for n in names:
                if f"_gdr_{n}_kernel" in e.key:
                    per[n] += e.device_time_total / 1e3
        row += [f"{per[n]:.2f}" for n in names]
        if check:
            with torch.inference_mode():
                row.append(f"{agree(inputs[tokens[0]]):.1e}")
        rows.append(row)
    P.LAUNCH.clear()
    P.LAUNCH.update(base)
    print_table(f"Launch-option sweep, {seqs} sequence(s): eager us per prefill; "
                f"ms per kernel at {tokens[-1]:,} tokens",
                ["change"] + [f"{t:,}" for t in tokens] + names + (["max|diff|"] if check else []), rows)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", default="1024,2048,4096,8192,16384,32768")
    p.add_argument("--seqs", type=int, default=1)
    p.add_argument("--decode-batches", default="1,8,64")
    p.add_argument("--profile", type=int, default=0, help="also profile one prefill of this many tokens")
    p.add_argument("--sweep", action="store_true", help="also time the launch-option changes in SWEEP")
    p.add_argument("--sweep-tokens", default="1024,4096,32768")
    args = p.parse_args()
    dev = torch.cuda.get_device_properties(0)
    print(f"device: {dev.name}, {dev.multi_processor_count} SMs, torch {torch.__version__}")
    bench_prefill([int(x) for x in args.tokens.split(",")], args.seqs)
    bench_decode([int(x) for x in args.decode_batches.split(",")])
    if args.profile:
        profile(args.profile)
    if args.sweep:
        sweep([int(x) for x in args.sweep_tokens.split(",")], args.seqs)


if __name__ == "__main__":
    main()
