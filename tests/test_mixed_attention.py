"""A mixed step's attention exactly as a captured graph runs it: the step's index array
(StepLayout.fill, padded to a bucket with decode-kernel rows and an extend tile map), viewed
as the graph's batch, through the backend (KV store, the decode kernel over the leading decode
rows, then the extend tiles over every other request) against the fp64 reference per request
under FA3's rule. Unused pool slots, the dummy page included, start as NaN.

This is the check under the H100 run's question (graph_designs.py, "a-decode": a mixed
step's logits differed from the one-row-tile path by 5.5e-2 of the max logit): if the decode
rows were wrong (a row, a length, an overwrite by the tiles), they would fail here by O(1),
not by rounding. On the CPU it runs the Triton kernels in the interpreter (fp32 and fp16);
on a GPU also the CUDA decode kernel (bf16 and fp16)."""

from __future__ import annotations

import attention_rule
import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import extend_attention as K
from minisgl.kvcache.pool import DUMMY_SLOT, KVPool
from minisgl.step.layout import StepLayout, StepSpec

pytestmark = pytest.mark.triton

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)

HQ, HKV, D = 4, 2, 64
# Three decodes (contexts 30, 77 and 5), a chunk of 50 on a 40-token prefix, a 9-token prompt.
PREFIX = [30, 77, 5, 40, 0]
EXT = [1, 1, 1, 50, 9]
BUCKET, MAX_REQUESTS = 70, 8  # 62 real tokens: 8 padding tokens, 3 padding requests


def backends() -> list:
    on_gpu = pytest.mark.gpu
    return [  # two interpreted cases on the CPU (seconds each); the CUDA kernel at both page sizes
        pytest.param("triton", torch.float32, 16, id="triton-fp32-page16"),
        pytest.param("triton", torch.float16, 1, id="triton-fp16-page1"),
        *(pytest.param("cuda", dt, p, id=f"cuda-{str(dt)[6:]}-page{p}", marks=on_gpu)
          for dt in (torch.bfloat16, torch.float16) for p in (1, 16)),
    ]


@needs_triton
@pytest.mark.parametrize("backend,dtype,page_size", backends())
def test_mixed_step_decode_rows_and_tiles_match_reference(backend: str, dtype: torch.dtype, page_size: int) -> None:
    if backend == "cuda" and DEV != "cuda":
        pytest.skip("the CUDA decode kernel needs a GPU")
    from minisgl.attention.cuda_backend import CudaAttentionBackend
    from minisgl.attention.triton_backend import TritonAttentionBackend

    gen = torch.Generator().manual_seed(17 + page_size)
    seq = [p + e for p, e in zip(PREFIX, EXT)]
    table, rows, num_slots = attention_rule.paged_table(seq, page_size, gen, DEV, spare_rows=MAX_REQUESTS)
    used_rows = set(rows.tolist())
    pad_row = next(r for r in range(table.shape[0]) if r not in used_rows)  # all zeros: the dummy slot
    pool = KVPool(1, num_slots // page_size, page_size, HKV, D, dtype, torch.device(DEV))
    pool._k.copy_(torch.randn(pool._k.shape, generator=gen).to(dtype))
    pool._v.copy_(torch.randn(pool._v.shape, generator=gen).to(dtype))
    c = {"k_cache": pool._k[0], "v_cache": pool._v[0], "req_to_slot": table, "req_rows": rows}
    attention_rule.poison_unused_slots(c, seq)  # in place: the pool's own storage
    cls = CudaAttentionBackend if backend == "cuda" else TritonAttentionBackend
    attn = cls(pool, HQ, D**-0.5)

    new = [None, None, None] + [torch.randint(0, 100, (e,), generator=gen).tolist() for e in EXT[3:]]
    spec = StepSpec("mixed", rows.tolist(), PREFIX, new)
    assert spec.num_decodes == 3 and spec.num_tokens == sum(EXT)
    cap = ops.extend_tile_capacity(BUCKET, MAX_REQUESTS, attn.tile_block_m)
    layout = StepLayout("mixed", BUCKET, MAX_REQUESTS, cap, MAX_REQUESTS)
    host = torch.empty(layout.size, dtype=torch.int64)
    layout.fill(host.numpy(), spec, pad_row, attn.tile_block_m)
    token_buffer = torch.zeros(table.shape[0], dtype=torch.int64, device=DEV)
    batch = layout.views(host.to(DEV), table, token_buffer, max_seq_len=table.shape[1])
    assert batch.decode_rows.shape[0] == MAX_REQUESTS and batch.tiles.shape[0] == cap

    q, k, v = (torch.randn(BUCKET, h, D, generator=gen).to(DEV, dtype) for h in (HQ, HKV, HKV))
    out = attn.forward(q, k, v, 0, batch)

    n = spec.num_tokens
    cu = torch.tensor([0] + torch.tensor(EXT).cumsum(0).tolist(), dtype=torch.int32, device=DEV)
    i32 = dict(dtype=torch.int32, device=DEV)
    attention_rule.assert_fa3_rule(
        out[:n], K.extend_attention_reference, q[:n], pool._k[0], pool._v[0], table, rows,
        torch.tensor(PREFIX, **i32), cu, D**-0.5)
    # The new tokens' K/V went to their own slots; the padding tokens' only to the dummy slot.
    slots = table[rows.long().repeat_interleave(torch.tensor(EXT, device=DEV)),
                  torch.cat([torch.arange(p, p + e) for p, e in zip(PREFIX, EXT)]).to(DEV)].long()
    torch.testing.assert_close(pool._k[0][slots], k[:n], rtol=0, atol=0)
    owned = torch.zeros(num_slots, dtype=torch.bool, device=DEV)
    for r, s in zip(rows.tolist(), seq):
        owned[table[r, :s].long()] = True
    owned[DUMMY_SLOT] = True
    assert torch.isnan(pool._k[0][~owned]).all() and torch.isnan(pool._v[0][~owned]).all()
