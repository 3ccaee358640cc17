"""Engine: one rank's model + KV pool + request table + attention backend + sampler.

This file builds an engine (sizes its KV pool, loads its model and drafter) and takes it
down; what an engine does lives beside it, by what each part is, and is mixed into the one
Engine class so that callers see one object:
- steps.py: the face, one call per step kind (step, verify_step), described in the request
  vocabulary of face.py, which is all the scheduler imports of the engine besides this class;
  pooling.py: an embedding model's step (pool_step), the prompt's pooled hidden states;
- forward.py: the step primitives those calls use (build_batch, forward, sample, run_batch,
  verify), which tests, benchmarks and prompt scoring also call on batches of their own;
- graphs.py: enabling CUDA graphs (later than construction, and only when asked);
- memory.py: sizing the KV pool and the recurrent-state pool from the memory budget.
"""

from __future__ import annotations

import dataclasses
import time
from contextlib import AbstractContextManager

import torch

from minisgl import ops
from minisgl.attention.select import make_backend
from minisgl.core.model_config import ModelConfig
from minisgl.core.prompt import check_prompt
from minisgl.core.quant_config import resolve as resolve_quantization
from minisgl.distributed.communicator import make_communicator, min_across_ranks
from minisgl.distributed.info import TPInfo
from minisgl.engine.config import EngineConfig, resolve_dtype
from minisgl.engine.deterministic import check_deterministic
from minisgl.engine.forward import ForwardCalls
from minisgl.engine.graphs import GraphCapture
from minisgl.engine.memory import MemoryPlan
from minisgl.engine.pooling import PoolCalls
from minisgl.engine.steps import StepCalls
from minisgl.kvcache.pool import KVPool, PageAllocator, RequestTable
from minisgl.logging_setup import get_logger, log_phase, startup_phase
from minisgl.models.embedding_config import resolve_task
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.loading import load_model, load_model_config
from minisgl.models.source import resolve_model
from minisgl.ops.gemm.fp8 import check_fp8_device
from minisgl.ops.transfer import host_to_device
from minisgl.sampling.penalty_state import PenaltyState
from minisgl.speculative.drafter import Drafter, DraftTarget
from minisgl.step.builder import StepBuilder
from minisgl.step.cuda_graph import batch_size_ladder

log = get_logger("minisgl.engine")

# What Engine.shutdown() drops: every attribute that holds device memory.
_DEVICE_STATE = ("model", "pool", "allocator", "table", "token_buffer", "penalties", "attn", "steps", "graphs",
                 "comm", "drafter", "state_pool")


class Engine(StepCalls, PoolCalls, ForwardCalls, GraphCapture, MemoryPlan):
    def __init__(self, cfg: EngineConfig) -> None:
        started = time.perf_counter()
        self.closed = False
        self.cfg = cfg
        self.device = cfg.torch_device
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU")
            torch.cuda.set_device(self.device)
        self.source = resolve_model(cfg.model)
        self.task = resolve_task(self.source, cfg.task)  # "generate" | "embed"
        if self.task == "embed" and cfg.spec is not None:
            raise ValueError("speculative decoding is for generation: an embedding model (task embed) takes none")
        self.model_config = load_model_config(self.source)
        check_hybrid(self.model_config, cfg, self.task)
        quant = resolve_quantization(self.model_config.quantization, cfg.quantization)
        self.model_config = dataclasses.replace(self.model_config, quantization=quant)
        mc = self.model_config
        if quant is not None:
            check_fp8_device(self.device)
        self.dtype = resolve_dtype(cfg.dtype, mc, self.device)
        self.kv_dtype = self.dtype if cfg.kv_cache_dtype == "auto" else torch.float8_e4m3fn
        if self.kv_dtype == torch.float8_e4m3fn:
            check_fp8_device(self.device)
        self.max_model_len = self._context_length(mc)
        mc.check_tp(cfg.tp_size)
        self.tp = TPInfo(cfg.tp_rank, cfg.tp_size)
        if cfg.deterministic:
            check_deterministic(cfg, mc, self.tp)
        phase = self._startup_phase
        with phase("device and communicators"):
            self.comm, self.cpu_group = make_communicator(
                self.tp, self.device, cfg.dist_init_addr, cfg.custom_nccl, cfg.custom_all_reduce
            )
        torch.manual_seed(cfg.seed)
        with phase("model built, weights " + ("filled" if cfg.load_format == "dummy" else "loaded")):
            self.model = self._build_model()
        ops.set_deterministic(self.device, cfg.deterministic)
        if self.device.type == "cuda" and not cfg.deterministic:  # deterministic: one GEMM, nothing to choose
            with phase("GEMM dispatch table (measured, or from the cache)"):
                self._tune_gemms()
        attn_layer = next(x.self_attn for x in self.model.model.layers if hasattr(x, "self_attn"))
        self.num_q_heads, kv_heads = attn_layer.num_heads, attn_layer.num_kv_heads
        # A hybrid model's recurrent states: one slot per running request, before the KV pool
        # is sized (it takes its memory from the same budget).
        self.state_pool = self._build_state_pool()
        # Speculative decoding: the drafter (and its model) load before the KV pool is sized.
        self.drafter: Drafter | None = None
        if cfg.spec is not None:
            from minisgl.speculative.factory import build_drafter

            with phase(f"drafter ({cfg.spec.algorithm})"):
                self.drafter = build_drafter(self._draft_target(), cfg.spec)
            self.model.model.aux_layers = self.drafter.aux_layers
            if self.state_pool is not None:  # a verify step keeps its Gated DeltaNet inputs (commit_verify)
                self.state_pool.reserve_verify(cfg.max_running_requests * (1 + cfg.spec.num_draft_tokens),
                                               self.model.verify_width, self.dtype)
        # Sliding layers whose window is shorter than the context keep only it (a second group).
        windows = tuple(w if w < self.max_model_len else 0 for w in mc.attention_windows)
        self.swa_window = max(windows, default=0)
        num_pages, swa_pages = self._num_pages(kv_heads, windows)
        if self.tp.size > 1:
            # Every rank must admit, evict and retract alike (lockstep): the same pool on all,
            # sized by the rank with the least free memory.
            num_pages = min_across_ranks(num_pages, self.cpu_group)
            swa_pages = min_across_ranks(swa_pages, self.cpu_group) if swa_pages else 0
        self.pool = KVPool(mc.num_kv_layers, num_pages, cfg.page_size, kv_heads, mc.head_dim, self.kv_dtype,
                           self.device, windows, swa_pages)
        if self.kv_dtype == torch.float8_e4m3fn:
            self._set_kv_scales()
        self.allocator = PageAllocator(num_pages, cfg.page_size)
        # The sliding group's own pages (None: no sliding group, nothing extra allocated).
        self.swa_allocator = PageAllocator(swa_pages, cfg.page_size) if swa_pages else None
        self.swa_window = self.swa_window if swa_pages else 0
        self.table = RequestTable(cfg.max_running_requests, self.max_model_len, self.device, swa=bool(swa_pages),
                                  states=self.state_pool is not None)
        if swa_pages:
            log.info("KV pool groups: %s", self.pool.describe_groups(self.swa_window))
        if self.drafter is not None:  # its own KV pool, indexed by the same slots and table
            self.drafter.allocate_kv(num_pages, cfg.page_size, self.table)
        # The last sampled token of each request-table row. Decode steps read their input ids
        # from here on the device, so step N+1 can be launched before the host has read step
        # N's tokens (overlap scheduling).
        self.token_buffer = torch.zeros(cfg.max_running_requests + 1, dtype=torch.int64, device=self.device)
        # Per-row token history for penalties (allocated when a request first needs it).
        self.penalties = PenaltyState(cfg.max_running_requests + 1, mc.vocab_size, self.device)
        self.graphs = None  # CudaGraphRunner once enable_cuda_graphs() ran
        self.attn = make_backend(cfg.attention_backend, self.pool, self.num_q_heads, mc.attention_scale, self.device,
                                 self.dtype, mc.attention_windows)
        self.attn.deterministic = cfg.deterministic
        block_m = getattr(self.attn, "tile_block_m", None)  # backends that take the extend tile map
        self.steps = StepBuilder(self.table, self.token_buffer, self.device, self.max_model_len, mc.vocab_size,
                                 block_m, deterministic=cfg.deterministic)
        log_phase(f"engine{f' rank {self.tp.rank}' if self.tp.size > 1 else ''}: built, in all",
                  time.perf_counter() - started)
        log.info(
            "engine ready: %s (%s) on %s, %s%s, context %d, KV pool %d tokens in pages of %d, attention %s",
            self.source.name, mc.architecture, self.device, str(self.dtype).removeprefix("torch."),
            "" if quant is None else f", {quant.fmt.upper()} weights ({quant.method}, {_scales(quant)} scales)",
            self.max_model_len, self.pool.num_slots - cfg.page_size, cfg.page_size, self.attn.name,
        )

    def _startup_phase(self, what: str) -> AbstractContextManager[None]:
        rank = f" rank {self.tp.rank}" if self.tp.size > 1 else ""
        return startup_phase(f"engine{rank}: {what}")

    def _context_length(self, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings  # sliding windows are exact (attention backends)
        if self.cfg.max_model_len is None:
            return limit
        if self.cfg.max_model_len > limit:
            raise ValueError(f"max_model_len {self.cfg.max_model_len} exceeds the model's context of {limit} tokens")
        return self.cfg.max_model_len

    def _build_model(self) -> LlamaForCausalLM:
        return load_model(self.source, self.model_config, self.cfg.seed, dtype=self.dtype, device=self.device,
                          tp=self.tp, comm=self.comm, max_model_len=self.max_model_len,
                          dummy=self.cfg.load_format == "dummy", lm_head=self.task != "embed")

    def _draft_target(self) -> DraftTarget:
        cfg = self.cfg
        return DraftTarget(self.model_config, self.model.model.embed_tokens, self.device, self.dtype, self.tp,
                           self.comm, self.max_model_len, cfg.max_running_requests, cfg.seed,
                           cfg.load_format == "dummy", cfg.attention_backend, self.model.lm_head,
                           None if self.source.is_gguf else self.source.path)

    def _set_kv_scales(self) -> None:
        """An FP8 pool's per-tensor scales: the checkpoint's k_scale / v_scale, else 1.0 (as vLLM)."""
        scales = self.model.kv_scales
        self.pool.k_scales = [scales.get((i, "k_scale"), 1.0) for i in range(self.pool.num_layers)]
        self.pool.v_scales = [scales.get((i, "v_scale"), 1.0) for i in range(self.pool.num_layers)]
        ratio = torch.empty((), dtype=self.dtype).element_size()
        log.info(
            "KV cache in fp8_e4m3 (scales %s): %d bytes per token, so the pool holds %dx the tokens of %s",
            "from the checkpoint" if scales else "1.0", self.pool.bytes_per_token, ratio,
            str(self.dtype).removeprefix("torch."),
        )

    def _tune_gemms(self) -> None:
        """Measures (or loads from the cache) where the skinny GEMM beats cuBLAS for this
        rank's linear layers at each decode batch size up to 32, and for FP8 layers where the
        skinny template's FP8 loader beats the FP8 GEMM: one table, one tuner (ops/gemm/tuning.py)."""
        from minisgl.layers.linear import gemm_calls
        from minisgl.ops.gemm.tuning import tune_gemms

        ms = batch_size_ladder(min(32, self.cfg.max_running_requests))
        tune_gemms(gemm_calls(self.model), self.device, ms, self.dtype)
        torch.cuda.empty_cache()  # the timing buffers must not shrink the KV pool sized next

    def shutdown(self) -> None:
        """Returns everything this engine holds on its device, at once: the CUDA graphs first
        (they reference the communicator and the static buffers; the runner also references
        the engine, a cycle that only `gc.collect()` would break), then the communicators,
        the weights, the KV pool, the request table, the attention backend, the step builder,
        the penalty state and the token buffer; then the allocator's cached blocks go back to
        the device, so that the next engine in this process, which sizes its KV pool from free
        memory, finds them free.
        Idempotent; anything that still uses the engine afterwards gets a clear error. With TP
        every rank must call it together: NCCL teardown is collective, and it waits until no
        captured graph still references the communicator (so the graphs go first)."""
        if self.closed:
            return
        # The step builder holds the runner too (its captured closures hold this engine).
        self.graphs = self.steps.graphs = None
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.comm.destroy()
        if self.tp.size > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()
        self.closed = True
        if self.cfg.deterministic:
            ops.set_deterministic(self.device, False)
        for name in _DEVICE_STATE:
            self.__dict__.pop(name, None)
        if self.device.type == "cuda":
            clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
            if clear is not None:  # cuBLAS keeps a workspace per (handle, stream), graph streams too
                clear()
            torch.cuda.empty_cache()

    def __getattr__(self, name: str):
        # Only reached when normal lookup fails, so it costs the hot path nothing.
        if name in _DEVICE_STATE and self.__dict__.get("closed"):
            raise RuntimeError(f"this engine was shut down (its {name} is freed); make a new one")
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    # ---- helpers for tests and prompt scoring ----

    def write_slots(self, rows: list[int], cols: list[int], slots: list[int], swa: bool = False) -> None:
        """req_to_slot[rows[i], cols[i]] = slots[i], all in one host-to-device copy (a decode
        step with page size 1 gives every request a new slot: one copy each would dominate).
        swa: into the sliding group's table req_to_swa_slot instead."""
        if not rows:
            return
        idx = host_to_device([rows, cols, slots], torch.int64, self.device)
        table = self.table.req_to_swa_slot if swa else self.table.req_to_slot
        table[idx[0], idx[1]] = idx[2].to(torch.int32)

    def write_state_slots(self, rows: list[int], slots: list[int]) -> None:
        """req_to_state[rows[i]] = slots[i] (-1: none), in one host-to-device copy."""
        if rows:
            idx = host_to_device([rows, slots], torch.int64, self.device)
            self.table.req_to_state[idx[0]] = idx[1].to(torch.int32)

    def _take_state_slot(self, row: int) -> int | None:
        """A recurrent-state slot for table row `row` (None: the model has no state pool)."""
        if self.state_pool is None:
            return None
        slot = self.state_pool.allocate()
        self.write_state_slots([row], [slot])
        return slot

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits [len, vocab] for every position of each prompt (one extend step each)."""
        out = []
        for ids in prompts:
            self.check_prompt(ids)
            pages_needed = -(-len(ids) // self.cfg.page_size)
            if not self.allocator.can_allocate(pages_needed):
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the free KV pool")
            swa = self.swa_allocator
            if swa is not None and not swa.can_allocate(pages_needed):
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the free sliding-window KV pool")
            row = self.table.allocate_row()
            state = self._take_state_slot(row)
            pages = self.allocator.allocate(pages_needed)
            swa_pages = swa.allocate(pages_needed) if swa is not None else []
            try:
                cols = list(range(len(ids)))
                self.write_slots([row] * len(ids), cols, self.allocator.slot_ids(pages)[: len(ids)])
                if swa is not None:
                    self.write_slots([row] * len(ids), cols, swa.slot_ids(swa_pages)[: len(ids)], swa=True)
                batch = self.build_batch("extend", [row], [0], [list(ids)], use_graphs=False)
                out.append(self.forward(batch, all_positions=True).cpu())
            finally:
                self.allocator.free(pages)
                if swa is not None:
                    swa.free(swa_pages)
                if state is not None:
                    self.state_pool.free(state)
                    self.write_state_slots([row], [-1])
                self.table.free_row(row)
        return out

    def check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.max_model_len, self.model_config.vocab_size)


def _scales(quant: object) -> str:
    """The startup log's scale granularity: FP8's tensor/channel/block, 4-bit's group size."""
    if quant.fmt == "fp8":
        return quant.weights
    return f"group {quant.group}" if quant.group else "per-channel"


def check_hybrid(mc: ModelConfig, cfg: EngineConfig, task: str) -> None:
    """What a hybrid linear-attention model (Qwen3-Next, Qwen3.5) cannot run yet, refused at
    start by name (issue 34's first slice)."""
    if mc.linear_attn is None:
        return
    if cfg.spec is not None and cfg.spec.algorithm == "eagle3":
        raise ValueError(f"{mc.architecture}: EAGLE-3 heads read Llama-family hidden states; use "
                         "--speculative-algorithm mtp (the checkpoint's own MTP head), ngram or draft")
    if task == "embed":
        raise ValueError(f"{mc.architecture}: embeddings (--task embed) are not built for hybrid models")
