"""KV-store and embedding-index microbenchmarks: minisgl's CUDA kernels against torch.

    python benchmarks/kernels/store_embedding.py

store_kv bytes = K and V rows read + written (4 * n * Hkv * D * 2) + 4-byte slot ids; k and v
are column slices of a fused [n, (Hq + 2 Hkv) * D] qkv output, as in the model. Baseline:
torch index_put (`k_cache[slots] = k`, twice). Embedding bytes = rows read + written
(2 * n * hidden * 2) + ids; baseline torch.index_select into the same (rotated) outputs.
Both against the copy ceiling (they write as many bytes as they read), and next to a plain
copy_ of the same bytes: at a few MB, launch and ramp-up bound any kernel.
"""

from __future__ import annotations

import torch
from _bench import ceilings, num_sets, print_ceilings, print_table, time_calls

from minisgl.ops.embedding import embedding_lookup
from minisgl.ops.store import store_kv, store_kv_reference

TOKENS = [1, 64, 512, 2048, 8192, 32768]
HQ, HKV, DIM = 32, 8, 128  # Llama-3.1-8B
EMBEDDINGS = {"Llama-3.1-8B": (128256, 4096), "Qwen3-0.6B": (151936, 1024)}


def same_bytes_copy(moved: int) -> float:
    """us of a plain contiguous copy_ moving the same bytes (read + write): the bound at sizes
    where launch and ramp-up, not bandwidth, dominate."""
    n = max(1, moved // 4)  # bf16 elements read (and as many written)
    pairs = [(torch.randn(n, device="cuda").bfloat16(), torch.empty(n, device="cuda", dtype=torch.bfloat16))
             for _ in range(num_sets(moved))]  # fmt: skip
    fns = [lambda p=p: p[1].copy_(p[0]) for p in pairs]
    return min(time_calls(fns, use_graph=g) for g in (True, False))


def store_rows(copy_gbs: float) -> list[list[str]]:
    slots_total = 1 << 20  # a 1M-token pool per layer (2 x 2 GiB)
    k_cache = torch.randn(slots_total, HKV, DIM, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    rows = []
    for n in TOKENS:
        moved = 4 * n * HKV * DIM * 2 + 4 * n
        sets = []
        for _ in range(num_sets(moved)):
            qkv = torch.randn(n, HQ + 2 * HKV, DIM, device="cuda", dtype=torch.bfloat16)
            slots = torch.randperm(slots_total - 1, device="cuda")[:n].to(torch.int32) + 1
            sets.append((qkv[:, HQ : HQ + HKV], qkv[:, HQ + HKV :], slots))
        t_ours = time_calls([lambda s=s: store_kv(k_cache, v_cache, *s) for s in sets])
        t_ref = time_calls([lambda s=s: store_kv_reference(k_cache, v_cache, *s) for s in sets])
        t_copy = same_bytes_copy(moved)
        gbs = moved / t_ours / 1e3
        rows.append(
            [
                str(n),
                f"{moved / 1e6:.2f}",
                f"{t_ours:.1f}",
                f"{gbs:,.0f}",
                f"{100 * gbs / copy_gbs:.0f}%",
                f"{t_copy:.1f}",
                f"{t_ref:.1f}",
                f"{t_ref / t_ours:.1f}x",
            ]
        )
    return rows


def embedding_rows(copy_gbs: float) -> list[list[str]]:
    rows = []
    for model, (vocab, hidden) in EMBEDDINGS.items():
        weight = torch.randn(vocab, hidden, device="cuda", dtype=torch.bfloat16)
        for n in TOKENS:
            moved = 2 * n * hidden * 2 + 8 * n
            # Output buffers rotate too: rewriting one buffer would be absorbed by the L2.
            sets = [(torch.randint(0, vocab, (n,), device="cuda"),
                     torch.empty(n, hidden, device="cuda", dtype=torch.bfloat16))
                    for _ in range(num_sets(moved))]  # fmt: skip
            t_ours = time_calls([lambda s=s, w=weight: embedding_lookup(w, s[0], out=s[1]) for s in sets])
            t_ref = time_calls([lambda s=s, w=weight: torch.index_select(w, 0, s[0], out=s[1]) for s in sets])
            t_copy = same_bytes_copy(moved)
            gbs = moved / t_ours / 1e3
            rows.append(
                [
                    model,
                    str(n),
                    f"{moved / 1e6:.2f}",
                    f"{t_ours:.1f}",
                    f"{gbs:,.0f}",
                    f"{100 * gbs / copy_gbs:.0f}%",
                    f"{t_copy:.1f}",
                    f"{t_ref:.1f}",
                    f"{t_ref / t_ours:.1f}x",
                ]
            )
    return rows


def main() -> None:
    copy_gbs, read_gbs = ceilings()
    print_ceilings(copy_gbs, read_gbs)
    print_table(
        f"store_kv, Llama-3.1-8B layer (Hkv {HKV}, D {DIM}, bf16), k/v slices of fused qkv",
        ["tokens", "MB moved", "ours us", "GB/s", "% copy", "copy_ same MB us", "index_put us", "vs torch"],
        store_rows(copy_gbs),
    )
    print_table(
        "embedding_lookup (int64 ids, bf16)",
        ["model", "tokens", "MB moved", "ours us", "GB/s", "% copy", "copy_ same MB us", "index_select us", "vs torch"],
        embedding_rows(copy_gbs),
    )


if __name__ == "__main__":
    main()
