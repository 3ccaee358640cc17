"""Per-step grammar masks: fill the packed token bitmask of each constrained row on the host
(xgrammar), copy it to the device, and set the forbidden logits to -inf there before sampling.

Only constrained rows are filled, copied and masked (a compact [k, W] mask plus the k batch
rows), so unconstrained rows in the same batch pay nothing and a batch without grammars calls
none of this. Memory: W = ceil(vocab / 32) int32 words per row (19 KB at a 152k vocabulary);
host buffers (mask and row ids) are pinned on CUDA, so the copies are asynchronous: a copy from
pageable memory may wait for the stream, i.e. for the forward this mask overlaps.

Two host buffers and two device buffers alternate. The copy runs on a side stream: the host
fills while the forward runs, and a copy queued behind the forward on the compute stream would
add its time (~0.2 ms for 256 rows) to the step; on the side stream it runs beside the forward,
and the compute stream waits for it only before the mask. A host buffer is refilled only after
its last copy's event; a device buffer is overwritten only after the mask that last read it.
"""

from __future__ import annotations

import torch

from minisgl import ops
from minisgl.grammar.matcher import RowGrammar
from minisgl.grammar.threads import MatcherThreads


class GrammarMasks:
    def __init__(self, vocab_size: int, max_rows: int, device: torch.device, threads: MatcherThreads | None = None):
        self.vocab_size, self.max_rows, self.device = vocab_size, max_rows, device
        self.words = -(-vocab_size // 32)
        self.threads = threads or MatcherThreads()
        self._host: list[torch.Tensor] = []
        self._host_rows: list[torch.Tensor] = []
        self._copied: list[torch.cuda.Event | None] = [None, None]  # host buffer i's last copy
        self._applied: list[torch.cuda.Event | None] = [None, None]  # device buffer i's last reader
        self._next = 0
        self._device_mask: list[torch.Tensor] = []
        self._device_rows: list[torch.Tensor] = []
        self._stream: torch.cuda.Stream | None = None

    def _buffers(self) -> None:
        pin = self.device.type == "cuda"
        self._host = [torch.empty(self.max_rows, self.words, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        self._host_rows = [torch.empty(self.max_rows, dtype=torch.int32, pin_memory=pin) for _ in range(2)]
        if self.device.type == "cuda":
            self._device_mask = [torch.empty(self.max_rows, self.words, dtype=torch.int32, device=self.device)
                                 for _ in range(2)]
            self._device_rows = [torch.empty(self.max_rows, dtype=torch.int32, device=self.device) for _ in range(2)]
            self._stream = torch.cuda.Stream(self.device)

    def fill(self, grammars: list[RowGrammar]) -> tuple[torch.Tensor, int]:
        """(host int32 [k, W] whose row j is the mask of grammars[j]'s next token, buffer index)."""
        if not self._host:
            self._buffers()
        i = self._next
        self._next ^= 1
        if self._copied[i] is not None:
            self._copied[i].synchronize()  # its previous copy to the device has been read
        host = self._host[i][: len(grammars)]
        self.threads.fill(grammars, host)
        return host, i

    def apply(
        self, logits: torch.Tensor, rows: list[int], grammars: list[RowGrammar], with_lse: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Masks logits [B, V] (fp32, on the device, in place) at batch rows `rows`. Returns the
        rows as an int64 [k] tensor on the device (a tensor of its own: the buffers are reused)
        and, with `with_lse`, their log-normalizers before the mask (f32 [k]; see
        ops.apply_token_bitmask)."""
        if len(rows) > self.max_rows:
            raise ValueError(f"{len(rows)} constrained rows exceed the {self.max_rows} the masks hold")
        host, buf = self.fill(grammars)
        k = len(rows)
        rows_host = self._host_rows[buf][:k]
        rows_host.copy_(torch.tensor(rows, dtype=torch.int32))
        if self.device.type != "cuda":
            return rows_host.long(), ops.apply_token_bitmask(logits, host, rows_host, with_lse)
        assert self._stream is not None
        dev, dev_rows = self._device_mask[buf][:k], self._device_rows[buf][:k]
        compute = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self._stream):
            if self._applied[buf] is not None:
                self._stream.wait_event(self._applied[buf])
            dev.copy_(host, non_blocking=True)
            dev_rows.copy_(rows_host, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record(self._stream)
        self._copied[buf] = copied
        compute.wait_event(copied)
        lse = ops.apply_token_bitmask(logits, dev, dev_rows, with_lse)
        rows_long = dev_rows.long()
        applied = torch.cuda.Event()
        applied.record(compute)
        self._applied[buf] = applied
        return rows_long, lse
