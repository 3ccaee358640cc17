"""Per-step grammar masks: fill the packed token bitmask of each constrained row on the host
(xgrammar), copy it to the device, and set the forbidden logits to -inf there before sampling.

Only constrained rows are filled, copied and masked (a compact [k, W] mask plus the k batch
rows), so unconstrained rows in the same batch pay nothing and a batch without grammars calls
none of this. Memory: W = ceil(vocab / 32) int32 words per row (19 KB at a 152k vocabulary);
host buffers are pinned on CUDA, so the copy is asynchronous.

Two host buffers alternate: with overlap scheduling the copy of step N's mask may still be
queued when step N+1 fills its own, so a buffer is reused only after its last copy's event.
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.grammar.matcher import RowGrammar

BATCH_FILL_MIN_ROWS = 8  # from this many rows, xgrammar's threaded batch fill beats a loop


class GrammarMasks:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device) -> None:
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        self.words = -(-vocab_size // 32)
        self._host: list[torch.Tensor] = []
        self._events: list[torch.cuda.Event | None] = [None, None]
        self._next = 0
        self._device_mask: torch.Tensor | None = None
        self._batch_filler = None

    def _buffers(self) -> None:
        pin = self.device.type == "cuda"
        self._host = [torch.empty(self.max_rows, self.words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        if self.device.type != "cpu":
            self._device_mask = torch.empty(self.max_rows, self.words, dtype=torch.int32, device=self.device)

    def fill(self, grammars: list[RowGrammar]) -> tuple[torch.Tensor, int]:
        """(host int32 [k, W] whose row j is the mask of grammars[j]'s next token, buffer index)."""
        if not self._host:
            self._buffers()
        i = self._next
        self._next ^= 1
        if self._events[i] is not None:
            self._events[i].synchronize()  # its previous copy to the device has been read
        host = self._host[i][: len(grammars)]
        if len(grammars) >= BATCH_FILL_MIN_ROWS:
            import xgrammar as xgr

            if self._batch_filler is None:
                self._batch_filler = xgr.BatchGrammarMatcher()
            self._batch_filler.batch_fill_next_token_bitmask([g.matcher for g in grammars], host)
        else:
            for j, g in enumerate(grammars):
                g.fill(host, j)
        return host, i

    def apply(self, logits: torch.Tensor, rows: list[int], grammars: list[RowGrammar]) -> None:
        """Masks logits [B, V] (fp32, on the device, in place) at batch rows `rows`."""
        if len(rows) > self.max_rows:
            raise ValueError(f"{len(rows)} constrained rows exceed the {self.max_rows} the masks hold")
        host, buf = self.fill(grammars)
        rows_t = torch.tensor(rows, dtype=torch.int32)
        if self.device.type == "cpu":
            ops.apply_token_bitmask(logits, host, rows_t)
            return
        assert self._device_mask is not None
        dev = self._device_mask[: len(rows)]
        dev.copy_(host, non_blocking=True)
        event = torch.cuda.Event()
        event.record()
        self._events[buf] = event
        ops.apply_token_bitmask(logits, dev, rows_t.to(self.device, non_blocking=True))
