"""Triton kernel microbenchmarks (issue 4), each against a named baseline timed in the same run.

    python benchmarks/kernels/bench_triton.py [extend|decode|elementwise|sampling|all] [--sweep]

Formulas. Attention: FLOPs = 2 * 2 * q_heads * head_dim per attended (query, key) pair.
Norm / RoPE / SiLU: bytes = every input element read once + every output written once;
ceiling = the device's copy bandwidth (1 GiB copy_, read + write bytes) measured here.
Sampling: time per batch vs the sort-based torch reference (softmax, sort, cumsum, scatter,
exponential race). Times: medians of CUDA-graph replays over rotated input sets (_bench.py).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable

import torch
from _bench import ceilings, gemm_tflops, num_sets, print_ceilings, print_table, time_calls

from minisgl.kernels import activation, norm, rope, sampling
from minisgl.kernels import decode_attention as dec
from minisgl.kernels import extend_attention as ext

DEV = "cuda"
BF16 = torch.bfloat16


def timed(make: Callable[[int], Callable[[], object]], bytes_per_call: int) -> float:
    """Median us per call over rotated input sets; eager timing if graph capture fails."""
    fns = [make(i) for i in range(num_sets(bytes_per_call))]
    try:
        return time_calls(fns)
    except RuntimeError:
        return time_calls(fns, use_graph=False)


# ---- extend attention ---------------------------------------------------------------------


def paged_slots(seq_lens: list[int], page: int, gen: torch.Generator) -> tuple[torch.Tensor, int]:
    pages = sum(-(-s // page) for s in seq_lens) + 1
    order = (torch.randperm(pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32)
    for i, s in enumerate(seq_lens):
        n = -(-s // page)
        p, order = torch.tensor(order[:n]), order[n:]
        table[i, :s] = (p[:, None] * page + torch.arange(page)).reshape(-1)[:s].int()
    return table.to(DEV), pages * page


def extend_inputs(prefix: int, new: int, batch: int, page: int, seed: int, hq=32, hkv=8, d=128):
    gen = torch.Generator().manual_seed(seed)
    seq = prefix + new
    table, slots = paged_slots([seq] * batch, page, gen)
    g = torch.Generator(device=DEV).manual_seed(seed)
    i32 = dict(dtype=torch.int32, device=DEV)
    return dict(
        q=torch.randn(batch * new, hq, d, device=DEV, dtype=BF16, generator=g),
        k_cache=torch.randn(slots, hkv, d, device=DEV, dtype=BF16, generator=g),
        v_cache=torch.randn(slots, hkv, d, device=DEV, dtype=BF16, generator=g),
        req_to_slot=table,
        req_rows=torch.arange(batch, **i32),
        prefix_lens=torch.full((batch,), prefix, **i32),
        cu_seqlens_q=torch.arange(0, batch * new + 1, new, **i32),
        max_extend_len=new,
        scale=d**-0.5,
    )


def sdpa_inputs(prefix: int, new: int, batch: int, seed: int, hq=32, d=128):
    g = torch.Generator(device=DEV).manual_seed(seed)
    shape_kv = (batch, hq, prefix + new, d)  # GQA heads expanded, contiguous: flash's best case
    return (
        torch.randn(batch, hq, new, d, device=DEV, dtype=BF16, generator=g),
        torch.randn(shape_kv, device=DEV, dtype=BF16, generator=g),
        torch.randn(shape_kv, device=DEV, dtype=BF16, generator=g),
    )


def bench_extend(sweep: bool) -> None:
    rows = []
    peak = gemm_tflops()
    configs = [None]
    if sweep:
        configs += [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 8, 4), (64, 64, 4, 3)]
    for name, prefix, new, batch in (("dense 4k", 0, 4096, 1), ("8 x 1k on 3k prefix", 3072, 1024, 8)):
        pairs = batch * (new * prefix + new * (new + 1) // 2)
        flops = 4 * 32 * 128 * pairs
        q, k, v = sdpa_inputs(prefix, new, batch, 0)
        io = (q.numel() + k.numel() + v.numel()) * 2

        def sdpa(i: int, q=q, k=k, v=v) -> Callable[[], object]:
            # aten's flash entry point with is_causal = bottom-right alignment (what
            # torch.nn.attention.bias.causal_lower_right dispatches to for L != S).
            return lambda: torch.ops.aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, is_causal=True, return_debug_mask=False, scale=128**-0.5
            )

        t_sdpa = timed(sdpa, io)
        tf = flops / t_sdpa / 1e6
        rows.append([name, "SDPA flash (contiguous)", f"{t_sdpa:.0f}", f"{tf:.0f}", f"{100 * tf / peak:.0f}%", "1.00"])
        for page in (1, 16):
            sets = [extend_inputs(prefix, new, batch, page, s) for s in range(2)]
            want = ext.extend_attention(**sets[0])
            for cfg in configs:

                def ours(i: int, cfg=cfg, sets=sets) -> Callable[[], object]:
                    return lambda: ext.extend_attention(**sets[i % 2], config=cfg)

                # Every tile config must compute the same function as the default one.
                diff = (ext.extend_attention(**sets[0], config=cfg).float() - want.float()).abs().max()
                assert diff < 2e-2, f"config {cfg} differs from the default by {diff}"
                t = timed(ours, io)
                label = f"triton page {page}" + (f" cfg {cfg}" if cfg else "")
                tf = flops / t / 1e6
                rows.append([name, label, f"{t:.0f}", f"{tf:.0f}", f"{100 * tf / peak:.0f}%", f"{t_sdpa / t:.2f}"])
    print_table(
        "Extend attention, bf16, 32 q / 8 kv heads, head_dim 128 (TFLOP/s = 4*Hq*D*pairs/t; "
        f"ceiling: bf16 GEMM {peak:.0f} TFLOP/s, 8192^3 torch.matmul, this run)",
        ["shape", "kernel", "us", "TFLOP/s", "of GEMM", "vs SDPA"],
        rows,
    )


# ---- decode attention ---------------------------------------------------------------------


def bench_decode(copy_gbs: float) -> None:
    rows = []
    for batch, ctx in ((64, 4096), (1, 32768), (256, 1024)):
        gen = torch.Generator().manual_seed(batch)
        table, slots = paged_slots([ctx] * batch, 16, gen)
        kv_bytes = 2 * batch * ctx * 8 * 128 * 2

        def make(i: int, table=table, slots=slots, batch=batch, ctx=ctx) -> Callable[[], object]:
            g = torch.Generator(device=DEV).manual_seed(i)
            q = torch.randn(batch, 32, 128, device=DEV, dtype=BF16, generator=g)
            kc = torch.randn(slots, 8, 128, device=DEV, dtype=BF16, generator=g)
            vc = torch.randn(slots, 8, 128, device=DEV, dtype=BF16, generator=g)
            rows_ = torch.arange(batch, dtype=torch.int32, device=DEV)
            lens = torch.full((batch,), ctx, dtype=torch.int32, device=DEV)
            return lambda: dec.decode_attention(q, kc, vc, table, rows_, lens, ctx, 128**-0.5)

        t = timed(make, kv_bytes)
        gbs = kv_bytes / t / 1e3
        rows.append([f"B={batch} ctx={ctx}", f"{t:.1f}", f"{gbs:,.0f}", f"{100 * gbs / copy_gbs:.0f}%"])
    print_table(
        "Triton decode attention, bf16, 32/8 heads, D 128, page 16 (bytes = K+V read)",
        ["shape", "us", "GB/s", "of copy"],
        rows,
    )


# ---- norm / rope / silu --------------------------------------------------------------------


def bench_elementwise(copy_gbs: float) -> None:
    t_, h = 8192, 4096
    rows = []

    def row(name: str, nbytes: int, make_ours, make_ref) -> None:
        t_ours, t_ref = timed(make_ours, nbytes), timed(make_ref, nbytes)
        gbs = nbytes / t_ours / 1e3
        rows.append(
            [
                name,
                f"{t_ours:.1f}",
                f"{gbs:,.0f}",
                f"{100 * gbs / copy_gbs:.0f}%",
                f"{t_ref:.1f}",
                f"{t_ref / t_ours:.1f}x",
            ]
        )

    def rnd(*shape: int, i: int = 0) -> torch.Tensor:
        return torch.randn(*shape, device=DEV, generator=torch.Generator(DEV).manual_seed(i)).to(BF16)

    w = rnd(h)
    xs = [rnd(t_, h, i=i) for i in range(3)]
    rs = [rnd(t_, h, i=10 + i) for i in range(3)]
    row(
        "rmsnorm 8k x 4096",
        2 * t_ * h * 2,
        lambda i: lambda: norm.rmsnorm(xs[i % 3], w, 1e-6),
        lambda i: lambda: norm.rmsnorm_reference(xs[i % 3], w, 1e-6),
    )
    row(
        "fused add+rmsnorm 8k x 4096",
        4 * t_ * h * 2,
        lambda i: lambda: norm.fused_add_rmsnorm(xs[i % 3], rs[i % 3], w, 1e-6),
        lambda i: lambda: norm.fused_add_rmsnorm_reference(xs[i % 3], rs[i % 3], w, 1e-6),
    )
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float32, device=DEV) / 128))
    cache = rope.build_cos_sin_cache(inv, 65536)
    qkvs = [rnd(t_, 48 * 128, i=20 + i) for i in range(3)]
    pos = torch.randint(0, 65536, (t_,), device=DEV)

    def qk(i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = qkvs[i % 3]
        return x[:, : 32 * 128].view(t_, 32, 128), x[:, 32 * 128 : 40 * 128].view(t_, 8, 128)

    rope_bytes = 2 * t_ * 40 * 128 * 2 + t_ * 128 * 4
    row(
        "rope q32/k8 x 128, 8k tok",
        rope_bytes,
        lambda i: lambda: rope.apply_rope(*qk(i), pos, cache),
        lambda i: lambda: rope.apply_rope_reference(*qk(i), pos, cache),
    )
    fused_rows = []
    wq, wk = rnd(128, i=40), rnd(128, i=41)
    for tokens in (64, t_):
        sets = [rnd(tokens, 48 * 128, i=50 + i) for i in range(3)]
        p_ = torch.randint(0, 65536, (tokens,), device=DEV)

        def views(i: int, sets=sets, tokens=tokens) -> tuple[torch.Tensor, torch.Tensor]:
            x = sets[i % 3]
            return x[:, : 32 * 128].view(tokens, 32, 128), x[:, 32 * 128 : 40 * 128].view(tokens, 8, 128)

        def unfused(i: int, views=views, p_=p_) -> Callable[[], object]:
            # What Qwen3 attention did before the fusion: two norms on copies of q and k, then RoPE.
            def f() -> None:
                q, k = views(i)
                qn = norm.rmsnorm(q.reshape(-1, 128), wq, 1e-6).view(q.shape)
                kn = norm.rmsnorm(k.reshape(-1, 128), wk, 1e-6).view(k.shape)
                rope.apply_rope(qn, kn, p_, cache)

            return f

        def fused(i: int, views=views, p_=p_) -> Callable[[], object]:
            return lambda: rope.qk_norm_rope(*views(i), p_, cache, wq, wk, 1e-6)

        nbytes = 2 * tokens * 40 * 128 * 2 + tokens * 128 * 4  # q, k read + written, cos/sin read
        t_f, t_u = timed(fused, nbytes), timed(unfused, nbytes)
        gbs = nbytes / t_f / 1e3
        fused_rows.append(
            [
                f"{tokens} tok",
                f"{t_f:.1f}",
                f"{gbs:,.0f}",
                f"{100 * gbs / copy_gbs:.0f}%",
                f"{t_u:.1f}",
                f"{t_u / t_f:.1f}x",
            ]
        )
    for inter in (4096, 14336):
        gu = [rnd(t_, 2 * inter, i=30 + i) for i in range(2)]
        row(
            f"silu_and_mul 8k x {inter}",
            3 * t_ * inter * 2,
            lambda i, gu=gu: lambda: activation.silu_and_mul(gu[i % 2]),
            lambda i, gu=gu: lambda: activation.silu_and_mul_reference(gu[i % 2]),
        )
    print_table(
        "Norm / RoPE / SiLU, bf16 (GB/s = bytes read + written / t; baseline: torch reference)",
        ["op", "us", "GB/s", "of copy", "torch us", "speedup"],
        rows,
    )
    print_table(
        "Qwen3 q/k RMSNorm + RoPE, bf16, q32/k8 x 128 (bytes = q, k read + written, cos/sin read;"
        " baseline: the unfused Triton path, 2 rmsnorm on copies + rope)",
        ["tokens", "fused us", "GB/s", "of copy", "unfused us", "speedup"],
        fused_rows,
    )


# ---- sampling ------------------------------------------------------------------------------


def bench_sampling(sweep: bool, read_gbs: float) -> None:
    b, v = 256, 151_936
    logit_sets = [
        torch.randn(b, v, device=DEV, generator=torch.Generator(DEV).manual_seed(i)) * 2
        for i in range(num_sets(b * v * 4))
    ]
    configs: list[dict | None] = [None]
    if sweep:
        configs += [{"BLOCK": 512, "NB": 16, "num_warps": 4}, {"BLOCK": 1024, "NB": 8, "num_warps": 8}]
    rows = []
    for name, temp, k, p, minp in (
        ("T0.8 top-k 50 top-p 0.9", 0.8, 50, 0.9, 0.0),
        ("T1 top-p 0.9", 1.0, -1, 0.9, 0.0),
        ("T1 top-k 50", 1.0, 50, 1.0, 0.0),
        ("T1 min-p 0.05", 1.0, -1, 1.0, 0.05),
        ("greedy", 0.0, -1, 1.0, 0.0),
    ):
        prm = dict(
            temperature=torch.full((b,), temp, device=DEV),
            top_k=torch.full((b,), k, dtype=torch.int32, device=DEV),
            top_p=torch.full((b,), p, device=DEV),
            min_p=torch.full((b,), minp, device=DEV),
        )
        seeds = torch.arange(b, dtype=torch.int64, device=DEV)
        nbytes = b * v * 4

        def ref(i: int, prm=prm) -> Callable[[], object]:
            return lambda: sampling.sample_reference(logit_sets[i % len(logit_sets)], **prm)

        t_ref = timed(ref, nbytes)
        for cfg in configs:

            def ours(i: int, prm=prm, cfg=cfg, seeds=seeds) -> Callable[[], object]:
                return lambda: sampling.sample(
                    logit_sets[i % len(logit_sets)], **prm, seeds=seeds, steps=seeds, config=cfg
                )

            t = timed(ours, nbytes)
            passes = t * read_gbs * 1e3 / nbytes  # full reads of the logits at the read ceiling
            rows.append([name, str(cfg or "default"), f"{t:.0f}", f"{t_ref:.0f}", f"{t_ref / t:.1f}x", f"{passes:.1f}"])
    print_table(
        f"Sampling, fp32 logits {b} x {v:,} (randn*2); baseline: sort-based torch reference",
        ["params", "config", "us", "torch us", "speedup", "~row reads"],
        rows,
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("what", nargs="?", default="all", choices=["extend", "decode", "elementwise", "sampling", "all"])
    ap.add_argument("--sweep", action="store_true", help="also time alternative tile configs")
    args = ap.parse_args()
    torch.backends.cuda.matmul.allow_tf32 = True
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    if args.what in ("elementwise", "all"):
        bench_elementwise(copy_gbs)
    if args.what in ("sampling", "all"):
        bench_sampling(args.sweep, read_gbs)
    if args.what in ("decode", "all"):
        bench_decode(copy_gbs)
    if args.what in ("extend", "all"):
        bench_extend(args.sweep)


if __name__ == "__main__":
    main()
