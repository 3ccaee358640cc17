"""Speculative acceptance: the Triton kernel against its torch reference (same random numbers,
so the same tokens), the reference's exactness by statistics (each emitted token follows the
target's filtered distribution whatever the draft, and a wrong q is detected), greedy as the
argmax rule, and the Philox port against tl.philox.

Interpreted kernels are slow per program: CPU shapes are small; the `gpu` tests repeat the
comparison at a real vocabulary and the statistics with the compiled kernel."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from minisgl import env, ops
from minisgl.kernels import sampling as S
from minisgl.kernels import spec_accept as K

DEV = "cuda" if torch.cuda.is_available() else "cpu"
needs_triton = pytest.mark.skipif(
    DEV == "cpu" and not env.TRITON_INTERPRET, reason="Triton kernels need CUDA or TRITON_INTERPRET=1"
)
SMALL = {"BLOCK": 32, "NB": 8, "PER_LANE": 8, "num_warps": 4}


def make_batch(gen: torch.Generator, ks: list[int], v: int, rows: list[tuple], with_q: bool) -> dict:
    """Random logits; drafts drawn from q (with_q) or the argmax 70% of the time (greedy
    drafter), so acceptances and rejections both happen."""
    b, kmax = len(ks), max(ks)
    cu = torch.tensor([0, *np.cumsum([k + 1 for k in ks])], dtype=torch.int32)
    t = int(cu[-1])
    logits = torch.randn(t, v, generator=gen) * 2.5
    q = torch.softmax(logits + torch.randn(t, v, generator=gen), dim=-1) if with_q else None
    drafts = torch.randint(0, v, (b, max(kmax, 1)), generator=gen)
    for i, k in enumerate(ks):
        for j in range(k):
            r = int(cu[i]) + j
            if q is not None:
                drafts[i, j] = torch.multinomial(q[r], 1, generator=gen).item()
            elif torch.rand((), generator=gen) < 0.7:
                drafts[i, j] = logits[r].argmax()
    temp, top_k, top_p, min_p = zip(*rows)
    f32 = dict(dtype=torch.float32)
    args = dict(
        logits=logits, cu=cu, drafts=drafts, temperature=torch.tensor(temp, **f32),
        top_k=torch.tensor(top_k, dtype=torch.int32), top_p=torch.tensor(top_p, **f32),
        min_p=torch.tensor(min_p, **f32), seeds=torch.arange(b, dtype=torch.int64) * 7919 + 5,
        steps=torch.randint(0, 1000, (b,), generator=gen), q=q,
    )
    return {k: (a.to(DEV) if a is not None else None) for k, a in args.items()}


def new_tokens(out: tuple) -> list[list[int]]:
    tokens, _, n = out
    return [tokens[i, : int(n[i]) + 1].tolist() for i in range(len(n))]


# (temperature, top_k, top_p, min_p): greedy, plain, each filter, combined.
ROWS = [(0.0, -1, 1.0, 0.0), (1.0, -1, 1.0, 0.0), (0.8, 5, 1.0, 0.0), (1.0, -1, 0.9, 0.0),
        (1.2, 20, 0.8, 0.05), (0.7, -1, 1.0, 0.1), (1.0, 3, 0.5, 0.0), (0.0, -1, 1.0, 0.0)]
KS = [3, 0, 2, 3, 1, 2]  # k = 0: a request with an empty draft (a plain decode)


@pytest.mark.triton
@needs_triton
@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot-q", "sampled-q"])
def test_kernel_equals_reference(with_q: bool) -> None:
    gen = torch.Generator().manual_seed(11 + with_q)
    args = make_batch(gen, KS, 120, ROWS[: len(KS)], with_q)
    got = K.accept(**args, config=SMALL)
    want = K.accept_reference(**args, block=SMALL["BLOCK"])
    assert torch.equal(got[2], want[2]), "accepted counts differ"
    assert new_tokens(got) == new_tokens(want)
    for i, n in enumerate(want[2].tolist()):
        torch.testing.assert_close(got[1][i, : n + 1], want[1][i, : n + 1], rtol=1e-5, atol=1e-5)
    assert 0 < sum(want[2].tolist()) < sum(KS), "the batch should accept some drafts and reject others"


@pytest.mark.triton
@needs_triton
def test_empty_draft_samples_what_the_sampler_samples() -> None:
    """k = 0: the bonus draw uses the sampling kernel's counter and order, so it is its token."""
    gen = torch.Generator().manual_seed(3)
    rows = ROWS[1:6]
    args = make_batch(gen, [0] * len(rows), 120, rows, False)
    tokens, logprobs, n = K.accept(**args, config=SMALL)
    p = {k: args[k] for k in ("temperature", "top_k", "top_p", "min_p", "seeds", "steps")}
    want, want_lp = S.sample(args["logits"], **p, config=SMALL)
    assert torch.equal(n, torch.zeros_like(n))
    assert torch.equal(tokens[:, 0], want)
    torch.testing.assert_close(logprobs[:, 0], want_lp)


@pytest.mark.triton
@needs_triton
def test_a_greedy_drafter_leaves_seeded_tokens_as_the_sampler_draws_them() -> None:
    """One-hot q: every emitted token (accepted drafts, then the fallback or bonus) is the token
    the plain sampler draws from that row at (seed, step + j), whatever was drafted: so a seeded
    request samples the same tokens with and without speculation. Drafts here are the sampler's
    own token half the time (accepted) and a random token otherwise (mostly rejected)."""
    gen = torch.Generator().manual_seed(17)
    rows = [r for r in ROWS if r[0] > 0] * 2
    ks = [3, 2, 4, 1, 3, 2, 4, 1][: len(rows)]
    args = make_batch(gen, ks, 120, rows, False)
    cu = args["cu"].cpu().tolist()
    p = {k: args[k] for k in ("temperature", "top_k", "top_p", "min_p", "seeds")}
    plain = []  # the sampler's token for every row j of request b, at step steps[b] + j
    for b in range(len(ks)):
        idx = torch.arange(cu[b], cu[b + 1], device=DEV)
        n = len(idx)
        per = {k: v[b : b + 1].expand(n).contiguous() for k, v in p.items()}
        steps = args["steps"][b] + torch.arange(n, device=DEV)
        plain.append(S.sample(args["logits"][idx], **per, steps=steps, config=SMALL)[0].tolist())
    drafts = args["drafts"].clone()
    for b, k in enumerate(ks):
        for j in range(k):
            if torch.rand((), generator=gen) < 0.5:
                drafts[b, j] = plain[b][j]
    args["drafts"] = drafts
    for out in (K.accept(**args, config=SMALL), K.accept_reference(**args, block=SMALL["BLOCK"])):
        got = new_tokens(out)
        for b in range(len(ks)):
            assert got[b] == plain[b][: len(got[b])], f"request {b}: {got[b]} vs the sampler's {plain[b]}"
    accepted = sum(int(n) for n in K.accept_reference(**args, block=SMALL["BLOCK"])[2])
    assert 0 < accepted < sum(ks), "the batch should accept some drafts and reject others"


@pytest.mark.triton
@needs_triton
def test_philox_port_matches_triton() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def uniforms(Seeds, Ctr, Out0, Out1, N: tl.constexpr):
        i = tl.arange(0, N)
        step = tl.load(Ctr + i)
        zero = tl.zeros([N], tl.uint32)
        r0, r1, _, _ = tl.philox(tl.load(Seeds + i), (step & 0xFFFFFFFF).to(tl.uint32),
                                 ((step >> 32) & 0xFFFFFFFF).to(tl.uint32), zero, zero)
        tl.store(Out0 + i, tl.uint_to_uniform_float(r0))
        tl.store(Out1 + i, tl.uint_to_uniform_float(r1))

    seeds = torch.tensor([0, 1, 12345, 2**62 + 7, 2**40 + 3, 99, 7, 2**31], dtype=torch.int64)
    ctr = torch.tensor([0, 5, 1, 2**33 + 1, 17, 0, 2**32, 3], dtype=torch.int64)
    o0, o1 = torch.empty(8, device=DEV), torch.empty(8, device=DEV)
    uniforms[(1,)](seeds.to(DEV), ctr.to(DEV), o0, o1, N=8)
    u0, u1 = K.philox_uniforms(seeds.numpy(), ctr.numpy())
    assert np.array_equal(o0.cpu().numpy(), u0) and np.array_equal(o1.cpu().numpy(), u1)


def test_greedy_rule_and_logprobs() -> None:
    """Greedy rows accept the longest prefix equal to the argmax, then emit the argmax."""
    gen = torch.Generator().manual_seed(5)
    args = make_batch(gen, [4, 4, 2], 64, [(0.0, -1, 1.0, 0.0)] * 3, False)
    logits, drafts = args["logits"].cpu(), args["drafts"].cpu()
    drafts[0, :4] = logits[0:4].argmax(dim=1)  # all pass: the bonus is the last row's argmax
    drafts[1, 0] = logits[5].argmax()
    drafts[1, 1] = (logits[6].argmax() + 1) % 64  # second draft wrong
    args["drafts"] = drafts.to(DEV)
    for out in (K.accept_reference(**{**args, "drafts": drafts}), ops.spec_accept(**args)):
        toks = new_tokens(tuple(t.cpu() for t in out))
        assert toks[0] == logits[0:5].argmax(dim=1).tolist()
        assert toks[1] == logits[5:7].argmax(dim=1).tolist()
        assert len(toks[2]) >= 1
        lp = torch.log_softmax(logits, dim=1)
        assert torch.allclose(out[1].cpu()[0], lp[torch.arange(5), toks[0]], atol=1e-5)


def chi_square_p(counts: np.ndarray, probs: np.ndarray) -> float:
    """p-value of counts against probs; cells with expected < 5 pooled; a count where the
    probability is 0 is a failure by itself."""
    from scipy.stats import chisquare

    n = counts.sum()
    expected = probs * n
    assert counts[probs == 0].sum() == 0, "drew a token the target never samples"
    big = expected >= 5
    obs = np.append(counts[big], counts[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] == 0:
        obs, exp = obs[:-1], exp[:-1]
    return float(chisquare(obs, exp * obs.sum() / exp.sum()).pvalue)


SIGNIFICANCE = 1e-3  # per test; the data are seeded, so a pass is reproducible


def run_many(n: int, v: int, row: tuple, claim_q_uniform: bool = False) -> tuple[dict, torch.Tensor]:
    """n copies of one request with two drafts drawn from q, each with its own seed."""
    gen = torch.Generator().manual_seed(21)
    logits = torch.randn(3, v, generator=gen) * 1.5
    q1 = torch.softmax(torch.randn(3, v, generator=gen), dim=-1)
    q1[2] = 0.0  # the bonus row has no q
    drafts = torch.stack([torch.multinomial(q1[j], n, replacement=True, generator=gen) for j in range(2)], dim=1)
    q_claimed = torch.full_like(q1, 1.0 / v) if claim_q_uniform else q1
    temp, top_k, top_p, min_p = row
    args = dict(
        logits=logits.repeat(n, 1), cu=torch.arange(0, 3 * n + 1, 3, dtype=torch.int32), drafts=drafts,
        temperature=torch.full((n,), temp), top_k=torch.full((n,), top_k, dtype=torch.int32),
        top_p=torch.full((n,), top_p), min_p=torch.full((n,), min_p), seeds=torch.arange(n, dtype=torch.int64),
        steps=torch.full((n,), 3, dtype=torch.int64), q=q_claimed.repeat(n, 1),
    )
    p = S.filtered_probs_reference(logits, *(t[:3] for t in (args["temperature"], args["top_k"], args["top_p"],
                                                               args["min_p"])))
    return args, p


@pytest.mark.parametrize("row", [(1.0, -1, 1.0, 0.0), (1.0, -1, 0.9, 0.0), (1.0, 5, 1.0, 0.0)],
                         ids=["temperature-1", "top-p-0.9", "top-k-5"])
def test_rejection_sampling_is_exact(row: tuple) -> None:
    """First token ~ p0 whatever q; given the first draft accepted, the second ~ p1."""
    n, v = 20000, 12
    args, p = run_many(n, v, row)
    tokens, _, num = K.accept_reference(**args)
    first = np.bincount(tokens[:, 0].numpy(), minlength=v)
    assert chi_square_p(first, p[0].double().numpy()) > SIGNIFICANCE
    took = num >= 1
    second = np.bincount(tokens[took, 1].numpy(), minlength=v)
    assert took.sum() > 1000
    assert chi_square_p(second, p[1].double().numpy()) > SIGNIFICANCE


def test_a_wrong_q_is_detected() -> None:
    """The statistics have power: claiming q is uniform when drafts come from another q skews
    the first token away from p0."""
    args, p = run_many(20000, 12, (1.0, -1, 1.0, 0.0), claim_q_uniform=True)
    tokens, _, _ = K.accept_reference(**args)
    first = np.bincount(tokens[:, 0].numpy(), minlength=12)
    assert chi_square_p(first, p[0].double().numpy()) < 1e-6


def test_bad_arguments_name_the_argument() -> None:
    gen = torch.Generator().manual_seed(1)
    args = {k: (t.cpu() if t is not None else None)
            for k, t in make_batch(gen, [2, 1], 20, ROWS[:2], False).items()}
    with pytest.raises(ValueError, match="logits"):
        ops.spec_accept(**{**args, "logits": args["logits"].half()})
    with pytest.raises(ValueError, match="cu"):
        ops.spec_accept(**{**args, "cu": args["cu"][:2]})
    with pytest.raises(ValueError, match="drafts"):
        ops.spec_accept(**{**args, "drafts": args["drafts"].int()})
    with pytest.raises(ValueError, match="q"):
        ops.spec_accept(**{**args, "q": torch.rand(3, 20)})
    with pytest.raises(ValueError, match="seeds"):
        ops.spec_accept(**{**args, "seeds": args["seeds"][:1]})


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("with_q", [False, True], ids=["one-hot-q", "sampled-q"])
def test_gpu_kernel_equals_reference_at_real_vocab(with_q: bool) -> None:
    gen = torch.Generator().manual_seed(7)
    ks = [7, 4, 0, 1, 5, 2, 3, 6] * 4
    rows = [ROWS[i % len(ROWS)] for i in range(len(ks))]
    args = make_batch(gen, ks, 151_936 if not with_q else 32_000, rows, with_q)
    got = ops.spec_accept(**args)
    want = K.accept_reference(**args, block=S.default_config(torch.device("cuda"))["BLOCK"])
    # fp32 sums in another order can move a decision sitting on a rounding boundary: allow 1.
    mismatched = sum(a != b for a, b in zip(new_tokens(got), new_tokens(want)))
    assert mismatched <= 1


@pytest.mark.gpu
@pytest.mark.triton
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("row", [(1.0, -1, 1.0, 0.0), (1.0, -1, 0.9, 0.0), (1.0, 5, 1.0, 0.0)])
def test_gpu_kernel_is_exact(row: tuple) -> None:
    n, v = 100_000, 300
    args, p = run_many(n, v, row)
    tokens, _, num = ops.spec_accept(**{k: t.cuda() for k, t in args.items()})
    tokens, num = tokens.cpu(), num.cpu()
    assert chi_square_p(np.bincount(tokens[:, 0].numpy(), minlength=v), p[0].double().numpy()) > 1e-4
    took = num >= 1
    assert chi_square_p(np.bincount(tokens[took, 1].numpy(), minlength=v), p[1].double().numpy()) > 1e-4
