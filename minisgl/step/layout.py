"""How one step's indices reach the device: one int64 array, filled on the host, one copy.

A `StepLayout` fixes where each field sits in that array for given capacities: T token rows,
B request rows, C extend tiles, D decode-kernel rows. An eager step uses its own sizes; a
CUDA-graph step uses its bucket's capacities, so the graph captured on views of the static
buffer stays valid for every step that fits. Fields, in order (each padded to a multiple of
4 elements, so every view starts 32-byte aligned: Triton specializes on pointer alignment):

  int64 (used as is)             ids [T] (-1: the token buffer's), positions [T],
                                 tok_rows [T] (request-table row of each token), sample_rows [B]
  int32 (stored as int64, one    req_rows, prefix_lens, seq_lens [B], cu_seqlens_q [B+1],
  narrowing copy on the device)  tiles [C, 2], decode_rows, decode_seq_lens [D]

A decode step has no tile map, except in deterministic mode: there it has one tile per
request (C = B), and its attention runs the extend kernel like any extend.

Padding: tokens past the step's own (position 0 in the padding row: their K/V go to the dummy
slot, no tile covers them, no request samples them); requests past the step's (no tokens,
prefix 0, length 1, sample row 0); tiles (-1, 0), which exit at once; decode rows (the
padding row, length 1: one dummy key). In a mixed step the first D' requests are decodes
(one token each, input from the token buffer); with D > 0 they go through the decode kernel
and the tiles cover the rest, else they are one-row tiles like any extend.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from minisgl import ops
from minisgl.core.batch import ForwardBatch


def _seg(n: int) -> int:
    return -(-n // 4) * 4


@dataclass
class StepSpec:
    """One step on the host: request rows, cached prefix lengths, and each request's new
    token ids, or None for "one token, the last sampled" (decodes; in a mixed step they come
    first and are its `num_decodes`)."""

    mode: str  # "decode" | "extend" | "mixed"
    rows: list[int]
    prefix_lens: list[int]
    new_tokens: list[list[int] | None]
    # Logits at every new token (a speculative verify step, "extend" only): the layout's sample
    # rows are then the tokens 0..T-1, so it needs `requests` >= T (one logits row per token).
    all_rows: bool = False

    def __post_init__(self) -> None:
        self.ext = [1 if t is None else len(t) for t in self.new_tokens]
        lead = next((i for i, t in enumerate(self.new_tokens) if t is not None), len(self.new_tokens))
        self.num_decodes = len(self.rows) if self.mode == "decode" else lead
        self.num_tokens = sum(self.ext)

    @property
    def seq_lens(self) -> list[int]:
        return [p + e for p, e in zip(self.prefix_lens, self.ext)]

    def host_ids(self) -> np.ndarray:
        """int64 [num_tokens]: the new tokens' ids, -1 where the token buffer supplies one."""
        if all(t is None for t in self.new_tokens):
            return np.full(self.num_tokens, -1, dtype=np.int64)
        return np.concatenate([_MINUS_ONE if t is None else np.asarray(t, dtype=np.int64) for t in self.new_tokens])


_MINUS_ONE = np.full(1, -1, dtype=np.int64)


@dataclass(frozen=True)
class StepLayout:
    mode: str
    tokens: int  # T
    requests: int  # B
    tiles: int = 0  # C (0: no tile map; the torch backend and decode steps)
    decodes: int = 0  # D (0: no decode-kernel rows)
    verify: bool = False  # a verify graph's layout (its batch is a verify step: ForwardBatch.all_rows)

    @property
    def _i32_start(self) -> int:
        return 3 * _seg(self.tokens) + _seg(self.requests)

    @property
    def size(self) -> int:
        return self._i32_start + 4 * _seg(self.requests + 1) + _seg(2 * self.tiles) + 2 * _seg(self.decodes)

    def fits(self, spec: StepSpec, num_tiles: int) -> bool:
        """`num_tiles`: `count_tiles(spec, block_m, self.decodes > 0)`."""
        return (spec.num_tokens <= self.tokens and len(spec.rows) <= self.requests
                and (not spec.all_rows or spec.num_tokens <= self.requests)
                and (spec.num_decodes if self.decodes else 0) <= self.decodes and num_tiles <= self.tiles)

    def fill(self, out: np.ndarray, spec: StepSpec, pad_row: int, block_m: int) -> None:
        """Writes `spec` padded to this layout into out[:size] (int64)."""
        t, b, s = _seg(self.tokens), len(spec.rows), _seg(self.requests + 1)
        n, nd = spec.num_tokens, (spec.num_decodes if self.decodes else 0)
        if n > self.tokens or b > self.requests or nd > self.decodes or (spec.all_rows and n > self.requests):
            raise ValueError(f"a step of {n} tokens in {b} requests does not fit {self}")
        ext = np.asarray(spec.ext, dtype=np.int64)
        prefix = np.asarray(spec.prefix_lens, dtype=np.int64)
        cu = np.zeros(b + 1, dtype=np.int64)
        np.cumsum(ext, out=cu[1:])
        out[: self.size] = 0
        if n:
            out[:n] = spec.host_ids()
        out[t : t + n] = np.arange(n) - np.repeat(cu[:-1] - prefix, ext)  # positions
        tok_rows = out[2 * t : 3 * t]
        tok_rows[:n] = np.repeat(np.asarray(spec.rows, dtype=np.int64), ext)
        tok_rows[n : self.tokens] = pad_row
        o = 3 * t
        if spec.all_rows:
            out[o : o + n] = np.arange(n)  # every token's logits, in token order
        else:
            out[o : o + b] = cu[1:] - 1  # sample rows
        o = self._i32_start
        out[o : o + b] = spec.rows
        out[o + b : o + self.requests] = pad_row
        out[o + s : o + s + b] = prefix
        seq = out[o + 2 * s : o + 2 * s + self.requests]
        seq[:b] = prefix + ext
        seq[b:] = 1
        out[o + 3 * s : o + 3 * s + b + 1] = cu
        out[o + 3 * s + b + 1 : o + 3 * s + self.requests + 1] = n
        o += 4 * s
        if self.tiles:
            tile_ext = [0] * nd + spec.ext[nd:]
            out[o : o + 2 * self.tiles] = ops.extend_tile_map(spec.prefix_lens, tile_ext, block_m, self.tiles)
        o += _seg(2 * self.tiles)
        if self.decodes:
            dec = out[o : o + self.decodes]
            dec[:nd] = spec.rows[:nd]
            dec[nd:] = pad_row
            o += _seg(self.decodes)
            dseq = out[o : o + self.decodes]
            dseq[:nd] = prefix[:nd] + 1
            dseq[nd:] = 1

    def views(self, buf: torch.Tensor, req_to_slot: torch.Tensor, token_buffer: torch.Tensor,
              max_seq_len: int, req_to_swa_slot: torch.Tensor | None = None,
              req_to_state: torch.Tensor | None = None) -> ForwardBatch:
        """The ForwardBatch over `buf` (device int64, filled by `fill`): views, one int32
        narrowing copy, the out-slot gather and the token-buffer read. Graph-safe: no host
        values are read, so a graph captures these few kernels with the forward."""
        t, big = _seg(self.tokens), self.tokens
        ids, positions, tok_rows = buf[:big], buf[t : t + big], buf[2 * t : 2 * t + big]
        input_ids = torch.where(ids < 0, token_buffer[tok_rows], ids)
        i32 = buf[self._i32_start : self.size].to(torch.int32)
        b, s = self.requests, _seg(self.requests + 1)
        o = 4 * s
        tiles = i32[o : o + 2 * self.tiles].view(self.tiles, 2) if self.tiles else None
        o += _seg(2 * self.tiles)
        dec_rows = dec_seq = None
        if self.decodes:
            dec_rows = i32[o : o + self.decodes]
            dec_seq = i32[o + _seg(self.decodes) : o + _seg(self.decodes) + self.decodes]
        return ForwardBatch(
            mode=self.mode, input_ids=input_ids, positions=positions, out_slots=req_to_slot[tok_rows, positions],
            req_rows=i32[:b], seq_lens=i32[2 * s : 2 * s + b], prefix_lens=i32[s : s + b],
            cu_seqlens_q=i32[3 * s : 3 * s + b + 1], sample_rows=buf[3 * t : 3 * t + b], req_to_slot=req_to_slot,
            seq_lens_cpu=[], prefix_lens_cpu=[], max_seq_len=max_seq_len, max_extend_len=self.tokens,
            tiles=tiles, decode_rows=dec_rows, decode_seq_lens=dec_seq, req_to_swa_slot=req_to_swa_slot,
            out_slots_swa=None if req_to_swa_slot is None else req_to_swa_slot[tok_rows, positions],
            state_slots=None if req_to_state is None else req_to_state[i32[:b]], all_rows=self.verify,
        )


def count_tiles(spec: StepSpec, block_m: int, decode_kernel: bool) -> int:
    """Extend tiles of `spec`: every request's ceil(new / BLOCK_M), but a mixed step's decodes
    when they take the decode kernel."""
    d = spec.num_decodes if decode_kernel else 0
    return sum(-(-e // block_m) for e in spec.ext[d:])


def exact_layout(spec: StepSpec, block_m: int | None, decode_kernel: bool, decode_tiles: bool = False) -> StepLayout:
    """The layout of exactly this step (an eager forward). block_m None: no tile map (the
    torch backend). decode_kernel: a mixed step's decodes take the decode kernel.
    decode_tiles: a decode step carries a tile map too (one tile per request: deterministic
    mode runs decodes through the extend kernel)."""
    b = len(spec.rows)
    if block_m is None:
        return StepLayout(spec.mode, spec.num_tokens, b)
    if spec.mode == "decode":
        return StepLayout(spec.mode, spec.num_tokens, b, b if decode_tiles else 0)
    dk = decode_kernel and spec.mode == "mixed"
    return StepLayout(spec.mode, spec.num_tokens, b, count_tiles(spec, block_m, dk), spec.num_decodes * dk)
