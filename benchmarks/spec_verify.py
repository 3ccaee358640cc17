"""The cost of a speculative verify step against a plain decode step (Llama-3.1-8B shapes by
default, dummy weights, bf16, context 1024): for K = 1..7 at batch 1, 8 and 32, the median
step time of a verify (1 + K tokens per request, every position's logits, the acceptance
kernel) replayed from its verify graph, over a decode step replayed from its CUDA graph (the
served baseline, measured in the same run). Beside it, the same verify through the smallest
extend bucket with a logits row per token (the other design: step_builder's
VERIFY_VIA_EXTEND_BUCKETS records the choice) and eagerly, and the host time to submit it.

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


def fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


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
    pairs = [(b, k) for b in args.batch for k in range(1, args.max_k + 1)]
    bucket_top = max(b * (1 + args.max_k) for b in args.batch)
    bench = StepBench(args.model, max(args.batch), args.max_k, args.context, args.dtype, args.device, verify=pairs,
                      bucket_tokens=bucket_top, **spec)
    print(f"model {args.model} (dummy, {bench.eng.dtype}), context {args.context}, attention {bench.eng.attn.name}")
    print("verify: graph = its verify graph (b x (1 + K) tokens, the engine's design), bucket = the smallest "
          "extend bucket with a logits row per token, eager = no graph; host ms = time to submit the forward")
    print("| batch | K | decode graph ms | verify graph ms | verify bucket ms | verify eager ms | host ms graph / eager"
          " | verify graph / decode | drafting ms | (verify + drafting) / decode |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[tuple[int, int], float] = {}
    for b in args.batch:
        dec = bench.decode_ms(b)
        for k in range(1, args.max_k + 1):
            ver = bench.verify_ms(b, k, "graph")
            bucket = bench.verify_ms(b, k, "bucket")
            eager = bench.verify_ms(b, k, "eager")
            host_g, host_e = bench.verify_host_ms(b, k, "graph"), bench.verify_host_ms(b, k, "eager")
            dr = bench.draft_ms(b, k)
            ratios[(b, k)] = (ver + dr) / dec
            print(f"| {b} | {k} | {dec:.3f} | {ver:.3f} | {fmt(bucket)} | {eager:.3f} | {fmt(host_g, '.2f')} / "
                  f"{fmt(host_e, '.2f')} | {ver / dec:.2f} | {dr:.3f} | {ratios[(b, k)]:.2f} |")
    if args.eagle3 and 1 in args.batch:
        print("\nprojected batch-1 speed-up with vLLM's EAGLE-3 acceptance lengths (Llama-3.1-8B, MT-Bench):")
        print("| K | accepted length | step cost / decode | projected speed-up |")
        print("|---|---|---|---|")
        for k, acc in VLLM_EAGLE3_ACCEPT.items():
            if (1, k) in ratios:
                print(f"| {k} | {acc} | {ratios[(1, k)]:.2f} | {acc / ratios[(1, k)]:.2f}x |")
        print("goal >= 2.2x; published: vLLM 1.75x (TPOT, K = 4), SGLang 2.36x")
    print("target: verify graph / decode <= 1.25 at K = 4, batch 1")


if __name__ == "__main__":
    main()
