"""A step's index array: the token-bucket ladder, the padded layout a captured graph reads
(values of every field, padding included), and the checks a step gets once when it is built."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl.kernels.extend_attention import tile_capacity
from minisgl.step.cuda_graph import batch_size_ladder, token_bucket_ladder
from minisgl.step.layout import StepLayout, StepSpec, count_tiles, exact_layout

PAD = 9  # the request table's padding row in these tests


def test_token_bucket_ladder() -> None:
    ladder = token_bucket_ladder(8192)
    assert ladder[:6] == [16, 32, 64, 128, 256, 320] and ladder[-1] == 8192
    assert ladder == sorted(set(ladder))
    assert all(b / a <= 1.25 for a, b in zip(ladder[4:], ladder[5:]))  # padding costs <= 25% past 256
    assert token_bucket_ladder(1000)[-2:] == [896, 1000]  # capped at the largest step
    assert token_bucket_ladder(10) == [10]
    assert batch_size_ladder(20) == [1, 2, 4, 8, 16, 20]


def views(layout: StepLayout, spec: StepSpec, block_m: int, table_rows: int = 10, ctx: int = 64):
    buf = np.zeros(layout.size, dtype=np.int64)
    layout.fill(buf, spec, PAD, block_m)
    table = torch.arange(table_rows * ctx, dtype=torch.int32).view(table_rows, ctx) + 1000
    table[PAD] = 0  # the padding row: every position at the dummy slot
    token_buffer = torch.arange(table_rows, dtype=torch.int64) + 500
    return layout.views(torch.from_numpy(buf), table, token_buffer, ctx), table


def test_mixed_step_padded_to_a_bucket() -> None:
    # Two decodes (rows 3, 5) then two prompt chunks (rows 1, 7), in a 16-token bucket.
    spec = StepSpec("mixed", [3, 5, 1, 7], [10, 4, 0, 6], [None, None, [11, 12, 13], [21, 22]])
    assert (spec.num_decodes, spec.num_tokens, spec.ext) == (2, 7, [1, 1, 3, 2])
    block_m = 2
    layout = StepLayout("extend", 16, 6, tile_capacity(16, 6, block_m), 6)
    assert layout.fits(spec, count_tiles(spec, block_m, True))
    b, table = views(layout, spec, block_m)
    assert b.input_ids.tolist() == [503, 505, 11, 12, 13, 21, 22] + [0] * 9  # decodes: the token buffer's
    assert b.positions.tolist() == [10, 4, 0, 1, 2, 6, 7] + [0] * 9
    rows = [3, 5, 1, 1, 1, 7, 7]
    assert b.out_slots.tolist() == [int(table[r, p]) for r, p in zip(rows, b.positions[:7].tolist())] + [0] * 9
    assert b.req_rows.tolist() == [3, 5, 1, 7, PAD, PAD]
    assert b.prefix_lens.tolist() == [10, 4, 0, 6, 0, 0]
    assert b.seq_lens.tolist() == [11, 5, 3, 8, 1, 1]
    assert b.cu_seqlens_q.tolist() == [0, 1, 2, 5, 7, 7, 7]  # padding requests: no tokens
    assert b.sample_rows.tolist() == [0, 1, 4, 6, 0, 0]
    assert b.decode_rows.tolist() == [3, 5] + [PAD] * 4 and b.decode_seq_lens.tolist() == [11, 5, 1, 1, 1, 1]
    pairs = [tuple(t) for t in b.tiles.tolist()]
    real = [p for p in pairs if p[0] >= 0]
    assert sorted(real) == [(2, 0), (2, 2), (3, 0)]  # decodes take the decode kernel: no tiles
    assert real[0] == (3, 0) and pairs[len(real) :] == [(-1, 0)] * (layout.tiles - 3)  # most keys first
    for name in ("input_ids", "positions", "req_rows", "seq_lens", "prefix_lens", "cu_seqlens_q", "sample_rows",
                 "tiles", "decode_rows", "decode_seq_lens"):
        assert getattr(b, name).data_ptr() % 16 == 0, name


def test_mixed_step_decodes_as_tiles_without_decode_rows() -> None:
    spec = StepSpec("mixed", [3, 1], [10, 0], [None, [11, 12, 13]])
    layout = exact_layout(spec, block_m=2, decode_kernel=False)
    assert (layout.tokens, layout.requests, layout.tiles, layout.decodes) == (4, 2, 3, 0)
    b, _ = views(layout, spec, 2)
    assert b.decode_rows is None and sorted(tuple(t) for t in b.tiles.tolist()) == [(0, 0), (1, 0), (1, 2)]


def test_decode_step_padded() -> None:
    spec = StepSpec("decode", [4, 2, 6], [7, 30, 1], [None] * 3)
    b, _ = views(StepLayout("decode", 4, 4), spec, 1)
    assert b.input_ids.tolist() == [504, 502, 506, 0]  # a padding token: id 0
    assert b.req_rows.tolist() == [4, 2, 6, PAD] and b.seq_lens.tolist() == [8, 31, 2, 1]
    assert b.out_slots[3].item() == 0 and b.tiles is None and b.decode_rows is None


def test_torch_backend_layout_has_no_tile_map() -> None:
    spec = StepSpec("extend", [0], [0], [[5, 6, 7]])
    assert exact_layout(spec, None, True) == StepLayout("extend", 3, 1)


@pytest.fixture(scope="module")
def engine(tiny_model_path):
    from minisgl import LLM

    return LLM(str(tiny_model_path("qwen3")), device="cpu", dtype="float32", max_running_requests=4).engine


@pytest.mark.parametrize(
    ("mode", "rows", "prefix", "new", "match"),
    [
        ("extend", [0], [0], [[]], ">= 1 new token"),
        ("extend", [0], [-1], [[5]], "prefix >= 0"),
        ("extend", [0], [0], [[5] * 600], "at most"),
        ("extend", [4], [0], [[5]], "rows must be distinct"),
        ("extend", [1, 1], [0, 0], [[5], [6]], "rows must be distinct"),
        ("extend", [0], [0], [[10**9]], "token ids"),
        ("extend", [0], [0], [None], "token-buffer inputs"),
        ("mixed", [0, 1], [3, 0], [[5], None], "token-buffer inputs"),
        ("decode", [0], [3], [[5, 6]], "exactly one"),
        ("extend", [0, 1], [0], [[5], [6]], "one length"),
        ("prefill", [0], [0], [[5]], "mode"),
        ("extend", [0], [0], None, "only decode"),
    ],
)
def test_bad_steps_are_refused_once_at_build(engine, mode, rows, prefix, new, match) -> None:
    with pytest.raises(ValueError, match=match):
        engine.build_batch(mode, rows, prefix, new)


def test_trusted_skips_the_ops_checks_only_inside() -> None:
    from minisgl import ops
    from minisgl.ops import _checks

    x, short = torch.randn(3, 8), torch.ones(4)
    with pytest.raises(ValueError, match="weight"):
        ops.rmsnorm(x, short, 1e-6)
    with pytest.raises(RuntimeError):  # unchecked: torch itself fails, later and less clearly
        with _checks.trusted():
            with _checks.trusted():
                pass
            assert not _checks.enabled()  # nesting keeps the outer block trusted
            ops.rmsnorm(x, short, 1e-6)
    assert _checks.enabled()
    with pytest.raises(ValueError, match="weight"):
        ops.rmsnorm(x, short, 1e-6)
