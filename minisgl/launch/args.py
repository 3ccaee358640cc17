"""ServerArgs: every `python -m minisgl.serve` flag, and the ZMQ addresses of one server.

Importing this module stays light (no torch) so `--help` answers at once.
"""

from __future__ import annotations

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
    tool_call_parser: str = "auto"  # hermes | llama3 | mistral | gpt-oss | auto (from the chat template) | none
    reasoning_parser: str | None = None  # qwen3 | gpt-oss | auto (gpt-oss for a harmony template)
    task: str = "auto"  # generate | embed | auto (embed for a sentence-transformers / base-model folder)
    shell: bool = False
    # overload and shutdown (server/admission.py, launch/drain.py); 0 turns a bound off
    max_queued_requests: int | None = None  # None: --max-running-requests x --dp
    max_queued_tokens: int | None = None  # None: each replica's KV pool, in tokens
    max_queue_wait_s: float = 30.0
    shutdown_timeout: float = 30.0
    # engine
    page_size: int = 1
    num_pages: int | None = None
    max_running_requests: int = 256
    attention_backend: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None
    kv_cache_dtype: str = "auto"
    seed: int = 0
    gpu_memory_fraction: float = 0.85
    cpu_kv_cache_gb: float = 1.0
    swa_full_tokens_ratio: float | None = None
    state_snapshots: int | None = None
    state_snapshot_interval: int = 1024
    deterministic: bool = False
    # scheduler (None / False = the scheduler's own default)
    max_prefill_tokens: int | None = None
    mixed_chunk_tokens: int | None = None
    cache: str | None = None
    disable_overlap: bool = False
    disable_cuda_graph: bool = False
    cuda_graph_max_bs: int | None = None
    cuda_graph_max_tokens: int | None = None
    scheduling_policy: str = "fcfs"
    host_kv_cache_gb: float = 0.0  # the host KV tier (kvcache/host_tier.py); per TP rank / DP replica
    kv_events_config: str | None = None  # JSON (message/kv_events.py); checked here, parsed by each scheduler
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
    # speculative decoding (EngineConfig fields of the same names)
    speculative_algorithm: str | None = None
    speculative_num_draft_tokens: int = 4
    speculative_draft_model: str | None = None
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    speculative_draft_table: str | None = None

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
        for name in ("max_queued_requests", "max_queued_tokens", "max_queue_wait_s", "shutdown_timeout"):
            if (getattr(self, name) or 0) < 0:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 0 (0: no bound), got {getattr(self, name)}")
        if not 0 <= self.port < 65536:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.tool_call_parser not in ("auto", "none"):
            from minisgl.parsers.tool_formats import tool_format

            tool_format(self.tool_call_parser)  # ValueError naming the choices
        if self.reasoning_parser is not None:
            from minisgl.parsers.reasoning import REASONING_PARSERS

            if self.reasoning_parser not in (*REASONING_PARSERS, "auto"):
                raise ValueError(f"--reasoning-parser must be one of {sorted(REASONING_PARSERS)} or auto")
        if self.task not in ("auto", "generate", "embed"):
            raise ValueError(f"--task must be auto, generate or embed, got {self.task!r}")
        if self.task == "embed" and self.speculative_algorithm is not None:
            raise ValueError("--speculative-algorithm is for generation: an embedding model (--task embed) takes none")
        if self.chat_template is not None and not Path(self.chat_template).is_file():
            raise ValueError(f"chat template file {self.chat_template!r} does not exist")
        from minisgl.speculative.config import make_spec_config  # light: no torch

        make_spec_config(  # checked here, before any process starts
            self.speculative_algorithm,
            self.speculative_num_draft_tokens,
            self.speculative_draft_model,
            self.speculative_ngram_min,
            self.speculative_ngram_max,
            self.speculative_draft_table,
        )
        self._check_dp()
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"--scheduling-policy must be fcfs or priority, got {self.scheduling_policy!r}")
        from minisgl.message.kv_events import check_replicas, parse_kv_events_config

        events = parse_kv_events_config(self.kv_events_config)
        if events is not None and self.cache == "naive":
            raise ValueError("--kv-events-config reports the radix cache's blocks: it needs --cache radix")
        if events is not None:
            check_replicas(events, self.dp)

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
            **shared,
            tp_rank=tp_rank,
            tp_size=self.tp,
            custom_nccl=not self.disable_custom_nccl,
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
        if self.scheduling_policy != "fcfs":
            opts["scheduling_policy"] = self.scheduling_policy
        if self.host_kv_cache_gb:
            opts["host_kv_cache_gb"] = self.host_kv_cache_gb
        return opts
