"""EngineConfig: everything one rank's engine needs to build itself."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl.core.model_config import ModelConfig
from minisgl.core.quant_config import QUANTIZATION_CHOICES
from minisgl.models.embedding_config import TASKS
from minisgl.speculative.config import SpecConfig, make_spec_config

DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16,
          "fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16,
          "half": torch.float16, "float": torch.float32}
ATTENTION_BACKENDS = ("auto", "torch", "triton", "cuda")
LOAD_FORMATS = ("auto", "dummy")
KV_CACHE_DTYPES = ("auto", "fp8_e4m3", "fp8")  # auto: the model's dtype; fp8 = fp8_e4m3


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    """The engine's dtype: the one asked for; else fp32 on the CPU, the checkpoint's 16-bit type on a GPU."""
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in fp16 are slow or missing; fp32 is the exact path
    declared = DTYPES.get(str(model_cfg.torch_dtype or "").removeprefix("torch."))
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


@dataclass(frozen=True)
class EngineConfig:
    model: str | None = None
    device: str = "cpu"
    dtype: str = "auto"
    max_model_len: int | None = None
    page_size: int = 1
    num_pages: int | None = None  # KV pool size; default from memory
    max_running_requests: int = 256
    attention_backend: str = "auto"
    load_format: str = "auto"
    quantization: str | None = None  # "fp8": quantize a 16-bit checkpoint's linear weights on load
    kv_cache_dtype: str = "auto"  # "fp8_e4m3": an FP8 KV pool (twice the tokens), per-tensor scales
    seed: int = 0
    tp_rank: int = 0
    tp_size: int = 1
    dist_init_addr: str | None = None  # HOST:PORT of the TP rendezvous (rank 0 listens)
    nnodes: int = 1  # machines the TP ranks span; each holds tp_size // nnodes consecutive ranks
    # First GPU of this engine's group on this machine: TP rank t (local index l) runs on GPU
    # base_gpu_id + l. Data-parallel replica r of a TP size M gets base + r * M (server/args.py).
    base_gpu_id: int = 0
    custom_nccl: bool = True  # our NCCL bindings; False: torch.distributed's NCCL
    custom_all_reduce: bool = True  # small all-reduces over peer memory (with custom_nccl only)
    gpu_memory_fraction: float = 0.85  # of total GPU memory the engine may use (weights + KV)
    cpu_kv_cache_gb: float = 1.0  # KV pool size on the CPU when num_pages is not given
    # Sliding-window layers' pool (models with windows < the context): its tokens = this x the
    # full pool's. None: enough for every running request's window plus one step (pool.py).
    swa_full_tokens_ratio: float | None = None
    # Hybrid linear-attention models: recurrent-state snapshot slots for prefix-cache resumes
    # (kvcache/radix_snap.py; None: as many as max_running_requests, 0: no prefix hits), and the
    # prompt positions a snapshot is taken every (besides each prompt's end and branch points).
    state_snapshots: int | None = None
    state_snapshot_interval: int = 1024
    # Batch-invariant kernels: a request's tokens and logprobs do not depend on what is
    # batched with it, on chunking or on prefix-cache hits (README "Determinism").
    deterministic: bool = False
    # Speculative decoding (minisgl/speculative/); None: off, and nothing of it is built or paid.
    speculative_algorithm: str | None = None  # "ngram" | "draft" | "eagle3" | "mtp"
    speculative_num_draft_tokens: int = 4
    speculative_draft_model: str | None = None
    speculative_ngram_min: int = 1
    speculative_ngram_max: int = 4
    speculative_draft_table: str | None = None  # JSON: draft tokens per batch size (spec_tune.py)
    # "embed": an embedding model (steps pool the prompt's hidden states: Engine.pool_step);
    # "auto": what the model folder is (models/embedding_config.py).
    task: str = "auto"

    def __post_init__(self) -> None:
        if self.task not in TASKS:
            raise ValueError(f"unknown task {self.task!r}; choose from {', '.join(TASKS)}")
        if self.dtype != "auto" and self.dtype not in DTYPES:
            raise ValueError(f"unknown dtype {self.dtype!r}; choose auto or one of {', '.join(DTYPES)}")
        if self.state_snapshots is not None and self.state_snapshots < 0:
            raise ValueError(f"state_snapshots must be >= 0 (0: no prefix-cache hits for hybrid models), "
                             f"got {self.state_snapshots}")
        if self.state_snapshot_interval < 1:
            raise ValueError(f"state_snapshot_interval must be >= 1 token, got {self.state_snapshot_interval}")
        if self.attention_backend not in ATTENTION_BACKENDS:
            raise ValueError(f"unknown attention_backend {self.attention_backend!r}; choose from {ATTENTION_BACKENDS}")
        if self.load_format not in LOAD_FORMATS:
            raise ValueError(f"unknown load_format {self.load_format!r}; choose from {LOAD_FORMATS}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_CHOICES:
            raise ValueError(f"unknown quantization {self.quantization!r}; choose from {QUANTIZATION_CHOICES}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"unknown kv_cache_dtype {self.kv_cache_dtype!r}; choose from {KV_CACHE_DTYPES}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be >= 1, got {self.page_size}")
        if self.max_running_requests < 1:
            raise ValueError(f"max_running_requests must be >= 1, got {self.max_running_requests}")
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank {self.tp_rank} / tp_size {self.tp_size} is not a valid rank")
        if self.nnodes < 1 or self.tp_size % self.nnodes != 0:
            raise ValueError(f"tp_size {self.tp_size} must be a multiple of nnodes {self.nnodes}")
        if self.base_gpu_id < 0:
            raise ValueError(f"base_gpu_id must be >= 0, got {self.base_gpu_id}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")
        try:
            d = torch.device(self.device)
        except RuntimeError as e:
            raise ValueError(f"unknown device {self.device!r}") from e
        if self.base_gpu_id and d.index is not None:
            raise ValueError(
                f"device {self.device!r} names one GPU and base_gpu_id {self.base_gpu_id} another: "
                f"give device='{d.type}' with base_gpu_id, or the device alone"
            )
        object.__setattr__(self, "_spec", self._build_spec())  # validated once, here

    @property
    def spec(self) -> SpecConfig | None:
        """The speculative-decoding settings, or None when speculation is off."""
        return self._spec  # type: ignore[attr-defined]

    def _build_spec(self) -> SpecConfig | None:
        return make_spec_config(
            self.speculative_algorithm, self.speculative_num_draft_tokens, self.speculative_draft_model,
            self.speculative_ngram_min, self.speculative_ngram_max, self.speculative_draft_table,
        )

    @property
    def torch_device(self) -> torch.device:
        d = torch.device(self.device)
        local_rank = self.tp_rank % (self.tp_size // self.nnodes)  # index among this machine's ranks
        if d.type != "cuda":
            return d
        return torch.device("cuda", self.base_gpu_id + local_rank if d.index is None else d.index)
