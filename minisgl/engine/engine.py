"""Engine: one rank's model + KV pool + request table + attention backend + sampler."""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.attention.base import AttentionBackend
from minisgl.distributed.communicator import make_communicator, min_across_ranks
from minisgl.distributed.info import TPInfo
from minisgl.engine.batch import ForwardBatch
from minisgl.engine.config import DTYPES, EngineConfig
from minisgl.engine.prompt import check_prompt
from minisgl.engine.sampler import SamplingTensors
from minisgl.kvcache.pool import KVPool, PageAllocator, RequestTable
from minisgl.logging_setup import get_logger
from minisgl.models.config import ModelConfig
from minisgl.models.llama import LlamaForCausalLM
from minisgl.models.source import ModelSource, resolve_model
from minisgl.models.weights import fill_dummy, iter_safetensors

log = get_logger("minisgl.engine")

# What Engine.shutdown() drops: every attribute that holds device memory.
_DEVICE_STATE = ("model", "pool", "allocator", "table", "token_buffer", "attn", "graphs", "comm")


def resolve_dtype(name: str, model_cfg: ModelConfig, device: torch.device) -> torch.dtype:
    if name != "auto":
        return DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # CPU matmuls in fp16 are slow or missing; fp32 is the exact path
    declared = DTYPES.get(str(model_cfg.torch_dtype or "").removeprefix("torch."))
    return declared if declared in (torch.float16, torch.bfloat16) else torch.bfloat16


def load_model_config(source: ModelSource) -> ModelConfig:
    if source.is_gguf:
        from minisgl.models.gguf_file import gguf_config

        return ModelConfig.from_dict(gguf_config(source.path))
    return ModelConfig.from_folder(source.path)


def make_backend(name: str, pool: KVPool, num_q_heads: int, scale: float, device: torch.device) -> AttentionBackend:
    if name == "auto":
        # GPU: our CUDA decode kernel + Triton extend where _C has CUDA, else all-Triton. A
        # float32 KV cache gets the torch backend: our CUDA kernel takes 16-bit caches only,
        # and float32 is the reference dtype, whose math the torch backend shares with the CPU.
        # (The Triton kernels are exact in fp32 too, with ieee dots; `triton` can be chosen.)
        from minisgl.ops._backend import compiled

        ext = compiled()
        if device.type != "cuda" or pool.dtype == torch.float32:
            name = "torch"
        else:
            name = "cuda" if ext is not None and ext.has_cuda else "triton"
    if name == "torch":
        from minisgl.attention.torch_backend import TorchAttentionBackend

        return TorchAttentionBackend(pool, num_q_heads, scale)
    if device.type != "cuda":
        raise ValueError(f"attention_backend {name!r} needs a CUDA device; use 'torch' on {device}")
    if name == "triton":
        from minisgl.attention.triton_backend import TritonAttentionBackend

        return TritonAttentionBackend(pool, num_q_heads, scale)
    from minisgl.attention.cuda_backend import CudaAttentionBackend

    return CudaAttentionBackend(pool, num_q_heads, scale)


class Engine:
    def __init__(self, cfg: EngineConfig) -> None:
        self.closed = False
        self.cfg = cfg
        self.device = cfg.torch_device
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("device 'cuda' was asked for but torch sees no CUDA GPU")
            torch.cuda.set_device(self.device)
        self.source = resolve_model(cfg.model)
        self.model_config = load_model_config(self.source)
        mc = self.model_config
        self.dtype = resolve_dtype(cfg.dtype, mc, self.device)
        self.max_model_len = self._context_length(mc)
        mc.check_tp(cfg.tp_size)
        self.tp = TPInfo(cfg.tp_rank, cfg.tp_size)
        if cfg.deterministic:
            _check_deterministic(mc, self.tp)
        self.comm, self.cpu_group = make_communicator(
            self.tp, self.device, cfg.dist_init_addr, cfg.custom_nccl, cfg.custom_all_reduce
        )
        torch.manual_seed(cfg.seed)
        self.model = self._build_model()
        ops.set_deterministic(self.device, cfg.deterministic)
        if self.device.type == "cuda" and not cfg.deterministic:  # deterministic: one GEMM, nothing to choose
            self._tune_gemms()
        self.num_q_heads = self.model.model.layers[0].self_attn.num_heads
        kv_heads = self.model.model.layers[0].self_attn.num_kv_heads
        num_pages = cfg.num_pages or self._default_num_pages(kv_heads)
        if self.tp.size > 1:
            # Every rank must admit, evict and retract alike (lockstep): the same pool on all,
            # sized by the rank with the least free memory.
            num_pages = min_across_ranks(num_pages, self.cpu_group)
        self.pool = KVPool(mc.num_layers, num_pages, cfg.page_size, kv_heads, mc.head_dim, self.dtype, self.device)
        self.allocator = PageAllocator(num_pages, cfg.page_size)
        self.table = RequestTable(cfg.max_running_requests, self.max_model_len, self.device)
        # The last sampled token of each request-table row. Decode steps read their input ids
        # from here on the device, so step N+1 can be launched before the host has read step
        # N's tokens (overlap scheduling).
        self.token_buffer = torch.zeros(cfg.max_running_requests + 1, dtype=torch.int64, device=self.device)
        self.graphs = None  # CudaGraphRunner once enable_cuda_graphs() ran
        self.attn = make_backend(cfg.attention_backend, self.pool, self.num_q_heads, mc.head_dim**-0.5, self.device)
        self.attn.deterministic = cfg.deterministic
        log.info(
            "engine ready: %s (%s) on %s, %s, context %d, KV pool %d tokens in pages of %d, attention %s",
            self.source.name, mc.architecture, self.device, str(self.dtype).removeprefix("torch."),
            self.max_model_len, self.pool.num_slots - cfg.page_size, cfg.page_size, self.attn.name,
        )

    def _context_length(self, mc: ModelConfig) -> int:
        limit = mc.max_position_embeddings
        if mc.sliding_window is not None and mc.sliding_window < limit:
            # Within the window, sliding-window attention equals full attention: capping the
            # context there is exact, rather than silently attending past the window.
            log.warning("capping the context at the sliding window (%d tokens)", mc.sliding_window)
            limit = mc.sliding_window
        if self.cfg.max_model_len is None:
            return limit
        if self.cfg.max_model_len > limit:
            raise ValueError(f"max_model_len {self.cfg.max_model_len} exceeds the model's context of {limit} tokens")
        return self.cfg.max_model_len

    def _build_model(self) -> LlamaForCausalLM:
        default_dtype = torch.get_default_dtype()
        torch.set_default_dtype(self.dtype)
        try:
            with torch.device(self.device):
                model = LlamaForCausalLM(self.model_config, self.tp, self.comm, self.max_model_len, self.device)
        finally:
            torch.set_default_dtype(default_dtype)
        if self.cfg.load_format == "dummy":
            fill_dummy(model, self.cfg.seed)
        elif self.source.is_gguf:
            from minisgl.models.gguf_file import gguf_config, iter_gguf

            model.load_weights(iter_gguf(self.source.path, gguf_config(self.source.path)))
        else:
            model.load_weights(iter_safetensors(self.source.path))
        return model.eval()

    def _tune_gemms(self) -> None:
        """Measures (or loads from the cache) where the skinny GEMM beats cuBLAS for this
        rank's linear layers at each decode batch size up to 32 (ops.gemm_tuning)."""
        from minisgl.engine.cuda_graph import batch_size_ladder
        from minisgl.layers.linear import gemm_calls
        from minisgl.ops.gemm_tuning import tune_gemms

        tune_gemms(gemm_calls(self.model), self.device, batch_size_ladder(min(32, self.cfg.max_running_requests)))
        torch.cuda.empty_cache()  # the timing buffers must not shrink the KV pool sized next

    def _default_num_pages(self, kv_heads: int) -> int:
        mc, ps = self.model_config, self.cfg.page_size
        per_token = KVPool.bytes_per_token_for(mc.num_layers, kv_heads, mc.head_dim, self.dtype)
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            budget = total * self.cfg.gpu_memory_fraction - used - (1 << 30)  # 1 GiB for activations
        else:
            budget = self.cfg.cpu_kv_cache_gb * (1 << 30)
        pages = int(budget // (per_token * ps))
        # More than every request at full length could use is wasted memory.
        pages = min(pages, self.cfg.max_running_requests * -(-self.max_model_len // ps) + 1)
        # At least one full-length request (+ the dummy page).
        need = -(-self.max_model_len // ps) + 1
        if pages < need:
            if self.device.type == "cuda":
                raise ValueError(f"not enough GPU memory for one {self.max_model_len}-token request's KV cache")
            pages = need
        return pages

    def shutdown(self) -> None:
        """Returns everything this engine holds on its device, at once: the CUDA graphs first
        (they reference the communicator and the static buffers; the runner also references
        the engine, a cycle that only `gc.collect()` would break), then the communicators,
        the weights, the KV pool, the request table, the attention backend and the token
        buffer; then the allocator's cached blocks go back to the device, so that the next
        engine in this process, which sizes its KV pool from free memory, finds them free.
        Idempotent; anything that still uses the engine afterwards gets a clear error. With TP
        every rank must call it together: NCCL teardown is collective, and it waits until no
        captured graph still references the communicator (so the graphs go first)."""
        if self.closed:
            return
        self.graphs = None
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

    # ---- one step ----

    def build_batch(
        self, mode: str, rows: list[int], prefix_lens: list[int], new_tokens: list[list[int]] | None
    ) -> ForwardBatch:
        """A batch for requests at table rows `rows`, each with `prefix_lens[i]` tokens already
        in the KV cache and `new_tokens[i]` to run now. The slots of the new tokens must
        already be written to the request table. Decode may pass `new_tokens=None`: each row's
        input is then its last sampled token, read on the device from `token_buffer`."""
        dev = self.device
        if new_tokens is None:
            if mode != "decode":
                raise ValueError("only decode batches may take their inputs from the token buffer")
            ext = [1] * len(rows)
        else:
            ext = [len(t) for t in new_tokens]
        seq = [p + n for p, n in zip(prefix_lens, ext)]
        cu = [0]
        for n in ext:
            cu.append(cu[-1] + n)
        pos = [p for pre, n in zip(prefix_lens, ext) for p in range(pre, pre + n)]
        tok_rows = [r for r, n in zip(rows, ext) for _ in range(n)]

        # Every index tensor in one host-to-device copy, then views (fewer tiny copies/step).
        # Each view starts on a 16-byte boundary: Triton specializes kernels on pointer
        # alignment, so offsets that moved with the batch size would recompile kernels.
        b, n = len(rows), len(pos)
        n2, b4 = n + n % 2, -(-(b + 1) // 4) * 4  # int64 segments: even; int32 segments: x4
        meta_host = [*rows, *[0] * (b4 - b), *seq, *[0] * (b4 - b), *prefix_lens, *[0] * (b4 - b), *cu]
        meta_host += [0] * (4 * b4 - len(meta_host))
        host = [*pos, *[0] * (n2 - n), *tok_rows, *[0] * (n2 - n), *meta_host, *[c - 1 for c in cu[1:]]]
        host += [0] * ((2 * n2 + 4 * b4 + b) % 2)
        if new_tokens is not None:
            host += [tok for toks in new_tokens for tok in toks]
        flat = torch.tensor(host, dtype=torch.int64).to(dev, non_blocking=True)
        positions, tok_rows_d = flat[:n], flat[n2 : n2 + n]
        meta = flat[2 * n2 : 2 * n2 + 4 * b4].to(torch.int32)
        rest = 2 * n2 + 4 * b4
        sample_rows = flat[rest : rest + b]
        req_rows = meta[:b]
        out_slots = self.table.req_to_slot[tok_rows_d, positions]
        input_ids = self.token_buffer[req_rows] if new_tokens is None else flat[rest + b + b % 2 :]
        return ForwardBatch(
            mode=mode, input_ids=input_ids, positions=positions, out_slots=out_slots, req_rows=req_rows,
            seq_lens=meta[b4 : b4 + b], prefix_lens=meta[2 * b4 : 2 * b4 + b],
            cu_seqlens_q=meta[3 * b4 : 3 * b4 + b + 1],
            sample_rows=sample_rows, req_to_slot=self.table.req_to_slot, seq_lens_cpu=seq,
            prefix_lens_cpu=list(prefix_lens), max_seq_len=max(seq), max_extend_len=max(ext),
        )

    def enable_cuda_graphs(self, max_bs: int | None) -> None:
        """Captures decode graphs up to `max_bs` (default: from GPU memory)."""
        from minisgl.engine.cuda_graph import CudaGraphRunner

        if self.attn.name == "torch":
            raise ValueError("CUDA graphs need the 'triton' or 'cuda' attention backend (or disable CUDA graphs)")
        if max_bs is None:
            total = torch.cuda.get_device_properties(self.device).total_memory
            max_bs = 256 if total >= 40 * (1 << 30) else 128
        self.graphs = CudaGraphRunner(self, min(max_bs, self.cfg.max_running_requests))

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, all_positions: bool = False) -> torch.Tensor:
        if self.graphs is not None and not all_positions and self.graphs.can_run(batch):
            return self.graphs.replay(batch)
        return self.forward_eager(batch, all_positions)

    def forward_eager(
        self, batch: ForwardBatch, all_positions: bool = False, logits_out: torch.Tensor | None = None
    ) -> torch.Tensor:
        self.attn.prepare(batch)
        return self.model(batch, self.attn, all_positions=all_positions, logits_out=logits_out)

    @torch.inference_mode()
    def sample(self, logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens, logprobs of the chosen tokens under the raw logits)."""
        if self.cfg.deterministic:
            return _sample_per_row(logits, st)
        if st.all_greedy:  # no randomness: skip the sampling kernel
            tokens = logits.argmax(dim=-1)
            # log_softmax at one index, without writing a [B, vocab] tensor every step.
            logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - logits.logsumexp(dim=-1)
            return tokens, logprobs
        return ops.sample(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps)

    @torch.inference_mode()
    def run_batch(self, batch: ForwardBatch, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
        """Forward + sample; the sampled tokens also go to `token_buffer` (the next decode's
        inputs). A prefill chunk's row samples too; the scheduler drops that token."""
        logits = self.forward(batch)
        tokens, logprobs = self.sample(logits, st)
        self.token_buffer[batch.req_rows.long()] = tokens
        return tokens, logprobs

    # ---- helpers for tests and prompt scoring ----

    def write_slots(self, rows: list[int], cols: list[int], slots: list[int]) -> None:
        """req_to_slot[rows[i], cols[i]] = slots[i], all in one host-to-device copy (a decode
        step with page size 1 gives every request a new slot: one copy each would dominate)."""
        if not rows:
            return
        idx = torch.tensor([rows, cols, slots], dtype=torch.int64).to(self.device, non_blocking=True)
        self.table.req_to_slot[idx[0], idx[1]] = idx[2].to(torch.int32)

    @torch.inference_mode()
    def score(self, prompts: list[list[int]]) -> list[torch.Tensor]:
        """fp32 logits [len, vocab] for every position of each prompt (one extend step each)."""
        out = []
        for ids in prompts:
            self.check_prompt(ids)
            pages_needed = -(-len(ids) // self.cfg.page_size)
            if not self.allocator.can_allocate(pages_needed):
                raise ValueError(f"prompt of {len(ids)} tokens does not fit the free KV pool")
            row = self.table.allocate_row()
            pages = self.allocator.allocate(pages_needed)
            try:
                self.write_slots([row] * len(ids), list(range(len(ids))), self.allocator.slot_ids(pages)[: len(ids)])
                batch = self.build_batch("extend", [row], [0], [list(ids)])
                out.append(self.forward(batch, all_positions=True).cpu())
            finally:
                self.allocator.free(pages)
                self.table.free_row(row)
        return out

    def check_prompt(self, ids: list[int]) -> None:
        check_prompt(ids, self.max_model_len, self.model_config.vocab_size)


def _check_deterministic(mc: ModelConfig, tp: TPInfo) -> None:
    """Deterministic mode covers what its kernels cover; refuse the rest by name."""
    if mc.moe is not None:
        raise ValueError("deterministic mode does not cover MoE models yet (the grouped GEMM's tiles depend on M)")
    if tp.size > 1:
        import os

        # NCCL picks its algorithm and protocol by message size and topology: pin them, so an
        # all-reduce's summation order does not change with the batch's token count.
        os.environ.setdefault("NCCL_ALGO", "Ring")
        os.environ.setdefault("NCCL_PROTO", "Simple")


def _sample_per_row(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic mode's sampler: each row alone. The GPU kernel (ops.sample) is one program
    per row already, greedy rows included (exact argmax; log_softmax by the row's own program),
    unlike torch's argmax/logsumexp, whose reduction split depends on the batch size. On the
    CPU the torch reference runs on one [1, V] row at a time."""
    if logits.device.type == "cuda":
        return ops.sample(logits, st.temperature, st.top_k, st.top_p, st.min_p, st.seeds, st.steps)
    parts = [
        ops.sample(logits[i : i + 1], st.temperature[i : i + 1], st.top_k[i : i + 1], st.top_p[i : i + 1],
                   st.min_p[i : i + 1], st.seeds[i : i + 1], st.steps[i : i + 1])
        for i in range(logits.shape[0])
    ]
    return torch.cat([t for t, _ in parts]), torch.cat([lp for _, lp in parts])
