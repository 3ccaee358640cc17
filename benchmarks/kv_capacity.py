"""KV capacity of the window-sized pool groups against one full pool at the same bytes (issue 33).

Tokens a request can hold = the full-attention group's slots (a sliding layer keeps only its
window). The split is the engine's own (kvcache.pool.split_kv_budget): the default (every running
request's window plus one step, at most half the bytes) and --swa-full-tokens-ratio values.
Pure accounting, no GPU: the sizes the engine logs at startup ("KV pool groups: ...").

    python benchmarks/kv_capacity.py --model benchmarks/configs/gemma-3-27b --gib 15.2
"""

from __future__ import annotations

import argparse

import torch

from minisgl.core.model_config import ModelConfig
from minisgl.kvcache.pool import KVPool, split_kv_budget, swa_tokens_needed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/gemma-3-27b")
    ap.add_argument("--gib", type=float, default=15.2, help="KV bytes (GiB); 15.2: the H100 27B run's pool")
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--ratios", type=float, nargs="*", default=[0.25, 0.1, 0.05])
    args = ap.parse_args()
    mc = ModelConfig.from_folder(args.model)
    sliding = sum(1 for i in range(mc.num_layers) if mc.window_of(i))
    full_layers = mc.num_layers - sliding
    window = max(mc.attention_windows)
    budget = args.gib * 2**30
    per_layer = KVPool.bytes_per_token_for(1, mc.num_kv_heads, mc.head_dim, torch.bfloat16)
    one_pool = int(budget // (per_layer * mc.num_layers))
    need = swa_tokens_needed(args.max_running_requests, window, 1)
    print(f"{mc.architecture}: {full_layers} full + {sliding} sliding layers (window {window}), "
          f"{per_layer} B per layer-token (bf16), {args.gib} GiB of KV")
    print("| pool | full-layer tokens | sliding-layer slots | tokens vs one full pool |")
    print("|---|---|---|---|")
    print(f"| one full pool | {one_pool:,} | - | 1.00x |")
    for ratio in [None, *args.ratios]:
        full, swa = split_kv_budget(budget, per_layer * full_layers, per_layer * sliding, 1, ratio, need)
        name = f"default ({args.max_running_requests} running)" if ratio is None else f"ratio {ratio}"
        print(f"| groups, {name} | {full - 1:,} | {swa - 1:,} | {(full - 1) / one_pool:.2f}x |")


if __name__ == "__main__":
    main()
