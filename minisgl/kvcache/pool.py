"""The paged KV pool and the request table.

Per layer, K and V are token-slot pools `[num_slots, kv_heads, head_dim]`. Slots are handed
out in pages of `page_size` consecutive slots; page 0 is reserved as the dummy page that
padded rows (CUDA-graph padding) write to, so slot 0 is never a real token's slot.

The request table `req_to_slot[row, position]` (int32) maps each request's token positions to
slots; kernels read K/V only through it. Row `max_requests` is a spare row for padding.
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
        # One allocation each for K and V: [layers, slots, heads, dim]; per-layer views below.
        shape = (num_layers, self.num_slots, kv_heads, head_dim)
        self._k = torch.empty(shape, dtype=dtype, device=device)
        self._v = torch.empty(shape, dtype=dtype, device=device)
        # Per-tensor scales of an FP8 cache (it holds K / k_scale, V / v_scale); 1.0 otherwise.
        self.k_scales = [1.0] * num_layers
        self.v_scales = [1.0] * num_layers

    def k_cache(self, layer: int) -> torch.Tensor:
        return self._k[layer]

    def v_cache(self, layer: int) -> torch.Tensor:
        return self._v[layer]

    @property
    def bytes_per_token(self) -> int:
        return 2 * self.num_layers * self.kv_heads * self.head_dim * self._k.element_size()

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

    def __init__(self, max_requests: int, max_context: int, device: torch.device) -> None:
        self.max_requests = max_requests
        self.max_context = max_context
        self.padding_row = max_requests
        # The padding row points at the dummy slot everywhere.
        self.req_to_slot = torch.zeros((max_requests + 1, max_context), dtype=torch.int32, device=device)
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
