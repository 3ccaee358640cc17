"""What one forward step needs, prepared once per step and passed down explicitly.

Layers and attention backends read only this object (never globals). Every tensor lives
on the engine's device; the `*_cpu` lists are host copies for code that loops on the host.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class ForwardBatch:
    # "extend": each request brings `extend_lens[i]` new tokens after `prefix_lens[i]` cached
    # ones (plain prefill, chunked prefill and prefix-cache hits alike).
    # "decode": each request brings exactly one new token.
    # "mixed": an extend step whose first requests are decodes (one token each).
    mode: str
    input_ids: torch.Tensor  # int64 [T] new tokens, requests concatenated
    positions: torch.Tensor  # int64 [T] position of each new token in its request
    out_slots: torch.Tensor  # int32 [T] KV slot each new token's K/V is stored to
    req_rows: torch.Tensor  # int32 [B] row of each request in req_to_slot
    seq_lens: torch.Tensor  # int32 [B] tokens in each request after this step (prefix + new)
    prefix_lens: torch.Tensor  # int32 [B] tokens already cached before this step
    cu_seqlens_q: torch.Tensor  # int32 [B+1] offsets of each request's new tokens in [T]
    sample_rows: torch.Tensor  # int64 [B] index in [T] of each request's last new token
    req_to_slot: torch.Tensor  # int32 [R, max_context] the request table (shared, not copied)
    seq_lens_cpu: list[int]
    prefix_lens_cpu: list[int]
    max_seq_len: int  # max of seq_lens (host); an upper bound under CUDA graphs
    max_extend_len: int  # max new tokens of one request (host); 1 for decode
    attn_metadata: Any = field(default=None)  # built by the attention backend's prepare()
    # Extend attention's tile map, int32 [C, 2] (request, first query row), unused rows (-1, 0):
    # the launch that depends on no host value (CUDA graphs; engine-built batches always).
    tiles: torch.Tensor | None = None
    # A mixed step's decodes through the decode kernel: table rows and lengths int32 [D]
    # (padded: the padding row, length 1). They are the first D token rows of the step.
    decode_rows: torch.Tensor | None = None
    decode_seq_lens: torch.Tensor | None = None
    graph: Any = field(default=None)  # the captured graph's key when this step replays one
    # int64 [B + E] rows of [T] whose logits the model computes: sample_rows, then E extra rows
    # (prompt logprobs). None: sample_rows only.
    logit_rows: torch.Tensor | None = None
    # A speculative verify step (logits at every new token): a captured graph's replay yields
    # them all [T, vocab], an eager batch's forward(all_positions=True). Layers that keep a state
    # per request (Gated DeltaNet) read it and write none; the engine advances it over the
    # accepted tokens after acceptance (the drafts past the first rejection never reach it).
    all_rows: bool = False
    # The sliding-window pool group (None without one): its request table (shared, not
    # copied) and each new token's slot in it, int32 [T] (gathered on the device like out_slots).
    req_to_swa_slot: torch.Tensor | None = None
    out_slots_swa: torch.Tensor | None = None
    # A hybrid model's recurrent-state slot of each request, int32 [B] (gathered on the device
    # from the request table's req_to_state by req_rows; -1 for padding requests). None without.
    state_slots: torch.Tensor | None = None

    @property
    def is_decode(self) -> bool:
        return self.mode == "decode"

    @property
    def batch_size(self) -> int:
        return len(self.seq_lens_cpu)

    @property
    def num_tokens(self) -> int:
        return self.input_ids.numel()
