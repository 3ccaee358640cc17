"""The paged KV pool and the request table.

Per layer, K and V are token-slot pools `[num_slots, kv_heads, head_dim]`. Slots are handed
out in pages of `page_size` consecutive slots; page 0 is reserved as the dummy page that
padded rows (CUDA-graph padding) write to, so slot 0 is never a real token's slot.

The request table `req_to_slot[row, position]` (int32) maps each request's token positions to
slots; kernels read K/V only through it. Row `max_requests` is a spare row for padding.

Two pool groups (`swa_pages > 0`, a model with sliding-window layers of W < the context): the
full layers' K/V in `num_slots` slots through `req_to_slot`, the sliding layers' in their own
`swa_slots` slots through `req_to_swa_slot` (same rows; positions out of the window hold the
dummy slot 0). Each group has its own PageAllocator; `k_cache(layer)` picks the group.

Layers filling from the host (`load_chunks`, set by the host KV tier on CUDA): a prefix's KV
loaded back from host memory lands chunk of layers by chunk of layers on the tier's copy stream,
each chunk followed by a record of its event. A step that may read such pages (every extend and
mixed step) calls `wait_loaded(layer)` before its attention reads layer `layer`: at a chunk's
first layer the compute stream waits for that chunk's event, so layer i's attention starts once
layer i's pages arrived and the layers before it run meanwhile. The events are external
(torch.cuda.Event(external=True), torch >= 2.8): inside a captured CUDA graph the wait is an
event-wait node that waits, at each replay, for the event's latest record before the replay was
launched (a load issued after the capture; a load issued while the replay is queued or running
is not waited for: no deadlock against a copy that itself waits for that replay). A completed
record makes it a no-op. torch creates a CUDA event at its first record and drops a wait on one
not created yet, a wait being captured too: `enable_load_waits` records each event once.
"""

from __future__ import annotations

import torch

DUMMY_SLOT = 0


class KVPool:
    def __init__(
        self,
        num_layers: int,
        num_pages: int,
        page_size: int,
        kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device,
        windows: tuple[int, ...] = (),
        swa_pages: int = 0,
    ) -> None:
        if num_pages < 2:
            raise ValueError(f"the KV pool needs at least 2 pages (1 is the dummy page), got {num_pages}")
        self.num_layers = num_layers
        self.page_size = page_size
        self.num_pages = num_pages
        self.num_slots = num_pages * page_size
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = device
        # Sliding layers get their own group only with swa_pages (>= 2: 1 is the dummy page).
        if swa_pages and swa_pages < 2:
            raise ValueError(f"the sliding-window KV pool needs at least 2 pages, got {swa_pages}")
        sliding = [i for i in range(num_layers) if swa_pages and windows and windows[i] > 0]
        self.swa_pages = swa_pages if sliding else 0
        self.swa_slots = self.swa_pages * page_size
        # layer -> (group, index in the group): group 0 full, 1 sliding.
        self._where: list[tuple[int, int]] = []
        counts = [0, 0]
        for i in range(num_layers):
            g = 1 if i in sliding else 0
            self._where.append((g, counts[g]))
            counts[g] += 1
        self.num_full_layers, self.num_swa_layers = counts
        # One allocation each for K and V per group: [layers, slots, heads, dim]; views below.
        shape = (counts[0], self.num_slots, kv_heads, head_dim)
        self._k = torch.empty(shape, dtype=dtype, device=device)
        self._v = torch.empty(shape, dtype=dtype, device=device)
        swa_shape = (counts[1], self.swa_slots, kv_heads, head_dim)
        self._k_swa = torch.empty(swa_shape, dtype=dtype, device=device)
        self._v_swa = torch.empty(swa_shape, dtype=dtype, device=device)
        # Per-tensor scales of an FP8 cache (it holds K / k_scale, V / v_scale); 1.0 otherwise.
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers
        # Host-tier loads: [(first layer, last layer + 1, event)] per chunk (module docstring).
        self.load_chunks: list[tuple[int, int, torch.cuda.Event]] = []
        self._wait_at: dict[int, torch.cuda.Event] = {}

    def enable_load_waits(self, chunks: int) -> list[tuple[int, int, torch.cuda.Event]]:
        """Splits the full group's layers into up to `chunks` chunks, each with an external
        event that host-tier loads record after copying it (CUDA pools only; before any CUDA
        graph is captured, so the graphs hold the waits)."""
        if self.device.type != "cuda":
            raise ValueError("per-layer load waits are for a CUDA pool (CPU copies are synchronous)")
        if self.num_swa_layers:
            raise ValueError("per-layer load waits cover one full-attention pool group only")
        try:
            torch.cuda.Event(external=True)
        except TypeError as e:  # torch < 2.8
            raise ValueError(f"the host KV tier on a GPU needs torch >= 2.8 (torch.cuda.Event(external=True), for "
                             f"waits inside CUDA graphs), found torch {torch.__version__}: upgrade torch or run "
                             "without --host-kv-cache-gb") from e
        n = self.num_full_layers
        bounds = sorted({round(i * n / chunks) for i in range(chunks + 1)})
        self.load_chunks = [(a, b, torch.cuda.Event(external=True)) for a, b in zip(bounds, bounds[1:])]
        for _, _, ev in self.load_chunks:  # created now, so that every captured wait exists (docstring)
            ev.record(torch.cuda.current_stream(self.device))
        self._wait_at = {a: ev for a, _, ev in self.load_chunks}
        return self.load_chunks

    def wait_loaded(self, layer: int) -> None:
        """Before attention reads layer `layer` in a step that may read pages a host-tier load
        fills: at a chunk's first layer, the compute stream waits for the chunk's copy."""
        group, index = self._where[layer]
        ev = self._wait_at.get(index) if group == 0 else None
        if ev is not None:
            torch.cuda.current_stream(self.device).wait_event(ev)

    def is_swa_layer(self, layer: int) -> bool:
        """Layer `layer`'s K/V live in the sliding-window group (slots of `req_to_swa_slot`)."""
        return self._where[layer][0] == 1

    def k_cache(self, layer: int) -> torch.Tensor:
        g, i = self._where[layer]
        return self._k_swa[i] if g else self._k[i]

    def v_cache(self, layer: int) -> torch.Tensor:
        g, i = self._where[layer]
        return self._v_swa[i] if g else self._v[i]

    @property
    def bytes_per_token(self) -> int:
        """Bytes per token slot of the full group (every layer without a sliding group)."""
        return 2 * self.num_full_layers * self.kv_heads * self.head_dim * self._k.element_size()

    @property
    def swa_bytes_per_token(self) -> int:
        """Bytes per token slot of the sliding group (0 without one)."""
        return 2 * self.num_swa_layers * self.kv_heads * self.head_dim * self._k.element_size()

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_token * self.num_slots + self.swa_bytes_per_token * self.swa_slots

    def describe_groups(self, window: int) -> str:
        """The split of the two groups, for the startup log."""
        gib, ps = 1 << 30, self.page_size
        return (f"{self.num_full_layers} full-attention layers x {self.num_slots - ps} tokens "
                f"({self.bytes_per_token * self.num_slots / gib:.2f} GiB), {self.num_swa_layers} sliding layers "
                f"(window {window}) x {self.swa_slots - ps} tokens "
                f"({self.swa_bytes_per_token * self.swa_slots / gib:.2f} GiB)")

    @staticmethod
    def bytes_per_token_for(num_layers: int, kv_heads: int, head_dim: int, dtype: torch.dtype) -> int:
        return 2 * num_layers * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class PageAllocator:
    """Free list of pages 1..num_pages-1 (page 0 is the dummy page). Host-side only."""

    def __init__(self, num_pages: int, page_size: int) -> None:
        self.page_size = page_size
        self.total_pages = num_pages - 1
        # Pop from the end: low pages first, so small runs touch little memory.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    @property
    def free_slots(self) -> int:
        return len(self._free) * self.page_size

    def free_page_ids(self) -> list[int]:
        """The free pages (for accounting checks)."""
        return list(self._free)

    def can_allocate(self, num_pages: int) -> bool:
        return num_pages <= len(self._free)

    def allocate(self, num_pages: int) -> list[int]:
        if num_pages > len(self._free):
            raise MemoryError(f"asked for {num_pages} KV pages, {len(self._free)} free")
        if num_pages == 0:
            return []
        pages = self._free[-num_pages:]
        del self._free[-num_pages:]
        pages.reverse()
        return pages

    def free(self, pages: list[int]) -> None:
        self._free.extend(reversed(pages))

    def slot_ids(self, pages: list[int]) -> list[int]:
        """Slot ids of whole pages, in order (host list)."""
        ps = self.page_size
        return [p * ps + i for p in pages for i in range(ps)] if ps > 1 else list(pages)


class RequestTable:
    """`req_to_slot` [max_requests + 1, max_context] int32 on the device, plus free rows."""

    def __init__(self, max_requests: int, max_context: int, device: torch.device, swa: bool = False,
                 states: bool = False) -> None:
        self.max_requests = max_requests
        self.max_context = max_context
        self.padding_row = max_requests
        # The padding row points at the dummy slot everywhere.
        self.req_to_slot = torch.zeros((max_requests + 1, max_context), dtype=torch.int32, device=device)
        # The sliding-window group's table (same rows), only with a sliding pool.
        self.req_to_swa_slot = (torch.zeros_like(self.req_to_slot) if swa else None)
        # A hybrid model's recurrent-state slot per row (kvcache/state_pool.py); -1: none (the
        # padding row always).
        self.req_to_state = torch.full((max_requests + 1,), -1, dtype=torch.int32, device=device) if states else None
        self._free_rows = list(range(max_requests - 1, -1, -1))

    @property
    def free_rows(self) -> int:
        return len(self._free_rows)

    def allocate_row(self) -> int:
        if not self._free_rows:
            raise MemoryError("no free request-table row")
        return self._free_rows.pop()

    def free_row(self, row: int) -> None:
        self._free_rows.append(row)


# The largest step's new tokens that the default sliding-pool size allows for (the scheduler's
# default prefill budget, max_prefill_tokens): a step's new tokens need sliding slots too.
DEFAULT_STEP_TOKENS = 8192


def swa_tokens_needed(max_requests: int, window: int, page_size: int, step_tokens: int = DEFAULT_STEP_TOKENS) -> int:
    """Sliding slots for every running request at a full window (W tokens, plus a partial
    page at each end) and one step's new tokens: what the default sliding pool aims for."""
    return max_requests * (window + 2 * page_size) + step_tokens


def split_kv_budget(budget: float, full_bpt: int, swa_bpt: int, page_size: int, ratio: float | None,
                    swa_need: int) -> tuple[int, int]:
    """(full pages, sliding pages), each with its dummy page, for `budget` bytes of KV.

    ratio: sliding tokens = ratio x full tokens (--swa-full-tokens-ratio). None: the sliding
    pool holds `swa_need` tokens (swa_tokens_needed) but at most half the budget, the full
    pool the rest."""
    if ratio is not None:
        if ratio <= 0:
            raise ValueError(f"--swa-full-tokens-ratio must be > 0, got {ratio}")
        full = budget / (full_bpt + ratio * swa_bpt)
        swa = ratio * full
    else:
        swa = min(swa_need, budget / 2 / swa_bpt) if swa_bpt else swa_need
        full = (budget - swa * swa_bpt) / full_bpt if full_bpt else float("inf")
    full_pages = int(full // page_size) + 1 if full != float("inf") else 1 << 40
    return full_pages, int(swa // page_size) + 1
