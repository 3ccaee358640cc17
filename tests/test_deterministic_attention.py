"""Deterministic mode's attention launches on the Triton kernels (interpreter on the CPU):
GQA-packed tiles with fixed key splits, and the split decode, against the fp64 reference
under FA3's rule. Their bit-exactness across launches is a GPU property: tests/test_deterministic_gpu.py."""

from __future__ import annotations

import attention_rule
import pytest
import torch
from test_extend_attention import DEV, assert_fa3_rule, make_case, needs_triton

from minisgl import ops
from minisgl.kernels import deterministic_attention as D
from minisgl.kernels import extend_attention as K

pytestmark = pytest.mark.triton


def _case(hq: int, hkv: int, prefix: list[int], ext: list[int], pad: int, seed: int):
    c = make_case(prefix, ext, hq, hkv, 64, torch.float16, 16, seed=seed)
    attention_rule.poison_unused_slots(c, [p + e for p, e in zip(prefix, ext)])
    real = sum(ext)
    q = torch.randn(real + pad, hq, 64, generator=torch.Generator().manual_seed(seed)).to(DEV, torch.float16)
    q[:real] = c["q"]
    return c, q, real


@needs_triton
@pytest.mark.parametrize("hq,hkv", [(8, 2), (6, 2)])  # GQA groups of 4 and 3 (3 leaves a tile's last rows empty)
@pytest.mark.parametrize("tiled", [False, True])
def test_packed_split_launch_matches_reference(hq: int, hkv: int, tiled: bool) -> None:
    """A tile's rows are tokens x the q heads of one KV group; keys in splits (64 keys in the
    interpreter, 128 on the GPU; the prefixes scale with it): a decode past 2 splits, a prompt
    longer than a tile, a chunk after a prefix; unused rows stay NaN."""
    dev = torch.device(DEV)
    tokens = ops.extend_block_m(64, torch.float16, dev, hq // hkv, deterministic=True)
    config, heads, split = D.deterministic_config(64, torch.float16, dev, hq // hkv)
    assert heads == hq // hkv and tokens == config[0] // heads
    prefix, ext = [2 * split + 22, 0, split // 2 + 9, 3], [1, 70, 1, 33]
    c, q, real = _case(hq, hkv, prefix, ext, 3, seed=11)
    tiles = None
    if tiled:
        cap = ops.extend_tile_capacity(real + 3, len(ext), tokens)
        tiles = torch.tensor(ops.extend_tile_map(prefix, ext, tokens, cap), dtype=torch.int32, device=DEV).view(-1, 2)
    out = torch.full_like(q, float("nan"))
    ops.extend_attention(**{**c, "q": q}, out=out, tiles=tiles, deterministic=True)
    assert torch.isnan(out[real:]).all()
    assert_fa3_rule(out[:real], c)


def _decode_step(seed: int):
    """A decode step of 3 requests (contexts past 2 splits, short, mid) and a bucket's padding
    request: (case, q, real rows, its one-token tiles)."""
    prefix, ext = [300, 5, 129, 0], [1, 1, 1, 0]
    c, q, real = _case(8, 2, prefix, ext, 1, seed=seed)
    tokens = ops.extend_block_m(64, torch.float16, torch.device(DEV), 4, deterministic=True)
    tiles = torch.tensor(ops.extend_tile_map(prefix, ext, tokens, 4), dtype=torch.int32, device=DEV).view(-1, 2)
    c["cu_seqlens_q"] = torch.tensor([0, 1, 2, 3, 3], dtype=torch.int32, device=DEV)
    return c, q, real, tiles


@needs_triton
@pytest.mark.parametrize("programs", [1, 2])
@pytest.mark.parametrize("bound", [400, 301])  # 301: the longest context fills the workspace's splits
def test_split_decode_programs_walking_several_splits(monkeypatch: pytest.MonkeyPatch, programs: int,
                                                      bound: int) -> None:
    """The split decode's programs each walk every `programs`-th split of a request in one loop
    over their key blocks (a fresh state at each split's first block, the partial written at its
    last, a short last split): the sequential splits' outputs bit for bit (the interpreter's
    arithmetic is the same on both paths) and the reference's answer; the NaN-filled output
    rows of the bucket's padding request stay unwritten."""
    c, q, real, tiles = _decode_step(seed=13)
    seq = torch.full_like(q, float("nan"))
    ops.extend_attention(**{**c, "q": q}, out=seq, tiles=tiles, deterministic=True)
    config, heads, _ = D.deterministic_config(64, torch.float16, torch.device(DEV), 4)
    # programs per (head group, tile) on grid axis 2: SPLIT_DECODE_WARPS // warps // (groups x tiles)
    monkeypatch.setattr(D, "SPLIT_DECODE_WARPS", programs * config[2] * (8 // heads) * tiles.shape[0])
    shared = torch.full_like(q, float("nan"))
    ops.extend_attention(**{**c, "q": q}, out=shared, tiles=tiles, deterministic=True, decode_max_seq_len=bound)
    assert_fa3_rule(shared[:real], c)
    assert torch.equal(shared[:real], seq[:real])
    assert torch.isnan(shared[real:]).all()


@needs_triton
def test_split_decode_matches_reference_and_sequential_splits() -> None:
    """A decode step through the parallel splits (and the combine kernel): the reference's
    answer, and (to the interpreter's rounding) the sequential splits' answer; a padding
    request of the bucket (no tile) is left alone."""
    c, q, real, tiles = _decode_step(seed=12)
    out = torch.full_like(q, float("nan"))
    ops.extend_attention(**{**c, "q": q}, out=out, tiles=tiles, deterministic=True, decode_max_seq_len=400)
    assert_fa3_rule(out[:real], c)
    seq = torch.full_like(q, float("nan"))
    ops.extend_attention(**{**c, "q": q}, out=seq, tiles=tiles, deterministic=True)
    torch.testing.assert_close(out[:real], seq[:real], atol=2e-3, rtol=2e-3)


def test_split_decode_choice_follows_its_workspace(monkeypatch: pytest.MonkeyPatch) -> None:
    """Decode steps run the splits in parallel while the fp32 partials (acc padded to a power of
    two, then m and l, per request, q head and split of the max_seq_len bound) fit the bound."""
    per_request = 16 * 320 * (128 + 2) * 4  # Qwen3-0.6B: 16 q heads, head dim 128, 40,960 / 128 splits
    assert D.split_decode_workspace(1, 16, 128, 40960, 128) == per_request
    assert D.split_decode_workspace(1, 16, 96, 40833, 128) == per_request  # padded dim, split tail
    monkeypatch.setattr(D, "SPLIT_DECODE_WORKSPACE_BYTES", 10 * per_request)
    assert D.use_split_decode(10, 16, 128, 40960, 128)
    assert not D.use_split_decode(11, 16, 128, 40960, 128)
    assert D.use_split_decode(11, 16, 128, 4096, 128)  # a shorter bound: fewer splits


@needs_triton
def test_decode_steps_take_the_split_decode_while_its_workspace_fits(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ops: a decode step calls split_decode, whose fp32 allocations are exactly
    split_decode_workspace(...) of the step's batch, heads, dim, bound and split; with
    SPLIT_DECODE_WORKSPACE_BYTES at exactly that size it still does, and one byte short the same
    step walks the splits in one program per request."""
    c, q, real, tiles = _decode_step(seed=13)
    dev = torch.device(DEV)
    calls: list[int] = []
    fp32_bytes: list[int] = []
    split_decode, empty = D.split_decode, torch.empty

    def spy_split(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return split_decode(*args, **kwargs)

    def spy_empty(*args: object, **kwargs: object) -> torch.Tensor:
        t = empty(*args, **kwargs)
        if t.dtype == torch.float32 and calls:
            fp32_bytes.append(t.numel() * 4)
        return t

    monkeypatch.setattr(D, "split_decode", spy_split)
    monkeypatch.setattr(torch, "empty", spy_empty)
    step = dict(c, q=q, tiles=tiles, deterministic=True, decode_max_seq_len=400)
    ops.extend_attention(**step, out=torch.full_like(q, float("nan")))
    _, _, split = D.deterministic_config(64, torch.float16, dev, 4)
    need = D.split_decode_workspace(4, 8, 64, 400, split)
    assert calls and sum(fp32_bytes) == need
    for bound, parallel in ((need, True), (need - 1, False)):  # exactly at the bound, one byte short
        monkeypatch.setattr(D, "SPLIT_DECODE_WORKSPACE_BYTES", bound)
        calls.clear()
        ops.extend_attention(**step, out=torch.full_like(q, float("nan")))
        assert bool(calls) == parallel, f"bound {bound} of {need} bytes"


@needs_triton
@pytest.mark.parametrize("with_sinks", [False, True])
def test_window_and_sinks_in_the_mode(monkeypatch: pytest.MonkeyPatch, with_sinks: bool) -> None:
    """Deterministic mode with a sliding window (W = 40, under the interpreter's 64-key splits, so
    a late query's window leaves whole splits below it) and GPT-OSS's sinks: a prompt of 200
    tokens, tiled, and single tokens as decode steps (through the parallel splits and one program
    per request) against the reference under FA3's rule. Each decode step's cache has every slot
    below its window NaN-poisoned (a window-sized pool frees them), so a read of one shows."""
    window, n = 40, 200
    dev = torch.device(DEV)
    c = make_case([0], [n], 8, 2, 64, torch.float16, 16, seed=21)
    attention_rule.poison_unused_slots(c, [n])
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(5)).to(DEV) if with_sinks else None

    def reference(*args, compute_dtype):
        return K.extend_attention_reference(*args, compute_dtype=compute_dtype, window=window, sinks=sinks)

    def check(out: torch.Tensor, case: dict) -> None:
        args = (case["q"], case["k_cache"], case["v_cache"], case["req_to_slot"], case["req_rows"],
                case["prefix_lens"], case["cu_seqlens_q"], case["scale"])
        attention_rule.assert_fa3_rule(out, reference, *args)

    tokens = ops.extend_block_m(64, torch.float16, dev, 4, deterministic=True)
    i32 = dict(dtype=torch.int32, device=DEV)
    tiles = torch.tensor(ops.extend_tile_map([0], [n], tokens, ops.extend_tile_capacity(n, 1, tokens)), **i32)
    out = ops.extend_attention(**c, tiles=tiles.view(-1, 2), deterministic=True, window=window, sinks=sinks)
    check(out, c)
    for p in (0, 39, 40, 63, 64, 100, 128, 199):
        step = {**c, "q": c["q"][p : p + 1], "prefix_lens": torch.tensor([p], **i32),
                "seq_lens": torch.tensor([p + 1], **i32), "cu_seqlens_q": torch.tensor([0, 1], **i32)}
        freed = c["req_to_slot"][0, : max(0, p - window + 1)].long()
        step["k_cache"], step["v_cache"] = c["k_cache"].clone(), c["v_cache"].clone()
        step["k_cache"][freed] = float("nan")
        step["v_cache"][freed] = float("nan")
        one = torch.tensor(ops.extend_tile_map([p], [1], tokens, 1), **i32).view(-1, 2)
        for bound in (1 << 40, 0):  # the split decode, then (no workspace) one program per request
            monkeypatch.setattr(D, "SPLIT_DECODE_WORKSPACE_BYTES", bound)
            got = ops.extend_attention(**step, tiles=one, deterministic=True, decode_max_seq_len=n, window=window,
                                       sinks=sinks)
            check(got, step)
