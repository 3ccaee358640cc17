"""SchedulerConfig: the scheduling policy knobs (server flags map onto these)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl import env


@dataclass(frozen=True)
class SchedulerConfig:
    cache: str = "radix"  # "radix" | "naive"
    max_prefill_tokens: int = 8192  # token budget of one prefill (extend) step
    # Prompt tokens a step may add to the running decodes (a mixed step). The latency budget:
    # a mixed step should cost the decoding streams at most about two decode steps (DESIGN.md
    # §4: on the H100, Qwen3-8B shapes, the 512-token mixed graph took 13.2-13.6 ms against a
    # 6.5 ms decode step, 2.1x; 256 tokens 9.7 ms). 0: no mixed steps (prefill and decode
    # steps alternate). The offline LLM's default is max_prefill_tokens instead
    # (offline_mixed_chunk): nothing streams there, so whole prefill chunks ride beside the
    # decodes (H100, the offline standard workload: 19,414 output tok/s against 17,341 at 384).
    mixed_chunk_tokens: int = 384
    overlap: bool = True  # prepare step N+1 on the CPU while the GPU runs step N
    cuda_graph: bool = True  # decode through CUDA graphs (GPU only)
    cuda_graph_max_bs: int | None = None  # default: from GPU memory
    # Largest extend / mixed step captured (a token bucket ladder up to it); larger steps run
    # eagerly. Default: the largest step the scheduler forms; 0: no extend graphs.
    cuda_graph_max_tokens: int | None = None
    debug_checks: bool = env.DEBUG_CHECKS  # integrity check whenever the scheduler idles
    # Admission estimate: a running request is expected to still need this share of its
    # remaining max_tokens. It decays while decoding goes well and rises after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.15
    new_token_ratio_decay: float = 0.002
    # "fcfs": arrival order. "priority": the waiting queue by (priority, arrival), and a waiting
    # request may retract running ones of lower priority (larger number) to be admitted
    # (scheduler/priority.py).
    scheduling_policy: str = "fcfs"
    # GB of host memory that keeps the KV of prefixes evicted from the GPU pool, loaded back
    # on a later hit (kvcache/host_tier.py); 0: off.
    host_kv_cache_gb: float = 0.0

    def __post_init__(self) -> None:
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', got {self.cache!r}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
        if self.mixed_chunk_tokens < 0:
            raise ValueError(f"mixed_chunk_tokens must be >= 0, got {self.mixed_chunk_tokens}")
        if self.cuda_graph_max_tokens is not None and self.cuda_graph_max_tokens < 0:
            raise ValueError(f"cuda_graph_max_tokens must be >= 0, got {self.cuda_graph_max_tokens}")
        if self.host_kv_cache_gb < 0:
            raise ValueError(f"host_kv_cache_gb must be >= 0, got {self.host_kv_cache_gb}")
        if self.scheduling_policy not in ("fcfs", "priority"):
            raise ValueError(f"scheduling_policy must be 'fcfs' or 'priority', got {self.scheduling_policy!r}")


def offline_mixed_chunk(options: dict) -> int:
    """The offline LLM's default mixed chunk: a whole prefill step's tokens."""
    return int(options.get("max_prefill_tokens", SchedulerConfig.max_prefill_tokens))


def scheduler_config(options: dict, attn_name: str, device_type: str) -> SchedulerConfig:
    """SchedulerConfig from LLM/server options: SchedulerConfig fields, plus disable_overlap /
    disable_cuda_graph. The torch attention backend cannot be captured: graphs go off (said
    once in the log when the GPU would otherwise have used them)."""
    from minisgl.logging_setup import get_logger

    fields = set(SchedulerConfig.__dataclass_fields__)
    opts = {k: v for k, v in options.items() if k in fields}
    if options.get("disable_overlap"):
        opts["overlap"] = False
    if options.get("disable_cuda_graph"):
        opts["cuda_graph"] = False
    if attn_name == "torch" and opts.get("cuda_graph", True):
        if "cuda_graph" in opts or device_type == "cuda":
            get_logger("minisgl.scheduler").info("CUDA graphs off: the torch attention backend cannot be captured")
        opts["cuda_graph"] = False
    return SchedulerConfig(**opts)
