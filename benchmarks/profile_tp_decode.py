"""Where a tensor-parallel batch-1 decode step's GPU time goes, on rank 0 (every rank runs the
same kernels on its own shard, in lockstep):

1. the step: end to end ms/token and the GPU's ms/step (offline.py's decode_latency), against
   the floor = this rank's weight bytes / the read ceiling measured in the same run;
2. a per-kernel profile of rank 0 over `--tokens` decode steps (torch.profiler records the
   kernels inside the CUDA-graph replays): per kernel family, calls and microseconds per step;
   the GPU's idle time per step is the step time minus the kernels' sum (one stream);
3. each linear layer's GEMM alone at M = 1, the kernel the dispatch table chose, timed as a
   CUDA-graph replay over that shape's weights in rotation (so the weights come from HBM, as in
   the step): microseconds, GB/s and % of the read ceiling -- what the GEMMs would cost if the
   step ran them back to back with nothing in between;
4. the all-reduce of one token's hidden state alone (the communicator's own path, graph replay
   on both ranks at once is not possible from rank 0, so eager: an upper bound with launch).

    python benchmarks/profile_tp_decode.py --model benchmarks/configs/llama-3.1-8b --tp 2 --tokenizer Q
"""

from __future__ import annotations

import argparse
import collections
import re

import torch
from offline import decode_latency
from weight_floor import decode_weight_bytes, read_bandwidth

from minisgl import LLM, SamplingParams
from minisgl.layers.linear import gemm_calls
from minisgl.ops import linear
from minisgl.ops.gemm.tuning import time_graph

# Kernel families by name (lower case, first match wins); the rest under their own names.
FAMILIES = [
    ("skinny GEMM (ours)", r"skinny"),
    ("cuBLAS GEMM", r"gemm|cutlass|nvjet|sm90_x|cublas"),
    ("all-reduce (one-shot)", r"one_shot|oneshot|all_reduce|allreduce"),
    ("NCCL", r"nccl"),
    ("decode attention", r"decode_attention|decode_split|decode_merge|attn"),
    ("RMSNorm (+residual)", r"rmsnorm|rms_norm"),
    ("RoPE", r"rope|rotary"),
    ("KV store", r"store"),
    ("embedding", r"embed"),
    ("sampling", r"sampl|argmax|topk|softmax|gumbel"),
]


def family(name: str) -> str:
    low = name.lower()
    for fam, pat in FAMILIES:
        if re.search(pat, low):
            return fam
    return name[:60]


def kernel_profile(llm: LLM, tokens: int, step_ms: float) -> None:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        llm.generate([[3] * 16], params, use_tqdm=False)
        torch.cuda.synchronize()
    fams: dict[str, list[float]] = collections.defaultdict(lambda: [0, 0.0])
    for ev in prof.key_averages():
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        if us <= 0:  # host-side rows (runtime calls) carry no device time
            continue
        f = fams[family(ev.key)]
        f[0] += ev.count
        f[1] += us
    total = sum(us for _, us in fams.values()) / tokens
    print(f"\nrank 0 kernels over {tokens} steps (incl. one 16-token prefill), per step:")
    print(f"| {'kernel family':<40} | calls/step | us/step | us/call | % of kernel time |")
    print(f"|{'-' * 42}|-----------:|--------:|--------:|-----------------:|")
    for name, (n, us) in sorted(fams.items(), key=lambda kv: -kv[1][1]):
        print(
            f"| {name:<40} | {n / tokens:10.1f} | {us / tokens:7.1f} | {us / max(n, 1):7.2f} | "
            f"{us / tokens / total * 100:15.1f}% |"
        )
    print(f"| {'sum of kernels':<40} | {'':10} | {total:7.1f} | {'':7} | {'':16} |")
    idle = step_ms * 1000 - total
    if idle >= 0:
        print(f"GPU step {step_ms * 1000:.0f} us (events) - kernels {total:.0f} us = {idle:.0f} us per step with no "
              "kernel running on rank 0's stream (launch gaps, waiting on the host)")
    else:  # kernels launched as programmatic dependents start early and wait inside (griddepcontrol.wait)
        print(f"kernels {total:.0f} us > GPU step {step_ms * 1000:.0f} us: kernels overlap (programmatic dependent "
              "launches start before their predecessor ends and wait inside), so a row's time includes that wait")


def gemm_alone(llm: LLM, bw: float) -> float:
    """Each GEMM shape alone at M = 1 (table's choice), graph replays over its weights."""
    by_shape: dict[tuple[int, int, bool], list[torch.Tensor]] = collections.defaultdict(list)
    for w, silu, *_ in gemm_calls(llm.engine.model):
        by_shape[(w.size(0), w.size(1), silu)].append(w)
    dev = llm.engine.device
    print(f"\nrank 0 GEMMs alone at M = 1 (read ceiling {bw / 1e9:,.0f} GB/s, measured in this run):")
    print("| N x K (+silu) | calls/step | us/call | GB/s | % of ceiling | us/step |")
    print("|---|---:|---:|---:|---:|---:|")
    step_us = 0.0
    with torch.cuda.device(dev):
        for (n, k, silu), ws in sorted(by_shape.items(), key=lambda kv: -kv[0][0] * kv[0][1]):
            x = torch.randn(1, k, dtype=ws[0].dtype, device=dev)
            seen = list({w.data_ptr(): w for w in ws}.values())[:32]
            us = time_graph([lambda w=w, x=x, s=silu: linear(x, w, None, s) for w in seen])
            gbs = n * k * ws[0].element_size() / (us * 1e-6) / 1e9
            step_us += us * len(ws)
            print(
                f"| {n} x {k}{' +silu' if silu else ''} | {len(ws)} | {us:.2f} | {gbs:,.0f} | "
                f"{gbs * 1e9 / bw * 100:.0f}% | {us * len(ws):.0f} |"
            )
    print(f"GEMMs back to back: {step_us:.0f} us per step")
    return step_us


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/llama-3.1-8b")
    ap.add_argument("--tokenizer", default=None)
    ap.add_argument("--tp", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--disable-custom-all-reduce", action="store_true")
    args = ap.parse_args()
    llm = LLM(
        args.model,
        load_format="dummy",
        tokenizer=args.tokenizer,
        tp_size=args.tp,
        custom_all_reduce=not args.disable_custom_all_reduce,
    )
    try:
        e2e_ms, _ = decode_latency(llm)
        dev = llm.engine.device
        w, bw = decode_weight_bytes(llm.engine.model, 1), read_bandwidth(dev)
        floor = w / bw * 1e3
        print(
            f"TP {args.tp} batch-1: {e2e_ms:.3f} ms/token end to end; floor {w / 1e9:.2f} GB / "
            f"{bw / 1e9:,.0f} GB/s = {floor:.3f} ms ({e2e_ms / floor:.2f}x)"
        )
        kernel_profile(llm, args.tokens, e2e_ms)
        gemm_us = gemm_alone(llm, bw)
        print(
            f"\nsummary: step {e2e_ms * 1000:.0f} us; GEMMs alone {gemm_us:.0f} us (floor {floor * 1000:.0f} us); "
            f"the rest {e2e_ms * 1000 - gemm_us:.0f} us is the profile's other rows and its idle time"
        )
    finally:
        llm.shutdown()


if __name__ == "__main__":
    main()
