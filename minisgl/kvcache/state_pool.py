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
from zeros without reading it (`has_state`). Snapshots for prefix-cache resumes are the next
step: they will be more slots of this pool, held by radix nodes.
"""

from __future__ import annotations

import torch


class StatePool:
    def __init__(self, num_layers: int, num_slots: int, conv_kernel: int, conv_dim: int, num_v_heads: int,
                 k_head_dim: int, v_head_dim: int, dtype: torch.dtype, device: torch.device) -> None:
        if num_slots < 1:
            raise ValueError(f"the state pool needs at least 1 slot, got {num_slots}")
        self.num_layers, self.num_slots = num_layers, num_slots
        self.conv = torch.empty((num_layers, num_slots, conv_kernel - 1, conv_dim), dtype=dtype, device=device)
        self.state = torch.empty((num_layers, num_slots, num_v_heads, k_head_dim, v_head_dim), dtype=torch.float32,
                                 device=device)
        # Pop from the end: low slots first.
        self._free: list[int] = list(range(num_slots - 1, -1, -1))

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
