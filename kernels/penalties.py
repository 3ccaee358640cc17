"""Penalties, logit bias and banned tokens applied in place to selected rows of a logits batch
(Triton), beside the torch reference.

Program (i, c) handles selected row i (logits row rows[i], state row state_rows[i]) over the
vocabulary chunk [c * CHUNK, (c + 1) * CHUNK), so a batch with few penalized rows still
spreads over the GPU; CHUNK >= V is one program per row.
  dense part (only when the row has a penalty: rep != 1, pres != 0 or freq != 0), in steps
  of BLOCK, with c = counts[state_row, t] (tokens generated so far) and seen_prompt =
  prompt[state_row, t] != 0:
      hit = c > 0 or seen_prompt   (only when rep != 1; the prompt buffer is not read otherwise)
      x = hit ? (x > 0 ? x / rep : x * rep) : x
      x = x - freq * c - pres * (c > 0)
    stored only where it changed (rows mostly keep their values: little write traffic);
  sparse part, after a barrier (the dense stores of other threads must be visible): for the
  row's entries j in [ptr[i], ptr[i + 1]) whose id falls in this chunk, x[ids[j]] += vals[j]
  (a -inf value bans the token). Each program scans the row's whole (short) list.
Invariants the caller guarantees (checked on the host where the lists are built, never here:
a check would need a device sync): every id < V and no id twice within a row (two lanes
updating one element would race), state rows < counts.shape[0].

No allocation, no host sync: the op can be captured in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _penalty_kernel(
    Logits, stride_l, V, Rows, StateRows, Counts, stride_c, Prompt, stride_p, Rep, Pres, Freq,
    BiasPtr, BiasIds, BiasVals, CHUNK: tl.constexpr, BLOCK: tl.constexpr, BIAS_BLOCK: tl.constexpr,
):
    i = tl.program_id(0)
    c0 = tl.program_id(1) * CHUNK
    c1 = tl.minimum(c0 + CHUNK, V)
    row = Logits + tl.load(Rows + i).to(tl.int64) * stride_l
    s = tl.load(StateRows + i).to(tl.int64)
    rep = tl.load(Rep + i)
    pres = tl.load(Pres + i)
    freq = tl.load(Freq + i)
    if (rep != 1.0) | (pres != 0.0) | (freq != 0.0):
        lane = tl.arange(0, BLOCK)
        use_rep = tl.full([BLOCK], 1.0, tl.float32) * rep != 1.0  # lane vector: masks take vectors
        for start in range(c0, c1, BLOCK):
            idx = start + lane
            inb = idx < c1
            x = tl.load(row + idx, mask=inb, other=0.0).to(tl.float32)
            c = tl.load(Counts + s * stride_c + idx, mask=inb, other=0)
            p = tl.load(Prompt + s * stride_p + idx, mask=inb & use_rep, other=0)
            seen = c > 0
            hit = (seen | (p != 0)) & use_rep
            x = tl.where(hit, tl.where(x > 0, x / rep, x * rep), x)
            x = x - freq * c.to(tl.float32) - pres * seen.to(tl.float32)
            tl.store(row + idx, x.to(Logits.dtype.element_ty), mask=inb & (hit | seen))
    tl.debug_barrier()
    b0 = tl.load(BiasPtr + i)
    b1 = tl.load(BiasPtr + i + 1)
    jb = tl.arange(0, BIAS_BLOCK)
    for start in range(b0, b1, BIAS_BLOCK):
        j = start + jb
        ok = j < b1
        tok = tl.load(BiasIds + j, mask=ok, other=-1)
        mine = ok & (tok >= c0) & (tok < c1)
        val = tl.load(BiasVals + j, mask=mine, other=0.0)
        ptr = row + tok.to(tl.int64)
        x = tl.load(ptr, mask=mine, other=0.0).to(tl.float32)
        tl.store(ptr, (x + val).to(Logits.dtype.element_ty), mask=mine)


def default_config(device: torch.device) -> dict[str, int]:
    """CHUNK vocabulary entries per program, BLOCK per step. On the CPU (interpreter tests):
    small, so that small vocabularies still take several chunks and several steps per chunk.
    GPU: benchmarks/kernels/penalties.py measures the candidates."""
    if device.type != "cuda":
        return {"CHUNK": 128, "BLOCK": 32, "num_warps": 4}
    return {"CHUNK": 16384, "BLOCK": 2048, "num_warps": 8}


def apply_penalties(
    logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, counts: torch.Tensor,
    prompt: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor,
    bias_ptr: torch.Tensor, bias_ids: torch.Tensor, bias_vals: torch.Tensor, config: dict[str, int] | None = None,
) -> None:
    """In place. logits [B, V] (fp32/fp16/bf16, last dim packed); rows, state_rows int32 [n];
    counts int32 [R, V] and prompt uint8 [R, V] (last dims packed; any [.., V]-shaped tensors
    when no row reads them); rep, pres, freq f32 [n]; bias_ptr int32 [n + 1] (bias_ptr[0] = 0);
    bias_ids int32 and bias_vals f32 [>= nnz]. `config`: CHUNK (a multiple of BLOCK), BLOCK,
    num_warps (default_config)."""
    n, v = rows.numel(), logits.shape[1]
    if n == 0:
        return
    cfg = {**default_config(logits.device), **(config or {})}
    chunk, block = cfg["CHUNK"], min(cfg["BLOCK"], cfg["CHUNK"])
    if chunk % block:
        raise ValueError(f"config: CHUNK {chunk} must be a multiple of BLOCK {block}")
    _penalty_kernel[(n, triton.cdiv(v, chunk))](
        logits, logits.stride(0), v, rows, state_rows, counts, counts.stride(0), prompt, prompt.stride(0),
        rep, pres, freq, bias_ptr, bias_ids, bias_vals,
        CHUNK=chunk, BLOCK=block, BIAS_BLOCK=64, num_warps=cfg["num_warps"],
    )


def apply_penalties_reference(
    logits: torch.Tensor, rows: torch.Tensor, state_rows: torch.Tensor, counts: torch.Tensor,
    prompt: torch.Tensor, rep: torch.Tensor, pres: torch.Tensor, freq: torch.Tensor,
    bias_ptr: torch.Tensor, bias_ids: torch.Tensor, bias_vals: torch.Tensor,
) -> None:
    """The same math in torch (fp32), in place: the dense part batched over the selected rows,
    the bias as one scatter-add (ids are unique per row, so index_put_ accumulates nothing)."""
    if rows.numel() == 0:
        return
    r, s = rows.long(), state_rows.long()
    x = logits[r].float()
    dense = (rep != 1.0) | (pres != 0.0) | (freq != 0.0)
    if bool(dense.any()):
        c = counts[s].float()
        seen = c > 0
        use_rep = rep != 1.0
        hit = (seen | (prompt[s] != 0)) if bool(use_rep.any()) else seen
        hit = hit & use_rep[:, None]
        penalized = torch.where(x > 0, x / rep[:, None], x * rep[:, None])
        x = torch.where(hit, penalized, x) - freq[:, None] * c - pres[:, None] * seen.float()
        x = torch.where(dense[:, None], x, logits[r].float())
    nnz = torch.diff(bias_ptr.long())
    total = int(nnz.sum())
    if total > 0:
        owner = torch.repeat_interleave(torch.arange(len(r), device=x.device), nnz)
        x.index_put_((owner, bias_ids[:total].long()), bias_vals[:total].float(), accumulate=True)
    logits[r] = x.to(logits.dtype)
