"""GPU memory and startup time of the CUDA graphs: the decode ladder (batch sizes) and the
extend / mixed ladder (total-token buckets), for a model config with dummy weights. The engine
is built without graphs, then the ladders are captured as the scheduler would, so the
difference is the graphs alone (their pool, the static index buffer and the shared logits).

    python benchmarks/cuda_graph_memory.py --model benchmarks/configs/qwen3-8b
"""

from __future__ import annotations

import argparse
import time

import torch

from minisgl import LLM
from minisgl.step.cuda_graph import batch_size_ladder, token_bucket_ladder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-bs", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--mixed-chunk-tokens", type=int, default=512)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, disable_cuda_graph=True,
              max_running_requests=args.max_bs, max_prefill_tokens=args.max_prefill_tokens,
              mixed_chunk_tokens=args.mixed_chunk_tokens)
    eng = llm.engine
    max_tokens, max_mixed = llm.scheduler.graph_max_tokens
    gib = 1 << 30
    vocab = eng.model_config.vocab_size
    print(f"{eng.model_config.architecture}, vocab {vocab}; logits buffer [{args.max_bs}, {vocab}] fp32 = "
          f"{args.max_bs * vocab * 4 / gib:.3f} GiB")
    print("| graphs | count | capture s (incl. warm-up) | allocated GiB | reserved GiB |")
    print("|---|---|---|---|---|")
    for label, tokens, mixed in (("decode ladder", 0, 0), ("decode + prefill + mixed ladders", max_tokens, max_mixed)):
        eng.graphs, eng.steps.graphs = None, None
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        alloc0, res0 = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        t0 = time.perf_counter()
        eng.enable_cuda_graphs(args.max_bs, tokens, mixed)
        seconds = time.perf_counter() - t0
        n = len(eng.graphs.graphs)
        alloc, res = torch.cuda.memory_allocated() - alloc0, torch.cuda.memory_reserved() - res0
        print(f"| {label} | {n} | {seconds:.1f} | {alloc / gib:.3f} | {res / gib:.3f} |")
    print(f"decode batch sizes {batch_size_ladder(args.max_bs)}")
    print(f"prefill token buckets {token_bucket_ladder(max_tokens)}")
    print(f"mixed token buckets {token_bucket_ladder(max_mixed)}")


if __name__ == "__main__":
    main()
