"""How much memory an engine's caches get: the KV pool's pages (one full group, or full and
sliding groups) and the recurrent-state pool of a hybrid model, from the device's budget.

Part of Engine (engine.py mixes it in and calls these while it builds itself)."""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.kvcache.pool import KVPool, split_kv_budget, swa_tokens_needed
from minisgl.kvcache.state_pool import StatePool, state_pool_fit_error
from minisgl.logging_setup import get_logger
from minisgl.ops.gemm.w4 import DEQUANT_BYTES

log = get_logger("minisgl.engine")


class MemoryPlan:
    def _build_state_pool(self) -> StatePool | None:
        la, cfg = self.model_config.linear_attn, self.cfg
        if la is None:
            return None
        la = la.shard(self.tp.size)  # this rank's heads
        snaps = cfg.max_running_requests if cfg.state_snapshots is None else cfg.state_snapshots
        per_slot = StatePool.bytes_per_slot_for(la.num_linear_layers, la.conv_kernel, la.conv_dim, la.num_v_heads,
                                                la.k_head_dim, la.v_head_dim, self.dtype)
        self._check_state_pool_fits(per_slot, snaps)
        pool = StatePool(la.num_linear_layers, cfg.max_running_requests, la.conv_kernel, la.conv_dim, la.num_v_heads,
                         la.k_head_dim, la.v_head_dim, self.dtype, self.device, num_snapshots=snaps)
        self.model.bind_state_pool(pool)
        log.info("recurrent-state pool: %d Gated DeltaNet layers x (%d requests + %d prefix-cache snapshots), "
                 "%.1f MiB a slot (%.2f GiB)%s", la.num_linear_layers, pool.num_slots, snaps,
                 pool.bytes_per_slot / 2**20, pool.bytes_per_slot * pool.total_slots / 2**30,
                 "; no snapshots: prefix-cache hits are off for this model" if not snaps else "")
        return pool

    def _check_state_pool_fits(self, per_slot: int, snaps: int) -> None:
        """On a GPU, a clear error when the state pool would take over half of the memory left
        for the caches (state_pool_fit_error). On the CPU the pool is host memory, as before."""
        if self.device.type != "cuda":
            return
        cfg = self.cfg
        why = state_pool_fit_error(self.model_config.architecture, per_slot, cfg.max_running_requests, snaps,
                                   cfg.state_snapshots is None, self._kv_budget())
        if why is not None:
            raise ValueError(why)

    def _num_pages(self, kv_heads: int, windows: tuple[int, ...]) -> tuple[int, int]:
        """(full pages, sliding pages; 0: no sliding group). Without --num-pages the two split
        the memory budget (pool.split_kv_budget); with it, it sizes the full pool and the
        sliding pool is its ratio (--swa-full-tokens-ratio) or what the running requests need."""
        cfg, mc, ps = self.cfg, self.model_config, self.cfg.page_size
        n_swa = sum(1 for w in windows if w > 0)
        if not n_swa:
            return cfg.num_pages or self._default_num_pages(kv_heads), 0
        ratio = cfg.swa_full_tokens_ratio
        need = swa_tokens_needed(cfg.max_running_requests, self.swa_window, ps)
        if cfg.num_pages:
            tokens = ratio * (cfg.num_pages - 1) * ps if ratio is not None else min(need, (cfg.num_pages - 1) * ps)
            return cfg.num_pages, max(2, -(-int(tokens) // ps) + 1)
        full_bpt = KVPool.bytes_per_token_for(mc.num_layers - n_swa, kv_heads, mc.head_dim, self.kv_dtype)
        full_bpt += self.drafter.kv_bytes_per_token() if self.drafter is not None else 0
        swa_bpt = KVPool.bytes_per_token_for(n_swa, kv_heads, mc.head_dim, self.kv_dtype)
        full, swa = split_kv_budget(self._kv_budget(), full_bpt, swa_bpt, ps, ratio, need)
        return self._clamp_pages(full), max(2, swa)

    def _kv_budget(self) -> float:
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            used = total - free
            # 1 GiB for activations; deterministic mode's decode steps also hold their splits' partials
            # (in the CUDA graphs' pool: the largest decode graph's stays reserved); 4-bit weights'
            # large-M path holds a slice of a weight decoded to 16 bits beside them (ops/gemm/w4.py).
            det = ops.deterministic_decode_workspace_bytes() if self.cfg.deterministic else 0
            quant = self.model_config.quantization
            w4 = DEQUANT_BYTES if quant is not None and quant.fmt in ("int4", "mxfp4") else 0
            return total * self.cfg.gpu_memory_fraction - used - (1 << 30) - det - w4
        # On the CPU the state pool comes out of the same budget (on a GPU it is already used).
        states = self.state_pool.bytes_per_slot * self.state_pool.total_slots if self.state_pool is not None else 0
        return self.cfg.cpu_kv_cache_gb * (1 << 30) - states

    def _default_num_pages(self, kv_heads: int) -> int:
        mc, ps = self.model_config, self.cfg.page_size
        per_token = KVPool.bytes_per_token_for(mc.num_kv_layers, kv_heads, mc.head_dim, self.kv_dtype)
        per_token += self.drafter.kv_bytes_per_token() if self.drafter is not None else 0
        return self._clamp_pages(int(self._kv_budget() // (per_token * ps)))

    def _clamp_pages(self, pages: int) -> int:
        ps = self.cfg.page_size
        # More than every request at full length could use is wasted memory.
        pages = min(pages, self.cfg.max_running_requests * -(-self.max_model_len // ps) + 1)
        # At least one full-length request (+ the dummy page).
        need = -(-self.max_model_len // ps) + 1
        if pages < need:
            if self.device.type == "cuda":
                raise ValueError(f"not enough GPU memory for one {self.max_model_len}-token request's KV cache")
            pages = need
        return pages
