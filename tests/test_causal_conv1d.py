"""Causal depthwise conv1d with a state pool (kernels/causal_conv1d.py through minisgl.ops):
the torch reference vs transformers' causal_conv1d_fn / causal_conv1d_update; the Triton
prefill and decode vs the reference on fresh random data (short sequences that end inside
the window, states carried across calls, padding rows, NaN-poisoned unused slots)."""

from __future__ import annotations

import pytest
import torch
from triton_marks import test_device, triton_test

from minisgl.kernels import causal_conv1d as K
from minisgl.ops import linear_attention as LA


def _cu(lens, dev):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)


def _weights(d, k, gen, dev, dtype, bias=True):
    w = torch.randn(d, k, generator=gen).to(dev, dtype)
    b = torch.randn(d, generator=gen).to(dev, dtype) if bias else None
    return w, b


def _pool(n_slots, k, d, live, gen, dev, dtype):
    states = torch.full((n_slots, k - 1, d), float("nan"), device=dev, dtype=dtype)
    for s in live:
        states[s] = torch.randn(k - 1, d, generator=gen).to(dev, dtype)
    return states


def test_reference_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(0)
    d, k, t = 12, 4, 9
    w, b = _weights(d, k, gen, "cpu", torch.float32)
    x = torch.randn(t, d, generator=gen)
    states = _pool(2, k, d, [], gen, "cpu", torch.float32)
    slot = torch.tensor([1], dtype=torch.int32)
    out = K.causal_conv1d_reference(x, w, b, states, slot, _cu([t], "cpu"), torch.tensor([False]))
    want = hf.causal_conv1d_fn(x.t()[None], w, b, activation="silu")[0].t()
    torch.testing.assert_close(out, want, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states[1], x[-(k - 1):])  # the last K-1 inputs
    # one decode step: transformers keeps K inputs (the oldest unused), we keep K-1
    x1 = torch.randn(1, d, generator=gen)
    hf_state = torch.cat([torch.randn(1, d, generator=gen), states[1]]).t()[None].contiguous()
    want1 = hf.causal_conv1d_update(x1.t()[None], hf_state, w, b, "silu")[0].t()
    out1 = K.causal_conv1d_reference(x1, w, b, states, slot, _cu([1], "cpu"), torch.tensor([True]))
    torch.testing.assert_close(out1, want1, atol=1e-6, rtol=1e-6)
    torch.testing.assert_close(states[1], hf_state[0, :, 1:].t())
    assert torch.isnan(states[0]).all()


@triton_test
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
@pytest.mark.parametrize("bias,silu", [(True, True), (False, False)])
def test_prefill_matches_reference(dtype, atol, bias, silu):
    dev = test_device()
    gen = torch.Generator().manual_seed(1)
    d, k = 48, 4
    lens = (1, 2, 7, 65, 3)
    t = sum(lens)
    w, b = _weights(d, k, gen, dev, dtype, bias)
    # x is a column slice of a wider projection: a row stride that is not D
    x = torch.randn(t, d + 16, generator=gen).to(dev, dtype)[:, 8:8 + d]
    slots = torch.tensor([7, 2, 4, -1, 0], dtype=torch.int32, device=dev)
    has = torch.tensor([True, False, True, True, True], device=dev)
    states = _pool(9, k, d, [7, 4, 0], gen, dev, dtype)
    ref = states.clone()
    cu = _cu(lens, dev)
    out = LA.causal_conv1d_prefill(x, w, b, states, slots, cu, has, silu=silu)
    want = K.causal_conv1d_reference(x, w, b, ref, slots, cu, has, silu=silu)
    torch.testing.assert_close(out, want, atol=atol, rtol=atol)
    live = [7, 2, 4, 0]
    assert torch.equal(states[live], ref[live])  # a copy of inputs: exact
    unused = [1, 3, 5, 6, 8]
    assert torch.equal(states[unused].view(torch.int16 if dtype == torch.float16 else torch.int32),
                       ref[unused].view(torch.int16 if dtype == torch.float16 else torch.int32))
    assert torch.isnan(states[unused]).all()


@triton_test
@pytest.mark.parametrize("split", [1, 2, 5])
def test_prefill_split_and_decode_equal_one_call(split):
    """Prefill in two calls, then two decode steps, equals one prefill of the whole sequence."""
    dev = test_device()
    gen = torch.Generator().manual_seed(split)
    d, k, t = 20, 4, 9
    w, b = _weights(d, k, gen, dev, torch.float32)
    x = torch.randn(t, d, generator=gen).to(dev)
    slot = torch.tensor([1], dtype=torch.int32, device=dev)
    one, two = _pool(2, k, d, [], gen, dev, torch.float32), _pool(2, k, d, [], gen, dev, torch.float32)
    no, yes = torch.tensor([False], device=dev), torch.tensor([True], device=dev)
    whole = LA.causal_conv1d_prefill(x, w, b, one, slot, _cu([t], dev), no)
    a = LA.causal_conv1d_prefill(x[:split], w, b, two, slot, _cu([split], dev), no)
    c = LA.causal_conv1d_prefill(x[split:t - 2], w, b, two, slot, _cu([t - 2 - split], dev), yes)
    tail = [LA.causal_conv1d_decode(x[i:i + 1], w, b, two, slot) for i in (t - 2, t - 1)]
    torch.testing.assert_close(torch.cat([a, c, *tail]), whole, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(two, one, equal_nan=True)
    assert torch.isnan(two[0]).all()


@triton_test
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 1e-2)])
def test_decode_batch(dtype, atol):
    dev = test_device()
    gen = torch.Generator().manual_seed(3)
    d, k, n = 300, 4, 4  # D above one 256-wide block
    w, b = _weights(d, k, gen, dev, dtype)
    slots = torch.tensor([5, -1, 0, 2], dtype=torch.int32, device=dev)
    states = _pool(6, k, d, [5, 0, 2], gen, dev, dtype)
    ref = states.clone()
    for _ in range(3):
        x = torch.randn(n, d, generator=gen).to(dev, dtype)
        out = LA.causal_conv1d_decode(x, w, b, states, slots)
        want = K.causal_conv1d_reference(x, w, b, ref, slots, _cu([1] * n, dev), torch.ones(n, dtype=torch.bool))
        keep = [0, 2, 3]  # the padding row's output is not defined
        torch.testing.assert_close(out[keep], want[keep], atol=atol, rtol=atol)
    assert torch.equal(states[[5, 0, 2]], ref[[5, 0, 2]])
    assert torch.isnan(states[[1, 3, 4]]).all()


def test_bad_input_names_the_argument():
    x = torch.randn(5, 8)
    w = torch.randn(8, 4)
    states = torch.zeros(2, 3, 8)
    slots = torch.zeros(1, dtype=torch.int32)
    cu = torch.tensor([0, 5], dtype=torch.int32)
    has = torch.tensor([True])
    with pytest.raises(ValueError, match="conv_states must have shape"):
        LA.causal_conv1d_prefill(x, w, None, torch.zeros(2, 4, 8), slots, cu, has)
    with pytest.raises(ValueError, match="weight must have shape"):
        LA.causal_conv1d_prefill(x, torch.randn(7, 4), None, states, slots, cu, has)
    with pytest.raises(ValueError, match="at least 2 taps"):
        LA.causal_conv1d_prefill(x, torch.randn(8, 1), None, torch.zeros(2, 0, 8), slots, cu, has)
    with pytest.raises(ValueError, match="has_state must have shape"):
        LA.causal_conv1d_prefill(x, w, None, states, slots, cu, torch.tensor([True, False]))
    with pytest.raises(ValueError, match="slots must have shape"):
        LA.causal_conv1d_decode(x, w, None, states, slots)


@triton_test
@pytest.mark.parametrize("planned", [False, True])
def test_prefill_graph_padding_past_the_last_sequence(planned):
    """A CUDA graph's token bucket holds more tokens than the step's sequences (cu_seqlens ends
    before T): the padding tokens (NaN here) get zero outputs, the sequences' outputs and states
    are those of the unpadded call, and no slot is read for the padding (slots has N entries).
    `planned`: the token map comes from a step's plan (LA.plan_sequences), as the model passes it."""
    dev = test_device()
    gen = torch.Generator().manual_seed(13)
    d, k, lens, pad = 40, 4, (5, 2, 9), 7
    w, b = _weights(d, k, gen, dev, torch.float32)
    t = sum(lens)
    x = torch.randn(t + pad, d, generator=gen).to(dev)
    x[t:] = float("nan")
    slots = torch.tensor([2, 0, 3], dtype=torch.int32, device=dev)
    has = torch.tensor([True, False, True], device=dev)
    states = _pool(4, k, d, [0, 2, 3], gen, dev, torch.float32)
    ref_states = states.clone()
    cu = _cu(lens, dev)
    plan = LA.plan_sequences(cu, t + pad) if planned else None
    assert (plan is not None) == planned
    out = LA.causal_conv1d_prefill(x, w, b, states, slots, cu, has, plan=plan)
    want = K.causal_conv1d_reference(x[:t], w, b, ref_states, slots, cu, has)
    assert out.shape == (t + pad, d)
    torch.testing.assert_close(out[:t], want, atol=1e-5, rtol=1e-5)
    assert torch.equal(out[t:], torch.zeros(pad, d, device=dev))
    torch.testing.assert_close(states, ref_states, atol=1e-5, rtol=1e-5, equal_nan=True)


@triton_test
def test_verify_without_store_then_commit_accepted_prefix():
    """store_state=False (a speculative verify) gives the reference's outputs and leaves every
    window as it was; the accepted prefix run afterwards gives the window the reference gives
    after that prefix. NaN-poisoned other slots stay untouched."""
    dev = test_device()
    gen = torch.Generator().manual_seed(5)
    d, k = 20, 4
    lens, accepted = [5, 1, 3], [2, 1, 3]
    w, b = _weights(d, k, gen, dev, torch.float32)
    x = torch.randn(sum(lens), d, generator=gen).to(dev)
    slots = torch.tensor([3, 0, 1], dtype=torch.int32, device=dev)
    yes = torch.ones(3, dtype=torch.bool, device=dev)
    states = _pool(5, k, d, [3, 0, 1], gen, dev, torch.float32)
    before = states.clone()
    out = LA.causal_conv1d_prefill(x, w, b, states, slots, _cu(lens, dev), yes, store_state=False)
    torch.testing.assert_close(states, before, equal_nan=True, atol=0, rtol=0)
    want_out = K.causal_conv1d_reference(x, w, b, states.clone(), slots, _cu(lens, dev), yes)
    torch.testing.assert_close(out, want_out, atol=1e-5, rtol=1e-5)
    starts = _cu(lens, dev).tolist()[:-1]
    keep = torch.tensor([s + j for s, n in zip(starts, accepted) for j in range(n)], device=dev)
    want = states.clone()
    K.causal_conv1d_reference(x[keep], w, b, want, slots, _cu(accepted, dev), yes)
    LA.causal_conv1d_prefill(x[keep], w, b, states, slots, _cu(accepted, dev), yes)
    torch.testing.assert_close(states, want, equal_nan=True, atol=1e-6, rtol=1e-6)
    assert torch.isnan(states[[2, 4]]).all()
