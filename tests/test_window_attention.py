"""Sliding windows and attention sinks in the attention kernels (issue 33): the Triton extend
kernel (plain and tile-map launches), the Triton split decode kernel and a mixed step's decode
rows, against the references under FA3's rule. The slots of positions no query of the step can
see (older than the first new token's window) are NaN and pointed at the dummy slot, as a
window-sized pool leaves them; windows end mid-page; W = 1 and W past the context."""

from __future__ import annotations

import attention_rule
import pytest
import torch
from test_extend_attention import make_case

from minisgl import env, ops
from minisgl.attention.torch_backend import attend_reference
from minisgl.kernels import decode_attention as D
from minisgl.kernels import extend_attention as K

pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)


def forget_old_slots(c: dict, window: int) -> None:
    """NaN in every slot no query of the step sees, and the table's entries of positions older
    than each request's first window pointed at the (NaN) dummy slot 0."""
    seen = torch.zeros(c["k_cache"].shape[0], dtype=torch.bool, device=c["k_cache"].device)
    for row, p, s in zip(c["req_rows"].tolist(), c["prefix_lens"].tolist(), c["seq_lens"].tolist()):
        first = max(0, p - window + 1)
        seen[c["req_to_slot"][row, first:s].long()] = True
        c["req_to_slot"][row, :first] = 0
    seen[0] = False
    c["k_cache"][~seen] = float("nan")
    c["v_cache"][~seen] = float("nan")


def sinks_for(hq: int, seed: int) -> torch.Tensor:
    return (torch.randn(hq, generator=torch.Generator().manual_seed(seed)) * 2).to(DEV)


def check_against_torch_reference(out: torch.Tensor, c: dict, window: int, sinks: torch.Tensor | None) -> None:
    """attend_reference (the torch backend's math, fp32) per request: an independent check of
    the kernels' reference too."""
    cu = c["cu_seqlens_q"].tolist()
    for i, (row, p, s) in enumerate(zip(c["req_rows"].tolist(), c["prefix_lens"].tolist(), c["seq_lens"].tolist())):
        first = max(0, p - window + 1) if window else 0
        slots = c["req_to_slot"][row, first:s].long()
        ref = attend_reference(c["q"][cu[i]:cu[i + 1]], c["k_cache"][slots], c["v_cache"][slots],
                               torch.arange(p, s, device=DEV), c["scale"], window, sinks, first)
        torch.testing.assert_close(out[cu[i]:cu[i + 1]].float(), ref, rtol=2e-2, atol=2e-2)


CASES = [  # (prefix_lens, extend_lens, window)
    ([0], [70], 16),  # a prefill several windows long
    ([40], [1], 16),  # a decode-like extend past the window
    ([0, 23, 100, 5], [19, 7, 33, 1], 13),  # windows ending mid-page (page 16)
    ([3, 0], [9, 40], 200),  # W past the context: full attention
    ([10], [20], 1),  # W = 1: each token sees itself alone
]


@needs_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("tiled", [False, True])
def test_extend_window_and_sinks(case, page_size: int, with_sinks: bool, tiled: bool) -> None:
    prefix, ext, window = case
    c = make_case(prefix, ext, hq=4, hkv=2, d=64, dtype=torch.float16, page_size=page_size, seed=sum(ext) + window)
    forget_old_slots(c, window)
    sinks = sinks_for(4, window) if with_sinks else None
    args = (c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"], c["req_rows"], c["prefix_lens"], c["seq_lens"],
            c["cu_seqlens_q"], c["max_extend_len"], c["scale"])
    tiles = None
    if tiled:
        block_m = ops.extend_block_m(64, torch.float16, torch.device(DEV))
        flat = ops.extend_tile_map(prefix, ext, block_m)
        tiles = torch.tensor(flat, dtype=torch.int32, device=DEV).reshape(-1, 2)
    out = ops.extend_attention(*args, tiles=tiles, window=window, sinks=sinks)
    ref_args = (c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"], c["req_rows"], c["prefix_lens"],
                c["cu_seqlens_q"], c["scale"])

    def reference(*a: object, compute_dtype: torch.dtype) -> torch.Tensor:
        return K.extend_attention_reference(*a, compute_dtype=compute_dtype, window=window, sinks=sinks)

    attention_rule.assert_fa3_rule(out, reference, *ref_args)
    check_against_torch_reference(out, c, window, sinks)


@needs_triton
@pytest.mark.parametrize("seq,window", [([1, 17, 64, 100], 16), ([5, 300], 50), ([33], 1), ([20, 9], 64),
                                        ([5, 300], 200)])  # the last: two splits and a merge
@pytest.mark.parametrize("with_sinks", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_decode_window_and_sinks(seq: list[int], window: int, with_sinks: bool, page_size: int) -> None:
    prefix = [s - 1 for s in seq]
    c = make_case(prefix, [1] * len(seq), hq=8, hkv=2, d=64, dtype=torch.float16, page_size=page_size,
                  seed=sum(seq))
    forget_old_slots(c, window)
    sinks = sinks_for(8, len(seq)) if with_sinks else None
    out = ops.decode_attention_triton(c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"], c["req_rows"],
                                      c["seq_lens"], max(seq), c["scale"], window=window, sinks=sinks)

    def reference(*a: object, compute_dtype: torch.dtype) -> torch.Tensor:
        return D.decode_attention_reference(*a, compute_dtype=compute_dtype, window=window, sinks=sinks)

    attention_rule.assert_fa3_rule(out, reference, c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"],
                                   c["req_rows"], c["seq_lens"], c["scale"])
    check_against_torch_reference(out, c, window, sinks)


def test_bad_window_and_sinks_are_named() -> None:
    c = make_case([3], [2], hq=4, hkv=2, d=16, dtype=torch.float32, page_size=1, seed=0)
    args = (c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"], c["req_rows"], c["prefix_lens"], c["seq_lens"],
            c["cu_seqlens_q"], c["max_extend_len"], c["scale"])
    with pytest.raises(ValueError, match="window"):
        ops.extend_attention(*args, window=-1)
    with pytest.raises(ValueError, match="sinks"):
        ops.extend_attention(*args, sinks=torch.zeros(3, device=DEV))
    with pytest.raises(ValueError, match="window"):  # deterministic mode takes windows, not bad ones
        ops.extend_attention(*args, window=-1, deterministic=True)
