"""The skinny-GEMM dispatch: the table (choices from timings, lookup, the on-disk cache), the
measurement plan under a budget (fake timers and clocks, on the CPU), the layers' GEMM list;
on the GPU, the real measurement, ops.linear through the table and under CUDA graphs."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from minisgl import env, ops
from minisgl.distributed.info import TPInfo
from minisgl.layers.linear import MergedColumnParallelLinear
from minisgl.ops.gemm import table as gt
from minisgl.ops.gemm.dispatch import install_table, skinny_enabled
from minisgl.ops.gemm.skinny import SkinnyConfig
from minisgl.ops.gemm.table import CUBLAS, GemmShape, GemmTable, candidate_configs, choose, split_counts
from minisgl.ops.gemm.tuning import build_table

_needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
SHAPES = ((1, 2, 32), (1, 4, 32), (2, 2, 32), (2, 4, 16))  # tile_shapes() of the current build
QKV = GemmShape("bfloat16", 6144, 4096, False)
GATE_UP = GemmShape("bfloat16", 28672, 4096, True)


def gpu(fn):
    return pytest.mark.gpu(_needs_cuda(fn))


def test_choose_needs_a_margin_over_cublas() -> None:
    assert choose({CUBLAS: 10.0, "t1w4s1": 9.0}) == "t1w4s1"
    assert choose({CUBLAS: 10.0, "t1w4s1": 9.95, "t0w4s1": 11.0}) == CUBLAS  # within 1%: noise
    assert choose({CUBLAS: 10.0, "t1w4s1": 12.0}) == CUBLAS
    assert choose({"t1w4s1": 12.0, "t0w4s2": 11.0}) == "t0w4s2"
    with pytest.raises(ValueError, match="no timings"):
        choose({})


def test_lookup_rounds_m_up_and_defaults_to_cublas() -> None:
    t = GemmTable()
    t.set(QKV, 1, "t1w4s2")
    t.set(QKV, 4, CUBLAS)
    t.set(QKV, 8, "t0w8s1")
    assert t.lookup(QKV, 1) == SkinnyConfig(1, 4, 2)
    assert t.lookup(QKV, 2) is None and t.lookup(QKV, 4) is None  # M 2 runs as 4: cuBLAS
    assert t.lookup(QKV, 5) == t.lookup(QKV, 8) == SkinnyConfig(0, 8, 1)
    assert t.lookup(QKV, 9) is None  # past the largest measured M
    assert t.lookup(GATE_UP, 1) is None  # never measured
    assert t.has(QKV, 4) and not t.has(QKV, 2)


def test_table_text_round_trip_and_bad_entries() -> None:
    t = GemmTable()
    t.set(QKV, 1, "t1w4s2")
    t.set(GATE_UP, 32, CUBLAS)
    d = t.to_dict()
    assert d == {"bfloat16,6144,4096,0,1": "t1w4s2", "bfloat16,28672,4096,1,32": CUBLAS}
    assert GemmTable.from_dict(d).to_dict() == d
    with pytest.raises(ValueError, match="not a GEMM table key"):
        GemmTable.from_dict({"bfloat16,6144,4096": "t1w4s2"})
    with pytest.raises(ValueError, match="not a skinny GEMM config"):
        t.set(QKV, 2, "fast")


def test_cache_round_trip_keys_versions_and_ranks(tmp_path) -> None:
    path = tmp_path / "sub" / "skinny_gemm.json"
    assert gt.load_cache(path, "H100").to_dict() == {}  # no file yet
    a, b = GemmTable(), GemmTable()
    a.set(QKV, 1, "t1w4s2")
    b.set(GATE_UP, 1, CUBLAS)
    gt.save_cache(path, "H100", a)
    gt.save_cache(path, "H100", b)  # a second rank / a later start: merged, not replaced
    gt.save_cache(path, "A100", b)
    assert gt.load_cache(path, "H100").to_dict() == {**a.to_dict(), **b.to_dict()}
    assert gt.load_cache(path, "A100").to_dict() == b.to_dict()
    assert gt.load_cache(path, "L4").to_dict() == {}
    assert [p.name for p in path.parent.iterdir()] == ["skinny_gemm.json"]  # no temporary files left
    data = json.loads(path.read_text())
    data["version"] = gt.TABLE_VERSION + 1
    path.write_text(json.dumps(data))
    assert gt.load_cache(path, "H100").to_dict() == {}  # an older/newer kernel's table is ignored
    path.write_text("{not json")
    assert gt.load_cache(path, "H100").to_dict() == {}
    gt.save_cache(path, "H100", a)  # a corrupt file is replaced
    assert gt.load_cache(path, "H100").to_dict() == a.to_dict()


def test_split_counts_and_candidates() -> None:
    # 512 blocks: ~4 per SM on 132 SMs, no split; 256 blocks (< 2 per SM): one doubling.
    assert split_counts(512, 4096, 4, 128, 132) == [1]
    assert split_counts(256, 4096, 4, 128, 132) == [1, 2]
    # 64 blocks (N = 1024): splits until ~2 blocks per SM, each warp >= one group of K.
    assert split_counts(64, 4096, 4, 128, 132) == [1, 2, 4, 8]
    assert split_counts(64, 1024, 4, 128, 132) == [1, 2]  # 1024 / 4 = 256 < 4 warps x 128
    cands = candidate_configs(32, 8192, 4096, False, SHAPES, 132, pairs=((1, 4), (3, 4), (9, 4)))
    assert cands == [SkinnyConfig(1, 4, 1)]  # tile 3 takes M <= 16, tile 9 does not exist
    silu = candidate_configs(1, 512, 4096, True, SHAPES, 132, pairs=((0, 4),))
    assert [c.splits for c in silu] == [1, 2, 4, 8]  # 512 / 8 = 64 blocks; groups of 64: 4096 / 8 >= 4 x 64


def _fake(times: dict[tuple[GemmShape, int, str], float], calls: list):
    def timer(shape: GemmShape, m: int, choice: str) -> float:
        calls.append((shape, m, choice))
        return times.get((shape, m, choice), 100.0)

    return timer


def _cands(shape: GemmShape, m: int) -> list[SkinnyConfig]:
    return [SkinnyConfig(1, 4, 1), SkinnyConfig(0, 4, 2)]


def test_build_table_picks_the_fastest_and_keeps_the_cache() -> None:
    times = {(QKV, 1, CUBLAS): 20.0, (QKV, 1, "t0w4s2"): 15.0, (QKV, 2, CUBLAS): 5.0}
    cached = GemmTable()
    cached.set(GATE_UP, 1, "t1w4s1")
    cached.set(GATE_UP, 2, CUBLAS)
    calls: list = []
    table, fresh, skipped = build_table([QKV, GATE_UP], [1, 2], cached, _cands, _fake(times, calls))
    assert skipped == 0
    assert table.lookup(QKV, 1) == SkinnyConfig(0, 4, 2) and table.lookup(QKV, 2) is None
    assert table.lookup(GATE_UP, 1) == SkinnyConfig(1, 4, 1)  # from the cache, not re-timed
    assert {s for s, _, _ in calls} == {QKV}
    assert fresh.to_dict() == {"bfloat16,6144,4096,0,1": "t0w4s2", "bfloat16,6144,4096,0,2": CUBLAS}


def test_build_table_budget_measures_small_m_and_big_weights_first() -> None:
    clock = iter(float(i) for i in range(100))  # each look at the clock: one more second
    calls: list = []
    table, fresh, skipped = build_table(
        [QKV, GATE_UP], [4, 1], GemmTable(), _cands, _fake({}, calls), budget_s=1.5, clock=lambda: next(clock)
    )
    # start = 0; entry 1 at t = 1, entry 2 at t = 2 > 1.5: stop.
    assert [(s, m) for s, m, c in calls if c == CUBLAS] == [(GATE_UP, 1)]
    assert skipped == 3 and fresh.to_dict() == table.to_dict()
    assert table.lookup(QKV, 1) is None  # not measured: cuBLAS


def test_layers_list_their_gemms_with_the_silu_epilogue() -> None:
    from minisgl.core.model_config import ModelConfig
    from minisgl.distributed.communicator import make_communicator
    from minisgl.layers.linear import gemm_calls
    from minisgl.models.llama import LlamaForCausalLM

    cfg = ModelConfig.from_dict(
        {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 96,
         "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 2, "vocab_size": 100,
         "tie_word_embeddings": True, "max_position_embeddings": 64}
    )
    tp = TPInfo(0, 1)
    comm, _ = make_communicator(tp, torch.device("cpu"), None, False)
    model = LlamaForCausalLM(cfg, tp, comm, 64, torch.device("cpu"))
    calls = gemm_calls(model)
    shapes = sorted((tuple(w.shape), silu) for w, silu, *_ in calls)
    assert shapes == sorted([((128, 64), False), ((64, 64), False), ((192, 64), True), ((64, 96), False)] * 2
                            + [((100, 64), False)])
    assert any(c.weight is model.model.embed_tokens.weight for c in calls)  # tied LM head
    x = torch.randn(3, 64)
    mlp = model.model.layers[0].mlp
    mlp.gate_up_proj.weight.data.normal_()
    want = ops.silu_and_mul(F.linear(x, mlp.gate_up_proj.weight))
    torch.testing.assert_close(mlp.gate_up_proj(x), want, rtol=0, atol=0)
    with pytest.raises(ValueError, match="silu_and_mul needs two equal parts"):
        MergedColumnParallelLinear(64, [32, 16], False, tp, silu_and_mul=True)


def test_cpu_linear_is_torch_and_the_switch(monkeypatch) -> None:
    x, w, b = torch.randn(4, 32), torch.randn(48, 32), torch.randn(48)
    assert torch.equal(ops.linear(x, w, b), F.linear(x, w, b))
    assert torch.equal(ops.linear(x, w, b, silu=True), ops.silu_and_mul(F.linear(x, w, b)))
    assert not skinny_enabled(torch.device("cpu"))
    monkeypatch.setattr(env, "DISABLE_SKINNY_GEMM", True)
    assert not skinny_enabled(torch.device("cuda", 0))


# ---- GPU ----


@gpu
def test_linear_follows_the_table_and_graphs_keep_the_choice(monkeypatch) -> None:
    from minisgl.ops.gemm.dispatch import table_for

    dev = torch.device("cuda", torch.cuda.current_device())
    saved = table_for(dev)
    x8 = torch.randn(8, 4096, device=dev, dtype=torch.bfloat16)
    w = torch.randn(2 * 1024, 4096, device=dev, dtype=torch.bfloat16) / 64
    t = GemmTable()
    shape = GemmShape("bfloat16", 2048, 4096, True)
    t.set(shape, 1, "t1w4s4")
    t.set(shape, 8, CUBLAS)
    try:
        install_table(dev, t)
        ours = ops.linear(x8[:1], w, silu=True)
        assert torch.equal(ours, ops.skinny_gemm(x8[:1], w, silu=True, config=SkinnyConfig(1, 4, 4)))
        assert torch.equal(ops.linear(x8, w, silu=True), ops.silu_and_mul(F.linear(x8, w)))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            g1, g8 = ops.linear(x8[:1], w, silu=True), ops.linear(x8, w, silu=True)
        install_table(dev, GemmTable())  # a later change of the table does not reach the graph
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(g1, ours) and torch.equal(g8, ops.silu_and_mul(F.linear(x8, w)))
    finally:
        install_table(dev, saved if saved is not None else GemmTable())


@gpu
def test_tune_gemms_measures_then_reads_the_cache(monkeypatch, tmp_path, caplog) -> None:
    from minisgl.ops.gemm import tuning as gemm_tuning

    monkeypatch.setattr(env, "CACHE_DIR", str(tmp_path))
    dev = torch.device("cuda", torch.cuda.current_device())
    ws = [torch.randn(1024, 2048, device=dev, dtype=torch.bfloat16) for _ in range(4)]
    gu = torch.randn(2 * 1536, 1024, device=dev, dtype=torch.bfloat16)
    calls = [(w, False) for w in ws] + [(gu, True)]
    table = gemm_tuning.tune_gemms(calls, dev, [1, 2, 4])
    assert table is not None
    for shape in (GemmShape("bfloat16", 1024, 2048, False), GemmShape("bfloat16", 3072, 1024, True)):
        assert all(table.has(shape, m) for m in (1, 2, 4))
    assert (tmp_path / gemm_tuning.CACHE_FILE).exists()
    class NoTimer:
        def __init__(self, *args: object) -> None:
            pass

        def __call__(self, *args: object) -> float:
            raise AssertionError("a start with every entry cached timed something")

    monkeypatch.setattr(gemm_tuning, "GraphTimer", NoTimer)
    again = gemm_tuning.tune_gemms(calls, dev, [1, 4])
    assert again is not None and again.to_dict() == table.to_dict()


def test_four_bit_shapes_name_their_format_and_group() -> None:
    """A 4-bit layer's table key: INT4 with its group (groups of a multiple of 128 take another
    loader path), MXFP4; `shape_format` reads any key's format back. The INT4 zero points and
    MXFP4's scales per 32 give (K, group); shapes the kernel cannot take have no key."""
    from minisgl.ops.gemm.table import GemmCall, shape_format, table_dtype, w4_shape
    from minisgl.ops.gemm.tuning import call_shape

    assert [table_dtype(torch.bfloat16, f, block=b, group=g) for f, b, g in
            (("dense", False, 0), ("fp8", True, 0), ("fp8", False, 0), ("int4", False, 128), ("mxfp4", False, 0))] == \
        ["bfloat16", "bfloat16-fp8block", "bfloat16-fp8chan", "bfloat16-int4g128", "bfloat16-mxfp4"]
    for d, f in (("float16", "dense"), ("bfloat16-fp8block", "fp8"), ("float16-int4g32", "int4"),
                 ("bfloat16-mxfp4", "mxfp4")):
        assert shape_format(d) == f
    with pytest.raises(ValueError, match="not a GEMM table dtype"):
        shape_format("bfloat16-nf4")
    qw = torch.zeros(96, 4096 // 8, dtype=torch.int32)
    c = GemmCall(qw, True, "int4", torch.ones(96, 4096 // 128), 0, torch.zeros(96, 4096 // 128))
    assert call_shape(c, torch.bfloat16) == GemmShape("bfloat16-int4g128", 96, 4096, True)
    # the dispatch's key of the same call (ops/gemm/dispatch.py builds it with w4_shape too)
    assert w4_shape(torch.bfloat16, "int4", 96, 4096 // 8, 4096 // 128, True) == call_shape(c, torch.bfloat16)
    assert call_shape(c, torch.float32) is None  # the kernel takes 16-bit activations
    odd = GemmCall(torch.zeros(96, 72 // 8, dtype=torch.int32), False, "int4", torch.ones(96, 1), 0, torch.ones(96, 1))
    assert call_shape(odd, torch.float16) is None  # K 72: not a multiple of 32
    blocks, e8m0 = torch.zeros(64, 2880 // 2, dtype=torch.uint8), torch.zeros(64, 2880 // 32, dtype=torch.uint8)
    mx = GemmCall(blocks, False, "mxfp4", e8m0)
    assert call_shape(mx, torch.bfloat16) == GemmShape("bfloat16-mxfp4", 64, 2880, False)


def test_table_entry_tells_a_measured_large_batch_choice_from_none() -> None:
    """`entry` is the raw choice (4-bit calls keep default_config's launch where there is none,
    and take the large-batch path where "cublas" was measured); `lookup` folds both into None."""
    shape = GemmShape("bfloat16-int4g128", 96, 4096, False)
    t = GemmTable()
    t.set(shape, 1, CUBLAS)
    t.set(shape, 8, "t0w8s1")
    assert t.entry(shape, 1) == CUBLAS and t.lookup(shape, 1) is None
    assert t.entry(shape, 5) == "t0w8s1" and t.lookup(shape, 5) == SkinnyConfig(0, 8, 1)
    assert t.entry(shape, 9) is None and t.entry(QKV, 1) is None


def test_four_bit_layers_list_their_zero_points() -> None:
    from minisgl.core.quant_config import from_hf

    quant = from_hf({"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": False})
    layer = MergedColumnParallelLinear(64, [48, 48], False, TPInfo(0, 1), silu_and_mul=True, quant=quant)
    (call,) = layer.gemm_calls()
    assert call.silu
    assert call.fmt == "int4" and call.zeros is layer.weight_zero and call.scale is layer.weight_scale
