"""Gated delta rule (kernels/gated_delta_rule.py, gated_delta_solve.py, gated_delta_prefill.py,
chunk_table.py, through minisgl.ops): the torch reference vs transformers' own functions; the
Triton chunked prefill and the batch decode vs the recurrent reference on fresh random data
(lengths around the 64-token chunk, states carried across calls, GQA heads, NaN-poisoned unused pool slots left
bit-for-bit untouched); the chunk table vs torch.searchsorted."""

from __future__ import annotations

import pytest
import torch
from triton_marks import test_device, triton_test

from minisgl import env
from minisgl.kernels import chunk_table as CT
from minisgl.kernels import gated_delta_prefill as P
from minisgl.kernels import gated_delta_rule as K
from minisgl.kernels import gated_delta_solve as S
from minisgl.ops import linear_attention as LA

LENS = (1, 7, 63, 64, 65, 130)




def _inputs(t, hk, hv, dk, dv, dtype, gen, dev):
    def rnd(*shape):
        return torch.randn(*shape, generator=gen).to(dev)
    q, k = rnd(t, hk, dk).to(dtype), rnd(t, hk, dk).to(dtype)
    v = rnd(t, hv, dv).to(dtype)
    # g = -exp(A) * softplus(a + dt_bias), as the model computes it: log decays in (-inf, 0]
    g = (-torch.rand(hv, generator=gen).to(dev) * 2 * torch.nn.functional.softplus(rnd(t, hv))).float()
    beta = torch.sigmoid(rnd(t, hv)).to(dtype)
    return q, k, v, g, beta


def _pool(slots_total, hv, dk, dv, live, gen, dev):
    """A NaN-poisoned pool with random states at the `live` slots."""
    states = torch.full((slots_total, hv, dk, dv), float("nan"), device=dev)
    for s in live:
        states[s] = torch.randn(hv, dk, dv, generator=gen).to(dev) * 0.5
    return states


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.int32).clone()


def _cu(lens, dev):
    return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32, device=dev)


# --- the reference vs transformers ------------------------------------------------------

def test_reference_matches_transformers():
    from transformers.models.qwen3_next import modeling_qwen3_next as hf

    gen = torch.Generator().manual_seed(1)
    t, hk, hv, dk, dv = 37, 2, 4, 16, 8
    q, k, v, g, beta = _inputs(t, hk, hv, dk, dv, torch.float32, gen, "cpu")
    init = torch.randn(1, hv, dk, dv, generator=gen)
    want_o, want_s = hf.torch_recurrent_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=init.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    chunk_o, chunk_s = hf.torch_chunk_gated_delta_rule(
        q[None], k[None], v[None], g=g[None], beta=beta[None], initial_state=init.clone(),
        output_final_state=True, use_qk_l2norm_in_kernel=True)
    states = torch.full((3, hv, dk, dv), float("nan"))
    states[2] = init[0]
    o = K.gated_delta_rule_reference(q, k, v, g, beta, states, torch.tensor([2], dtype=torch.int32),
                                     _cu([t], "cpu"), torch.tensor([True]))
    torch.testing.assert_close(o, want_o[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(states[2], want_s[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(o, chunk_o[0], atol=1e-4, rtol=1e-4)  # HF's chunked form agrees too
    torch.testing.assert_close(states[2], chunk_s[0], atol=1e-4, rtol=1e-4)
    assert torch.isnan(states[:2]).all()


# --- the kernels vs the reference -----------------------------------------------------------

def _check_prefill(lens, hk, hv, dk, dv, dtype, atol, seed=0):
    dev = test_device()
    gen = torch.Generator().manual_seed(seed)
    t, n = sum(lens), len(lens)
    q, k, v, g, beta = _inputs(t, hk, hv, dk, dv, dtype, gen, dev)
    # sequence i uses slot 2i+1; every other one continues from a saved state; the last is a padding row
    slots = torch.tensor([2 * i + 1 for i in range(n - 1)] + [-1], dtype=torch.int32, device=dev)
    has = torch.tensor([i % 2 == 0 for i in range(n)], device=dev)
    states = _pool(2 * n + 1, hv, dk, dv, [2 * i + 1 for i in range(0, n - 1, 2)], gen, dev)
    ref_states = states.clone()
    cu = _cu(lens, dev)
    o = LA.gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu, has)
    want = K.gated_delta_rule_reference(q, k, v, g, beta, ref_states, slots, cu, has)
    assert o.dtype == dtype and o.shape == (t, hv, dv)
    torch.testing.assert_close(o.float(), want.float(), atol=atol, rtol=atol)
    live = [2 * i + 1 for i in range(n - 1)]
    torch.testing.assert_close(states[live], ref_states[live], atol=atol, rtol=atol)
    unused = [s for s in range(2 * n + 1) if s not in live]
    assert torch.equal(_bits(states[unused]), _bits(ref_states[unused]))  # NaN poison untouched
    assert torch.isnan(states[unused]).all()


@triton_test
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 2e-4), (torch.float16, 2e-2)])
def test_prefill_matches_recurrent(dtype, atol):
    _check_prefill(LENS, hk=2, hv=4, dk=16, dv=32, dtype=dtype, atol=atol)


@triton_test
def test_prefill_odd_head_dims():
    """Head dims that are not powers of two (masked tiles), equal q/k and v head counts."""
    _check_prefill((65, 3), hk=2, hv=2, dk=24, dv=40, dtype=torch.float32, atol=2e-4, seed=3)


@triton_test
def test_prefill_repeated_keys():
    """Near-identical keys, beta near 1 and almost no decay: the worst case for the chunk's
    (I + L)^-1 (its entries alternate in sign and do not shrink). Must still match."""
    dev = test_device()
    gen = torch.Generator().manual_seed(9)
    t, hk, hv, dk, dv = 128, 1, 2, 16, 16
    q, _, v, _, _ = _inputs(t, hk, hv, dk, dv, torch.float32, gen, dev)
    k = (torch.randn(1, hk, dk, generator=gen) + 0.01 * torch.randn(t, hk, dk, generator=gen)).to(dev)
    g = torch.full((t, hv), -1e-3, device=dev)
    beta = torch.full((t, hv), 0.99, device=dev)
    slot, no = torch.tensor([0], dtype=torch.int32, device=dev), torch.tensor([False], device=dev)
    a, b = _pool(1, hv, dk, dv, [], gen, dev), _pool(1, hv, dk, dv, [], gen, dev)
    o = LA.gated_delta_rule_prefill(q, k, v, g, beta, a, slot, _cu([t], dev), no)
    want = K.gated_delta_rule_reference(q, k, v, g, beta, b, slot, _cu([t], dev), no)
    torch.testing.assert_close(o, want, atol=1e-3, rtol=1e-3)
    torch.testing.assert_close(a, b, atol=1e-3, rtol=1e-3)


@triton_test
@pytest.mark.parametrize("split", [1, 64, 70])
def test_prefill_split_in_two_calls(split):
    """A 130-token sequence in two calls (state carried through the pool) equals one call."""
    dev = test_device()
    gen = torch.Generator().manual_seed(split)
    hk, hv, dk, dv, t = 1, 2, 16, 16, 130
    q, k, v, g, beta = _inputs(t, hk, hv, dk, dv, torch.float32, gen, dev)
    init = _pool(3, hv, dk, dv, [1], gen, dev)
    one, two = init.clone(), init.clone()
    slot = torch.tensor([1], dtype=torch.int32, device=dev)
    yes = torch.tensor([True], device=dev)
    o_one = LA.gated_delta_rule_prefill(q, k, v, g, beta, one, slot, _cu([t], dev), yes)
    parts = []
    for lo, hi in ((0, split), (split, t)):
        parts.append(LA.gated_delta_rule_prefill(
            q[lo:hi], k[lo:hi], v[lo:hi], g[lo:hi], beta[lo:hi], two, slot, _cu([hi - lo], dev), yes))
    torch.testing.assert_close(torch.cat(parts), o_one, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(two[1], one[1], atol=1e-4, rtol=1e-4)
    assert torch.isnan(two[[0, 2]]).all()


@triton_test
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-5), (torch.float16, 2e-3)])
def test_decode_batch(dtype, atol):
    """Three decode steps over a batch with a padding row; poisoned unused slots stay as they were."""
    dev = test_device()
    gen = torch.Generator().manual_seed(7)
    hk, hv, dk, dv, n = 2, 4, 16, 32, 5
    slots = torch.tensor([6, 0, -1, 3, 4], dtype=torch.int32, device=dev)
    states = _pool(8, hv, dk, dv, [6, 0, 3, 4], gen, dev)
    ref_states = states.clone()
    for step in range(3):
        q, k, v, g, beta = _inputs(n, hk, hv, dk, dv, dtype, gen, dev)
        o = LA.gated_delta_rule_decode(q, k, v, g, beta, states, slots)
        want = K.gated_delta_rule_reference(q, k, v, g, beta, ref_states, slots, _cu([1] * n, dev),
                                            torch.ones(n, dtype=torch.bool, device=dev))
        torch.testing.assert_close(o.float(), want.float(), atol=atol, rtol=atol, msg=f"step {step}")
    torch.testing.assert_close(states[[6, 0, 3, 4]], ref_states[[6, 0, 3, 4]], atol=1e-5, rtol=1e-5)
    assert torch.isnan(states[[1, 2, 5, 7]]).all()


@triton_test
def test_prefill_then_decode_equals_one_prefill():
    """Decode continues the state a chunked prefill left: the two kernels agree on the layout."""
    dev = test_device()
    gen = torch.Generator().manual_seed(11)
    hk, hv, dk, dv, t = 2, 4, 16, 16, 69
    q, k, v, g, beta = _inputs(t, hk, hv, dk, dv, torch.float32, gen, dev)
    slot = torch.tensor([0], dtype=torch.int32, device=dev)
    no = torch.tensor([False], device=dev)
    a, b = _pool(1, hv, dk, dv, [], gen, dev), _pool(1, hv, dk, dv, [], gen, dev)
    whole = LA.gated_delta_rule_prefill(q, k, v, g, beta, a, slot, _cu([t], dev), no)
    head = LA.gated_delta_rule_prefill(
        q[:-2], k[:-2], v[:-2], g[:-2], beta[:-2], b, slot, _cu([t - 2], dev), no)
    tail = [LA.gated_delta_rule_decode(
        q[i:i + 1], k[i:i + 1], v[i:i + 1], g[i:i + 1], beta[i:i + 1], b, slot) for i in (t - 2, t - 1)]
    torch.testing.assert_close(torch.cat([head, *tail]), whole, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(b, a, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-3), (torch.bfloat16, 3e-2)])
def test_prefill_real_shapes_gpu(dtype, atol):
    """Qwen3-Next's head shape (d 128, two v-heads per k-head) over long and short sequences."""
    _check_prefill((1, 63, 64, 65, 700, 2049), hk=4, hv=8, dk=128, dv=128, dtype=dtype, atol=atol)


@pytest.mark.gpu
def test_decode_real_shapes_gpu():
    dev = "cuda"
    gen = torch.Generator().manual_seed(5)
    hk, hv, dk, dv, n = 16, 32, 128, 128, 9
    q, k, v, g, beta = _inputs(n, hk, hv, dk, dv, torch.bfloat16, gen, dev)
    slots = torch.arange(1, 2 * n, 2, dtype=torch.int32, device=dev)
    states = _pool(2 * n + 1, hv, dk, dv, slots.tolist(), gen, dev)
    ref = states.clone()
    o = LA.gated_delta_rule_decode(q, k, v, g, beta, states, slots)
    want = K.gated_delta_rule_reference(q, k, v, g, beta, ref, slots, _cu([1] * n, dev),
                                        torch.ones(n, dtype=torch.bool, device=dev))
    torch.testing.assert_close(o.float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(states, ref, atol=1e-4, rtol=1e-4, equal_nan=True)


@triton_test
@pytest.mark.parametrize("seed", [0, 1])
def test_chunk_table_matches_searchsorted(seed):
    """The device-built chunk table (one Triton program) against torch's searchsorted: 37
    sequences with empty ones among them, a padded token count (a graph bucket)."""
    dev = test_device()
    gen = torch.Generator().manual_seed(seed)
    lens = torch.randint(0, 200, (37,), generator=gen)
    lens[[3, 17]] = 0
    t = int(lens.sum()) + 50
    cu = _cu(lens.tolist(), dev)
    seq, start, total = CT.chunk_table(cu, t, P.CHUNK)
    per_seq = (lens + P.CHUNK - 1) // P.CHUNK
    ccu = per_seq.cumsum(0)
    c = torch.arange(t // P.CHUNK + 38)
    want_seq = torch.searchsorted(ccu, c, right=True)
    active = want_seq < 37
    want_start = cu.cpu()[want_seq.clamp(max=36)] + (c - (ccu - per_seq)[want_seq.clamp(max=36)]) * P.CHUNK
    assert torch.equal(seq.cpu(), torch.where(active, want_seq, -1).int())
    assert torch.equal(start.cpu()[active], want_start[active].int())
    assert int(total) == int(ccu[-1])


# --- the kernels fit an H100 (compiled for sm_90 on the CPU, no GPU needed) ------------

@pytest.mark.slow
@pytest.mark.parametrize("half", [True, False])
def test_kernels_compile_for_sm90_within_shared_memory(half):
    """Compiles the prefill kernels at Qwen3-Next's shapes with the launch options the
    wrapper uses; a tile or pipelining change that overflows the H100's 227 KB of shared memory
    per block would otherwise first fail at launch on a GPU."""
    if env.TRITON_INTERPRET:
        pytest.skip("under TRITON_INTERPRET the kernels are interpreted functions, not compilable")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    dt = "bf16" if half else "fp32"
    types = {n: f"*{dt}" for n in ("Q", "K", "V", "Beta", "O", "X", "W", "U", "A")}
    types.update({n: "*fp32" for n in ("G", "S", "GC", "KS", "QF")}, scale="fp32")
    types["HasState"] = "*i1"
    types.update({n: "*i32" for n in ("Slots", "Cu", "ChunkSeq", "ChunkStart",
                                      "NumChunks")})
    kernels = [
        (S._gdr_kkt_solve_kernel, dict(GROUP=2, DK=128, BKC=64, BT=64, L2NORM=True, HALF=half), "kkt_solve"),
        (P._gdr_wu_kernel, dict(GROUP=2, DK=128, BT=64, L2NORM=True, HALF=half, DV=128, BV=64), "wu"),
        (P._gdr_state_kernel, dict(GROUP=2, DK=128, BK=128, BT=64, HALF=half, DV=128, BV=32, STORE=True), "state"),
        (P._gdr_state_kernel, dict(GROUP=2, DK=128, BK=128, BT=64, HALF=half, DV=128, BV=64, STORE=True), "state"),
        (P._gdr_wu_kernel, dict(GROUP=2, DK=128, BT=64, L2NORM=True, HALF=half, DV=128, BV=128), "wu"),
    ]
    kernels.append((CT._chunk_table_kernel, dict(BT=64, BN=512, BC=128), None))
    for fn, consts, name in kernels:
        sig = {n: types.get(n, "i32") for n in fn.arg_names} | {c: "constexpr" for c in consts}
        src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
        opts = P.launch_options(name, half) if name else {"num_warps": 4}
        compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options=opts)
        assert compiled.metadata.shared <= 227 * 1024, (fn.__name__, compiled.metadata.shared)


# --- bad input ------------------------------------------------------------------------

def test_bad_input_names_the_argument():
    q = torch.randn(4, 2, 16)
    v = torch.randn(4, 3, 16)
    g, beta = torch.randn(4, 3), torch.rand(4, 3)
    states = torch.zeros(2, 3, 16, 16)
    slots = torch.zeros(1, dtype=torch.int32)
    cu = torch.tensor([0, 4], dtype=torch.int32)
    has = torch.tensor([False])
    with pytest.raises(ValueError, match="multiple"):
        LA.gated_delta_rule_prefill(q, q, v, g, beta, states, slots, cu, has)
    v = torch.randn(4, 4, 16)
    with pytest.raises(ValueError, match="g must have dtype float32"):
        LA.gated_delta_rule_prefill(q, q, v, g.half(), beta, states, slots, cu, has)
    with pytest.raises(ValueError, match="states must have shape"):
        LA.gated_delta_rule_prefill(q, q, v, torch.randn(4, 4), torch.rand(4, 4), states, slots, cu, has)
    with pytest.raises(ValueError, match="cu_seqlens must have dtype int32"):
        LA.gated_delta_rule_prefill(q, q, v, torch.randn(4, 4), torch.rand(4, 4), torch.zeros(2, 4, 16, 16),
                                    slots, cu.long(), has)
    other = LA.SequencePlan(cu.clone(), 4, torch.zeros(4, dtype=torch.int32), ())
    with pytest.raises(ValueError, match="plan was made for other sequences"):
        LA.gated_delta_rule_prefill(q, q, v, torch.randn(4, 4), torch.rand(4, 4), torch.zeros(2, 4, 16, 16),
                                    slots, cu, has, plan=other)
    with pytest.raises(ValueError, match="slots must have shape"):
        LA.gated_delta_rule_decode(q, q, v, torch.randn(4, 4), torch.rand(4, 4), torch.zeros(2, 4, 16, 16), slots)


@triton_test
@pytest.mark.parametrize("planned", [False, True])
def test_prefill_graph_padding_past_the_last_sequence(planned):
    """cu_seqlens ends before T (a CUDA graph's token bucket): the padding tokens (NaN inputs)
    get zero outputs; the sequences' outputs and states are the unpadded call's. `planned`: the
    chunk table comes from a step's plan (LA.plan_sequences), as the model passes it."""
    dev = test_device()
    gen = torch.Generator().manual_seed(17)
    hk, hv, dk, dv, lens, pad = 2, 4, 16, 16, (70, 3), 9
    t = sum(lens)
    q, k, v, g, beta = _inputs(t + pad, hk, hv, dk, dv, torch.float32, gen, dev)
    for x in (q, k, v, g, beta):
        x[t:] = float("nan")
    slots = torch.tensor([1, 0], dtype=torch.int32, device=dev)
    has = torch.tensor([True, False], device=dev)
    states = _pool(3, hv, dk, dv, [1], gen, dev)
    ref = states.clone()
    cu = _cu(lens, dev)
    plan = LA.plan_sequences(cu, t + pad) if planned else None
    assert (plan is not None) == planned
    o = LA.gated_delta_rule_prefill(q, k, v, g, beta, states, slots, cu, has, plan=plan)
    want = K.gated_delta_rule_reference(q[:t], k[:t], v[:t], g[:t], beta[:t], ref, slots, cu, has)
    torch.testing.assert_close(o[:t], want, atol=2e-4, rtol=2e-4)
    assert torch.equal(o[t:], torch.zeros(pad, hv, dv, device=dev))
    torch.testing.assert_close(states, ref, atol=2e-4, rtol=2e-4, equal_nan=True)


@triton_test
@pytest.mark.parametrize("dtype,atol", [(torch.float32, 1e-4), (torch.float16, 2e-2)])
def test_verify_without_store_then_commit_accepted_prefix(dtype, atol):
    """A speculative verify reads the states and writes none (store_state=False), its outputs
    the recurrent reference's; running only the accepted prefix of each sequence afterwards
    leaves the state the reference leaves after that prefix. NaN-poisoned other slots untouched."""
    dev = test_device()
    gen = torch.Generator().manual_seed(23)
    hk, hv, dk, dv = 2, 4, 16, 16
    lens, accepted = [5, 1, 3], [2, 1, 3]
    slots = torch.tensor([4, 0, 2], dtype=torch.int32, device=dev)
    yes = torch.ones(3, dtype=torch.bool, device=dev)
    q, k, v, g, beta = _inputs(sum(lens), hk, hv, dk, dv, dtype, gen, dev)
    states = _pool(6, hv, dk, dv, [4, 0, 2], gen, dev)
    before = _bits(states)
    o_verify = LA.gated_delta_rule_prefill(q, k, v, g, beta, states, slots, _cu(lens, dev), yes, store_state=False)
    assert torch.equal(_bits(states), before)
    o_ref = K.gated_delta_rule_reference(q, k, v, g, beta, states.clone(), slots, _cu(lens, dev), yes)
    torch.testing.assert_close(o_verify.float(), o_ref.float(), atol=atol, rtol=atol)
    starts = _cu(lens, dev).tolist()[:-1]
    keep = torch.tensor([s + j for s, n in zip(starts, accepted) for j in range(n)], device=dev)
    want = states.clone()
    K.gated_delta_rule_reference(q[keep], k[keep], v[keep], g[keep], beta[keep], want, slots, _cu(accepted, dev), yes)
    LA.gated_delta_rule_prefill(q[keep], k[keep], v[keep], g[keep], beta[keep], states, slots, _cu(accepted, dev), yes)
    torch.testing.assert_close(states[[4, 0, 2]], want[[4, 0, 2]], atol=atol, rtol=atol)
    assert torch.isnan(states[[1, 3, 5]]).all()
