"""Triton split-K decode attention over the paged cache vs an fp64 reference (FA3's rule)."""

from __future__ import annotations

import attention_rule
import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import decode_attention as K

# Triton kernels: on the CPU they run under TRITON_INTERPRET=1 (a separate pytest pass).
pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def make_case(seq_lens: list[int], hq: int, hkv: int, d: int, dtype: torch.dtype, page_size: int,
              seed: int) -> dict:
    gen = torch.Generator().manual_seed(seed)
    b = len(seq_lens)
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 2
    perm = (torch.randperm(num_pages - 1, generator=gen) + 1).tolist()
    table = torch.zeros(b + 1, max(seq_lens) + 3, dtype=torch.int32)
    rows = torch.randperm(b + 1, generator=gen)[:b].to(torch.int32)
    for i, s in enumerate(seq_lens):
        n = -(-s // page_size)
        pages, perm = torch.tensor(perm[:n]), perm[n:]
        table[rows[i], :s] = (pages[:, None] * page_size + torch.arange(page_size)).reshape(-1)[:s].int()
    slots = num_pages * page_size
    return dict(
        q=torch.randn(b, hq, d, generator=gen).to(DEV, dtype),
        k_cache=torch.randn(slots, hkv, d, generator=gen).to(DEV, dtype),
        v_cache=torch.randn(slots, hkv, d, generator=gen).to(DEV, dtype),
        req_to_slot=table.to(DEV), req_rows=rows.to(DEV),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=DEV),
        max_seq_len=max(seq_lens), scale=d**-0.5,
    )


def assert_fa3_rule(out: torch.Tensor, c: dict) -> None:
    args = (c["q"], c["k_cache"], c["v_cache"], c["req_to_slot"], c["req_rows"], c["seq_lens"], c["scale"])
    attention_rule.assert_fa3_rule(out, K.decode_attention_reference, *args)


@needs_triton
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("seq_lens", [[1], [111], [1, 7, 19, 300, 64]])
def test_decode_matches_reference(seq_lens: list[int], page_size: int) -> None:
    c = make_case(seq_lens, 4, 2, 64, torch.float16, page_size, seed=sum(seq_lens) + page_size)
    assert_fa3_rule(ops.decode_attention_triton(**c), c)


@needs_triton
@pytest.mark.parametrize("splits", [1, 3, 32])
def test_decode_split_counts(splits: int) -> None:
    """More splits than key blocks leaves empty slices: they must merge with weight 0."""
    c = make_case([5, 130, 77], 4, 1, 64, torch.float16, 1, seed=splits)
    args = {k: v for k, v in c.items()}
    out = K.decode_attention(**args, num_splits=splits)
    assert_fa3_rule(out, c)


@needs_triton
@pytest.mark.parametrize("hq,hkv,d", [(3, 3, 32), (7, 1, 128), (32, 2, 64), (4, 2, 80)])
def test_decode_head_layouts(hq: int, hkv: int, d: int) -> None:
    """MHA, a group of 7 (padded to 16 rows), a group of 16, a non-power-of-two head dim."""
    c = make_case([23, 9], hq, hkv, d, torch.float16, 16, seed=hq + d)
    assert_fa3_rule(ops.decode_attention_triton(**c), c)


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_unused_cache_slots_never_reach_the_output(dtype: torch.dtype) -> None:
    c = make_case([5, 130, 1], 4, 2, 64, dtype, 16, seed=21)
    attention_rule.poison_unused_slots(c, [5, 130, 1])
    assert_fa3_rule(ops.decode_attention_triton(**c), c)


@needs_triton
def test_decode_bound_larger_than_lengths_and_out() -> None:
    """A CUDA-graph style call: max_seq_len is a loose bound; results go into `out`."""
    c = make_case([3, 40], 4, 2, 64, torch.float32, 1, seed=4)
    c["max_seq_len"] = 4096
    out = torch.full_like(c["q"], float("nan"))
    assert ops.decode_attention_triton(**c, out=out).data_ptr() == out.data_ptr()
    assert_fa3_rule(out, c)


def test_bad_arguments_name_the_argument() -> None:
    c = make_case([2, 3], 4, 2, 16, torch.float32, 1, seed=0)
    with pytest.raises(ValueError, match="seq_lens"):
        ops.decode_attention_triton(**{**c, "seq_lens": c["seq_lens"][:1]})
    with pytest.raises(ValueError, match="req_rows"):
        ops.decode_attention_triton(**{**c, "req_rows": c["req_rows"].long()})
    with pytest.raises(ValueError, match="out"):
        ops.decode_attention_triton(**c, out=torch.empty(2, 4, 8))
    with pytest.raises(ValueError, match="max_seq_len"):
        ops.decode_attention_triton(**{**c, "max_seq_len": 0})


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("d", [64, 128, 256])
@pytest.mark.parametrize("page_size", [1, 16])
def test_gpu_real_sizes(dtype: torch.dtype, d: int, page_size: int) -> None:
    seq = [1, 7, 19, 111, 1023, 4096, 333, 2500]
    c = make_case(seq, 32, 8, d, dtype, page_size, seed=d + page_size)
    assert_fa3_rule(ops.decode_attention_triton(**c), c)
