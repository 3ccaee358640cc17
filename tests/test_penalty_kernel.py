"""The penalty / logit-bias / ban op: the Triton kernel against its torch reference and against
an independent per-token statement of the math (fp64 loops over dicts), on fresh random logits
and histories; selected rows change exactly as stated, every other row keeps its bits (NaN
poison included); bad arguments are refused by name. GPU: real vocabulary, graph replay."""

from __future__ import annotations

import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import penalties as K

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)


def make_case(b: int, v: int, seed: int, dtype: torch.dtype, device: str = DEV) -> dict:
    """A batch of b rows where the selected ones cover: each penalty alone, all together, bias
    only, bias + ban (-inf) at the vocabulary edges (ids 0 and V-1), and nothing at all (a row
    that is selected but a no-op). Unselected rows are NaN-poisoned."""
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(b, v, generator=g) * 3).to(dtype)
    num_state = b + 3
    counts = torch.zeros(num_state, v, dtype=torch.int32)
    prompt = torch.zeros(num_state, v, dtype=torch.uint8)
    for r in range(num_state):  # sparse random histories, edge ids included
        ids = torch.randint(0, v, (int(torch.randint(1, v // 3, (1,), generator=g)),), generator=g)
        counts[r].index_add_(0, ids, torch.ones_like(ids, dtype=torch.int32))
        counts[r, [0, v - 1]] += torch.randint(0, 3, (2,), generator=g, dtype=torch.int32)
        prompt[r, torch.randint(0, v, (v // 4,), generator=g)] = 1
        prompt[r, v - 1] = 1
    # (rep, pres, freq, bias): per selected row
    kinds = [
        (1.3, 0.0, 0.0, {}), (1.0, 0.7, 0.0, {}), (1.0, 0.0, -0.4, {}), (0.8, -1.5, 1.2, {}),
        (1.0, 0.0, 0.0, {0: 2.5, v - 1: -100.0, v // 2: 7.0, min(127, v - 2): 1.25, min(128, v - 3): -4.0}),
        (1.7, 0.3, 0.6, {0: float("-inf"), v - 1: float("-inf"), 3: -0.5}),
        (1.0, 0.0, 0.0, {}),
    ]
    sel = torch.randperm(b, generator=g)[: len(kinds)].tolist()
    poisoned = [r for r in range(b) if r not in sel]
    logits[poisoned] = float("nan")
    state = torch.randperm(num_state, generator=g)[: len(kinds)].tolist()
    ptr, ids, vals = [0], [], []
    for _, _, _, bias in kinds:
        ids += list(bias)
        vals += list(bias.values())
        ptr.append(len(ids))
    i32 = dict(dtype=torch.int32, device=device)
    f32 = dict(dtype=torch.float32, device=device)
    args = dict(
        rows=torch.tensor(sel, **i32), state_rows=torch.tensor(state, **i32),
        counts=counts.to(device), prompt=prompt.to(device),
        rep=torch.tensor([k[0] for k in kinds], **f32), pres=torch.tensor([k[1] for k in kinds], **f32),
        freq=torch.tensor([k[2] for k in kinds], **f32),
        bias_ptr=torch.tensor(ptr, **i32), bias_ids=torch.tensor(ids, **i32), bias_vals=torch.tensor(vals, **f32),
    )
    return {"logits": logits.to(device), "args": args, "kinds": kinds, "sel": sel, "state": state,
            "poisoned": poisoned}


def independent(case: dict) -> torch.Tensor:
    """The stated math, token by token in Python floats (fp64) over dicts, no vectorized masks."""
    out = case["logits"].double().cpu().clone()
    counts, prompt = case["args"]["counts"].cpu(), case["args"]["prompt"].cpu()
    for row, s, (rep, pres, freq, bias) in zip(case["sel"], case["state"], case["kinds"]):
        x = out[row].tolist()
        generated = {t: c for t, c in enumerate(counts[s].tolist()) if c > 0}
        in_prompt = {t for t, p in enumerate(prompt[s].tolist()) if p}
        for t in set(generated) | in_prompt:
            if rep != 1.0:
                x[t] = x[t] / rep if x[t] > 0 else x[t] * rep
            c = generated.get(t, 0)
            x[t] = x[t] - freq * c - pres * (1.0 if c > 0 else 0.0)
        for t, val in bias.items():
            x[t] = x[t] + val
        out[row] = torch.tensor(x, dtype=torch.float64)
    return out


def run(case: dict, fn) -> torch.Tensor:
    logits = case["logits"].clone()
    fn(logits, **case["args"])
    return logits


def assert_matches(got: torch.Tensor, case: dict, want: torch.Tensor, dtype: torch.dtype) -> None:
    sel, poisoned = case["sel"], case["poisoned"]
    # Unselected rows: untouched, bit for bit (NaN stays NaN).
    assert torch.isnan(got[poisoned]).all()
    # fp32: a few ulps (FMA contraction on the GPU); 16-bit: one rounding of the output.
    tol = {torch.float32: dict(rtol=1e-6, atol=1e-5), torch.float16: dict(rtol=2e-3, atol=2e-3),
           torch.bfloat16: dict(rtol=1.6e-2, atol=1.6e-2)}[dtype]
    torch.testing.assert_close(got[sel].double().cpu(), want[sel].to(dtype).double(), **tol)


@needs_triton
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("v", [37, 300])
@pytest.mark.parametrize("config", [None, {"CHUNK": 512, "BLOCK": 64}], ids=["chunks-of-128", "one-chunk"])
def test_kernel_equals_reference_and_the_stated_math(dtype: torch.dtype, v: int, config: dict | None) -> None:
    """Default CPU config: chunks of 128 in steps of 32 (bias ids at chunk edges 127/128)."""
    for seed in range(2):
        case = make_case(11, v, seed, dtype)
        got = run(case, lambda *a, **k: K.apply_penalties(*a, **k, config=config))
        ref = run(case, K.apply_penalties_reference)
        want = independent(case)
        assert_matches(got, case, want, dtype)
        assert_matches(ref, case, want, dtype)
        torch.testing.assert_close(got, ref, rtol=1e-6, atol=1e-6, equal_nan=True)
        # Banned ids are -inf exactly; a no-op row keeps its bits.
        assert got[case["sel"][5], 0] == float("-inf") and got[case["sel"][5], v - 1] == float("-inf")
        assert torch.equal(got[case["sel"][6]], case["logits"][case["sel"][6]])


@needs_triton
@pytest.mark.triton
def test_op_wrapper_runs_the_kernel_and_many_bias_entries() -> None:
    """More bias entries per row than one block of lanes (64) and an empty selection."""
    v = 500
    case = make_case(9, v, 7, torch.float32)
    big = {t: float(t % 13) - 6.0 for t in range(0, v, 3)}  # 167 entries
    case["kinds"][4] = (1.0, 0.0, 0.0, big)
    ptr, ids, vals = [0], [], []
    for *_, bias in case["kinds"]:
        ids += list(bias)
        vals += list(bias.values())
        ptr.append(len(ids))
    a = case["args"]
    a["bias_ptr"] = torch.tensor(ptr, dtype=torch.int32, device=DEV)
    a["bias_ids"] = torch.tensor(ids, dtype=torch.int32, device=DEV)
    a["bias_vals"] = torch.tensor(vals, dtype=torch.float32, device=DEV)
    got = run(case, ops.apply_penalties)
    assert_matches(got, case, independent(case), torch.float32)
    empty = {k: (t[:0] if k not in ("counts", "prompt", "bias_ptr") else t) for k, t in a.items()}
    empty["bias_ptr"] = a["bias_ptr"][:1]
    logits = case["logits"].clone()
    ops.apply_penalties(logits, **empty)
    assert torch.equal(logits.nan_to_num(), case["logits"].nan_to_num())


def test_reference_on_cpu_without_interpreter() -> None:
    """The torch reference (the CPU engine path) against the stated math, fp32 and fp16."""
    for dtype in (torch.float32, torch.float16):
        case = make_case(10, 301, 3, dtype, device="cpu")
        assert_matches(run(case, K.apply_penalties_reference), case, independent(case), dtype)


def test_bad_arguments_name_the_argument() -> None:
    case = make_case(8, 40, 1, torch.float32, device="cpu")
    a = case["args"]
    bad = [
        ("logits", {"logits": case["logits"].double()}),
        ("logits", {"logits": case["logits"].t()}),
        ("rows", {"rows": a["rows"].long()}),
        ("state_rows", {"state_rows": a["state_rows"][:2]}),
        ("rep", {"rep": a["rep"].double()}),
        ("bias_ptr", {"bias_ptr": a["bias_ptr"][:-1]}),
        ("bias_vals", {"bias_vals": a["bias_vals"][:1]}),
        ("counts", {"counts": a["counts"][:, :5]}),
        ("prompt", {"prompt": a["prompt"].bool()}),
    ]
    for name, change in bad:
        kw = {"logits": case["logits"].clone(), **a, **change}
        with pytest.raises(ValueError, match=name):
            ops.apply_penalties(**kw)


# ---- GPU ----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_kernel_at_real_vocab_and_graph_replay(dtype: torch.dtype) -> None:
    v = 151_936
    case = make_case(64, v, 5, dtype, device="cuda")
    want = independent(case)
    # Every tile candidate the benchmark times is correct (the default comes from there).
    for cfg in ({"CHUNK": 1 << 30, "BLOCK": 4096, "num_warps": 8}, {"CHUNK": 4096, "BLOCK": 1024, "num_warps": 4},
                {"CHUNK": 8192, "BLOCK": 2048, "num_warps": 8}, {"CHUNK": 32768, "BLOCK": 4096, "num_warps": 8}):
        assert_matches(run(case, lambda *a, cfg=cfg, **k: K.apply_penalties(*a, **k, config=cfg)), case, want, dtype)
    eager = run(case, K.apply_penalties)
    assert_matches(eager, case, want, dtype)
    torch.testing.assert_close(eager, run(case, K.apply_penalties_reference), rtol=1e-6, atol=1e-6, equal_nan=True)
    # Captured once; replayed after fresh data was written into the same buffers: equal to an
    # eager call on a copy of that data.
    a, static = case["args"], case["logits"].clone()
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        ops.apply_penalties(static, **a)  # warm up (compile) outside capture
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ops.apply_penalties(static, **a)
    g = torch.Generator(device="cuda").manual_seed(9)
    for _ in range(2):
        static.copy_(torch.randn(static.shape, device="cuda", generator=g) * 3)
        a["counts"].copy_(torch.randint(0, 3, a["counts"].shape, device="cuda", generator=g, dtype=torch.int32))
        a["prompt"].copy_(torch.randint(0, 2, a["prompt"].shape, device="cuda", generator=g, dtype=torch.uint8))
        a["rep"].copy_(torch.rand(a["rep"].shape, device="cuda", generator=g) + 0.5)
        a["bias_vals"].copy_(torch.randn(a["bias_vals"].shape, device="cuda", generator=g))
        want = static.clone()
        ops.apply_penalties(want, **a)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static, want)
