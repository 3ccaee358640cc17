"""ForwardBatch construction: right values, and every tensor 16-byte aligned whatever the
batch size (Triton specializes kernels on pointer alignment; a view whose alignment moved
with the batch size would trigger a fresh JIT compile mid-run)."""

from __future__ import annotations

import pytest
import torch

from minisgl import LLM
from minisgl.sampling.sampler import SamplingTensors

FIELDS = ("input_ids", "positions", "out_slots", "req_rows", "seq_lens", "prefix_lens", "cu_seqlens_q", "sample_rows")


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    return LLM(str(tiny_model_path("llama3")), device="cpu", dtype="float32").engine


@pytest.mark.parametrize("b", [1, 2, 3, 5, 8])
@pytest.mark.parametrize("mode", ["extend", "decode"])
def test_batch_values_and_alignment(engine, b: int, mode: str) -> None:
    gen = torch.Generator().manual_seed(b)
    rows = [engine.table.allocate_row() for _ in range(b)]
    try:
        prefix = torch.randint(0, 20, (b,), generator=gen).tolist()
        lens = [1] * b if mode == "decode" else torch.randint(1, 9, (b,), generator=gen).tolist()
        new = [torch.randint(0, 1000, (n,), generator=gen).tolist() for n in lens]
        slots = torch.randperm(5000, generator=gen)[: 30 * b].int() + 1
        for i, r in enumerate(rows):
            engine.write_slots([r] * 30, list(range(30)), slots[30 * i : 30 * (i + 1)].tolist())
        if mode == "decode":
            engine.token_buffer[torch.tensor(rows)] = torch.tensor([t[0] for t in new])
        batch = engine.build_batch(mode, rows, prefix, None if mode == "decode" else new)
        for name in FIELDS:
            t = getattr(batch, name)
            assert t.data_ptr() % 16 == 0, f"{name} is not 16-byte aligned at batch size {b}"
        assert batch.input_ids.tolist() == [x for t in new for x in t]
        assert batch.positions.tolist() == [p + j for p, n in zip(prefix, lens) for j in range(n)]
        assert batch.req_rows.tolist() == rows
        assert batch.seq_lens.tolist() == [p + n for p, n in zip(prefix, lens)]
        assert batch.prefix_lens.tolist() == prefix
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        assert batch.cu_seqlens_q.tolist() == cu
        assert batch.sample_rows.tolist() == [c - 1 for c in cu[1:]]
        want_slots = [int(slots[30 * i + p + j]) for i, (p, n) in enumerate(zip(prefix, lens)) for j in range(n)]
        assert batch.out_slots.tolist() == want_slots
    finally:
        for r in rows:
            engine.table.free_row(r)


@pytest.mark.parametrize("b", [1, 2, 3, 5, 6])
def test_sampling_tensors_aligned(b: int) -> None:
    st = SamplingTensors.build([0.5] * b, [3] * b, [0.9] * b, [0.1] * b, [7] * b, [2] * b, torch.device("cpu"))
    for name in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps"):
        t = getattr(st, name)
        assert t.data_ptr() % 16 == 0 and t.shape == (b,) and t.is_contiguous(), name
    assert st.top_k.tolist() == [3] * b and st.seeds.tolist() == [7] * b and st.steps.tolist() == [2] * b


def test_engine_greedy_sample_logprobs(engine) -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(5, 777, generator=gen) * 4
    st = SamplingTensors.build([0.0] * 5, [-1] * 5, [1.0] * 5, [0.0] * 5, [0] * 5, [0] * 5, torch.device("cpu"))
    tokens, logprobs = engine.sample(logits, st)
    assert torch.equal(tokens, logits.argmax(-1))
    ref = torch.log_softmax(logits.double(), -1).gather(1, tokens[:, None]).squeeze(1)
    torch.testing.assert_close(logprobs.double(), ref, rtol=1e-5, atol=1e-5)
