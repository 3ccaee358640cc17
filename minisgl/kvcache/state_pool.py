"""The recurrent-state pool of a hybrid model's linear-attention layers (issue 34).

A Gated DeltaNet layer keeps no K/V per token: per running request it keeps a conv state (the
last K-1 inputs of its depthwise conv, `[K-1, conv_dim]` in the model's dtype) and a recurrent
state (fp32 `[Hv, d_k, d_v]`), both updated in place by every step. They live here, one slot per
running request, shared by every linear layer (the layer picks its own plane):

    conv   [L_lin, S, K-1, conv_dim]      state  [L_lin, S, Hv, d_k, d_v] fp32

The request table maps each row to its slot (`RequestTable.req_to_state`, int32, -1 for a free
row and the padding row), so a step gathers its slots on the device from its rows (graph-safe,
as req_to_swa_slot). A slot is taken at admission and given back when its request finishes, is
aborted or is retracted (a retracted request recomputes its state from its prompt on resume,
like its KV). A fresh slot is never cleared: the kernels start a sequence whose prefix is 0
from zeros without reading it (`has_state`).

Snapshot slots (`num_snapshots` more, after the running ones, with their own free list): the
state after some cached prefix, held by a radix node (kvcache/radix_snap.py). `copy` moves a
slot's conv and recurrent state to another on the current stream, so it falls between the step
that wrote the source and the step that reads the destination.
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_kernel: int, conv_dim: int, num_v_heads: int,
                 k_head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device,
                 num_snapshots: int = 0) -> None:
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least 1 slot, got {num_slots}")
        if num_snapshots < 0:
            raise ValueError(f"num_snapshots must be >= 0, got {num_snapshots}")
        self.num_layers, self.num_slots, self.num_snapshots = num_layers, num_slots, num_snapshots
        total = num_slots + num_snapshots
        self.conv = torch.empty((num_layers, total, conv_kernel - 1, conv_dim), dtype=dtype, device=device)
        self.state = torch.empty((num_layers, total, num_v_heads, k_head_dim, v_head_dim), dtype=torch.float32,
                                 device=device)
        # Pop from the end: low slots first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))
        self._snap_free: list[int] = list(range(total - 1, num_slots - 1, -1))
        self.verify_inputs: torch.Tensor | None = None  # reserve_verify (speculative decoding)

    @staticmethod
    def bytes_per_slot_for(num_layers: int, conv_kernel: int, conv_dim: int, num_v_heads: int, k_head_dim: int,
                           v_head_dim: int, dtype: torch.dtype) -> int:
        conv = (conv_kernel - 1) * conv_dim * torch.empty((), dtype=dtype).element_size()
        return num_layers * (conv + num_v_heads * k_head_dim * v_head_dim * 4)

    @property
    def bytes_per_slot(self) -> int:
        return (self.conv[0, 0].numel() * self.conv.element_size() + self.state[0, 0].numel() * 4) * self.num_layers

    @property
    def free_slots(self) -> int:
        return len(self._free)

    def free_slot_ids(self) -> list[int]:
        return list(self._free)

    def allocate(self) -> int:
        if not self._free:
            raise MemoryError("no free recurrent-state slot")
        return self._free.pop()

    def free(self, slot: int) -> None:
        self._free.append(slot)

    # ---- snapshots -----------------------------------------------------------------------

    @property
    def total_slots(self) -> int:
        return self.num_slots + self.num_snapshots

    @property
    def free_snapshots(self) -> int:
        return len(self._snap_free)

    def free_snapshot_ids(self) -> list[int]:
        return list(self._snap_free)

    def allocate_snapshot(self) -> int | None:
        return self._snap_free.pop() if self._snap_free else None

    def free_snapshot(self, slot: int) -> None:
        if not self.num_slots <= slot < self.total_slots:
            raise ValueError(f"slot {slot} is not a snapshot slot ([{self.num_slots}, {self.total_slots}))")
        self._snap_free.append(slot)

    # ---- speculative verify steps ---------------------------------------------------------

    def reserve_verify(self, tokens: int, width: int, dtype: torch.dtype) -> None:
        """Scratch for a verify step's Gated DeltaNet inputs: per layer, `width` values (the
        conv's input, b and a) of up to `tokens` tokens, so the accepted ones can advance the
        states after acceptance (`verify_inputs[layer, :T]`, in the step's token order)."""
        self.verify_inputs = torch.empty((self.num_layers, tokens, width), dtype=dtype, device=self.state.device)

    def copy(self, src: int, dst: int) -> None:
        """Slot `dst` := slot `src` (every layer's conv and recurrent state)."""
        self.conv[:, dst].copy_(self.conv[:, src])
        self.state[:, dst].copy_(self.state[:, src])


def state_pool_fit_error(arch: str, per_slot: int, running: int, snaps: int, snaps_default: bool,
                         budget: float) -> str | None:
    """Why a hybrid model's state pool of `running` + `snaps` slots of `per_slot` bytes does not
    fit half of `budget` (the memory left for the caches; the full layers' KV pool needs the
    rest), naming the flags and how many running requests fit; None when it fits. A slot is
    large (Qwen3.5-27B: 147 MiB), so the default 256 + 256 slots would not fit one GPU."""
    if per_slot * (running + snaps) <= budget / 2:
        return None
    slots = max(0, int(budget / 2 // per_slot))
    fit = slots // 2 if snaps_default else slots - snaps
    return (f"{arch}: the recurrent-state pool needs {per_slot * (running + snaps) / 2**30:.1f} GiB "
            f"({per_slot / 2**20:.1f} MiB a slot x ({running} running requests + {snaps} prefix-cache snapshots)), "
            f"over half of the {max(budget, 0) / 2**30:.1f} GiB left for the caches: lower --max-running-requests "
            f"(max_running_requests=; {f'{fit} fit' if fit > 0 else 'none fits'} with "
            f"{'as many' if snaps_default else snaps} snapshots) or --state-snapshots (state_snapshots=)")
