"""GPU memory the decode CUDA graphs hold: bytes allocated and reserved by capturing the
batch-size ladder, for a model config with dummy weights (the engine built without graphs,
then the graphs captured by hand, so the difference is the graphs alone).

    python benchmarks/cuda_graph_memory.py --model benchmarks/configs/qwen3-0.6b --max-bs 256
"""

from __future__ import annotations

import argparse

import torch

from minisgl import LLM
from minisgl.engine.cuda_graph import CudaGraphRunner, batch_size_ladder


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--max-bs", type=int, default=256)
    args = ap.parse_args()
    llm = LLM(args.model, load_format="dummy", tokenizer=args.tokenizer, disable_cuda_graph=True,
              max_running_requests=args.max_bs)
    eng = llm.engine
    torch.cuda.synchronize(eng.device)
    alloc0, res0 = torch.cuda.memory_allocated(eng.device), torch.cuda.memory_reserved(eng.device)
    runner = CudaGraphRunner(eng, args.max_bs)
    torch.cuda.synchronize(eng.device)
    alloc1, res1 = torch.cuda.memory_allocated(eng.device), torch.cuda.memory_reserved(eng.device)
    vocab = eng.model_config.vocab_size
    ladder = batch_size_ladder(args.max_bs)
    gib = 1 << 30
    print(f"{eng.model_config.architecture}, vocab {vocab}, {len(runner.graphs)} graphs for batch sizes {ladder}")
    print(f"graphs: allocated +{(alloc1 - alloc0) / gib:.3f} GiB, reserved +{(res1 - res0) / gib:.3f} GiB")
    print(f"fp32 logits: one [max_bs, vocab] buffer = {args.max_bs * vocab * 4 / gib:.3f} GiB; "
          f"one per size = {sum(ladder) * vocab * 4 / gib:.3f} GiB")


if __name__ == "__main__":
    main()
