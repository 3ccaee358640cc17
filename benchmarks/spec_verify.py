"""The cost of a speculative verify step against a plain decode step (Llama-3.1-8B shapes by
default, dummy weights, bf16, context 1024): for K = 1..7 at batch 1, 8 and 32, the median
step time of a verify (1 + K tokens per request through the extend path, every position's
logits, the acceptance kernel) over a decode step replayed from its CUDA graph (the served
baseline, measured in the same run; the eager decode is shown beside it).

With --eagle3 CONFIG_DIR (a head's config.json; dummy weights) it also times the drafting
work of a step (K - 1 head steps + the head's pass over the verified tokens) and projects the
batch-1 speed-up from vLLM's published EAGLE-3 acceptance lengths on MT-Bench for
Llama-3.1-8B (K = 2, 3, 4, 5: 2.36, 2.79, 3.08, 3.32 tokens per step):
    speed-up(K) = accepted length(K) x decode / (verify(K) + drafting(K)).
Target: verify at K = 4, batch 1 <= 1.25 x decode.

    python benchmarks/spec_verify.py --model benchmarks/configs/llama-3.1-8b \
        --eagle3 benchmarks/configs/eagle3-llama-3.1-8b
"""

from __future__ import annotations

import argparse

from spec_timing import StepBench

VLLM_EAGLE3_ACCEPT = {2: 2.36, 3: 2.79, 4: 3.08, 5: 3.32}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    ap.add_argument("--eagle3", default=None, help="EAGLE-3 head config folder (dummy weights)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32])
    ap.add_argument("--max-k", type=int, default=7)
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--device", default="cuda",
                    help="cpu: a smoke run (e.g. --model benchmarks/configs/qwen3-0.6b --dtype float32 --context 32)")
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    spec = {"speculative_algorithm": "eagle3", "speculative_draft_model": args.eagle3} if args.eagle3 else {}
    bench = StepBench(args.model, max(args.batch), args.max_k, args.context, args.dtype, args.device, **spec)
    print(f"model {args.model} (dummy, {bench.eng.dtype}), context {args.context}, attention {bench.eng.attn.name}; "
          f"verify: eager extend (verify graphs come with the extend graphs)")
    print("| batch | K | decode graph ms | decode eager ms | verify ms | verify / decode | drafting ms |"
          " (verify + drafting) / decode |")
    print("|---|---|---|---|---|---|---|---|")
    ratios: dict[tuple[int, int], float] = {}
    for b in args.batch:
        dec = bench.decode_ms(b)
        dec_eager = bench.decode_ms(b, graph=False)
        for k in range(1, args.max_k + 1):
            ver = bench.verify_ms(b, k)
            dr = bench.draft_ms(b, k)
            ratios[(b, k)] = (ver + dr) / dec
            print(f"| {b} | {k} | {dec:.3f} | {dec_eager:.3f} | {ver:.3f} | {ver / dec:.2f} | {dr:.3f} | "
                  f"{ratios[(b, k)]:.2f} |")
    if args.eagle3 and 1 in args.batch:
        print("\nprojected batch-1 speed-up with vLLM's EAGLE-3 acceptance lengths (Llama-3.1-8B, MT-Bench):")
        print("| K | accepted length | step cost / decode | projected speed-up |")
        print("|---|---|---|---|")
        for k, acc in VLLM_EAGLE3_ACCEPT.items():
            if (1, k) in ratios:
                print(f"| {k} | {acc} | {ratios[(1, k)]:.2f} | {acc / ratios[(1, k)]:.2f}x |")
        print("goal >= 2.2x; published: vLLM 1.75x (TPOT, K = 4), SGLang 2.36x")


if __name__ == "__main__":
    main()
