"""A step's per-row sampling parameters on the device (SamplingTensors), and deterministic
mode's sampler. The sampling op and its torch reference are minisgl.ops.sampling."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from minisgl import ops
from minisgl.ops.transfer import host_to_device


@dataclass
class SamplingTensors:
    temperature: torch.Tensor  # f32 [B]; 0 = greedy
    top_k: torch.Tensor  # int32 [B]; <= 0 = off
    top_p: torch.Tensor  # f32 [B]
    min_p: torch.Tensor  # f32 [B]
    seeds: torch.Tensor  # int64 [B]
    steps: torch.Tensor  # int64 [B]: tokens the request has generated so far
    all_greedy: bool

    @staticmethod
    def build(
        temperature: list[float], top_k: list[int], top_p: list[float], min_p: list[float],
        seeds: list[int], steps: list[int], device: torch.device,
    ) -> SamplingTensors:
        # Two host-to-device copies (floats, integers) instead of six. Rows are padded to 16
        # bytes: Triton specializes on pointer alignment (no recompiles as the batch changes).
        b = len(temperature)
        pf, pi = [0.0] * (-b % 4), [0] * (-b % 2)
        # From pinned memory: a pageable copy may wait for the stream (no overlap).
        f = host_to_device([temperature + pf, top_p + pf, min_p + pf], torch.float32, device)
        i = host_to_device([top_k + pi, seeds + pi, steps + pi], torch.int64, device)
        return SamplingTensors(
            f[0, :b], i[0, :b].to(torch.int32), f[1, :b], f[2, :b], i[1, :b], i[2, :b],
            all_greedy=all(x == 0.0 for x in temperature),
        )


def sample_per_row(logits: torch.Tensor, st: SamplingTensors) -> tuple[torch.Tensor, torch.Tensor]:
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
