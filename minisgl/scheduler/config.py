"""SchedulerConfig: the scheduling policy knobs (server flags map onto these)."""

from __future__ import annotations

from dataclasses import dataclass

from minisgl import env


@dataclass(frozen=True)
class SchedulerConfig:
    cache: str = "radix"  # "radix" | "naive"
    max_prefill_tokens: int = 8192  # token budget of one prefill (extend) step
    overlap: bool = True  # prepare step N+1 on the CPU while the GPU runs step N
    cuda_graph: bool = True  # decode through CUDA graphs (GPU only)
    cuda_graph_max_bs: int | None = None  # default: from GPU memory
    debug_checks: bool = env.DEBUG_CHECKS  # integrity check whenever the scheduler idles
    # Admission estimate: a running request is expected to still need this share of its
    # remaining max_tokens. It decays while decoding goes well and rises after a retraction.
    init_new_token_ratio: float = 0.7
    min_new_token_ratio: float = 0.15
    new_token_ratio_decay: float = 0.002

    def __post_init__(self) -> None:
        if self.cache not in ("radix", "naive"):
            raise ValueError(f"cache must be 'radix' or 'naive', got {self.cache!r}")
        if self.max_prefill_tokens < 1:
            raise ValueError(f"max_prefill_tokens must be >= 1, got {self.max_prefill_tokens}")
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise ValueError(f"cuda_graph_max_bs must be >= 1, got {self.cuda_graph_max_bs}")
