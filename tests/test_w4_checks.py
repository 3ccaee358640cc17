"""4-bit weights' argument checks and launch rules: bad input named by ops/gemm/w4.py, the skinny
launchers' own refusals and kernel tables (on a machine without a GPU), the split rule's chunk
counts, the engine-start dispatch table, the KV budget's room for a decoded slice. Weights from
test_w4_kernels.py's builders."""

from __future__ import annotations

import pytest
import torch
from test_w4_kernels import DEV, assert_close, gpu, make_int4, make_mxfp4, reference

from minisgl import env
from minisgl.ops._backend import compiled
from minisgl.ops.gemm import w4

# ---- bad input --------------------------------------------------------------------------------


def test_bad_input_is_named() -> None:
    gen = torch.Generator().manual_seed(0)
    qw, s, z, _ = make_int4(16, 64, 32, torch.float32, gen)
    x = torch.randn(2, 64).to(DEV)
    with pytest.raises(ValueError, match="qweight must have dtype int32"):
        w4.int4_linear(x, qw.float(), s, z)
    with pytest.raises(ValueError, match="scales must have dtype"):
        w4.int4_linear(x, qw, s.half(), z)
    with pytest.raises(ValueError, match="qweight must have shape"):
        w4.int4_linear(torch.randn(2, 128).to(DEV), qw, s, z)
    with pytest.raises(ValueError, match="zeros must have shape"):
        w4.int4_linear(x, qw, s, z[:, :1])
    with pytest.raises(ValueError, match="even N"):
        w4.int4_linear(x, qw[:15], s[:15], z[:15], silu_and_mul=True)
    with pytest.raises(ValueError, match="divisible by 8"):
        w4.int4_linear(torch.randn(2, 60).to(DEV), qw, s, z)
    blocks, es, _ = make_mxfp4(8, 64, gen)
    with pytest.raises(ValueError, match="divisible by 32"):
        w4.mxfp4_linear(torch.randn(2, 48).to(DEV), blocks, es)
    with pytest.raises(ValueError, match="bias must have shape"):
        w4.mxfp4_linear(x, blocks, es, bias=torch.zeros(7).to(DEV))
    odd = torch.empty(blocks.numel() + 1, dtype=torch.uint8, device=blocks.device)[1:].view(blocks.shape)
    odd.copy_(blocks)
    with pytest.raises(ValueError, match="4-byte-aligned"):
        w4.mxfp4_linear(x, odd, es)
    with pytest.raises(ValueError, match="fmt must be one of"):
        w4.fused_moe_w4(x, "nf4", qw, s, z, qw, s, z, torch.ones(2, 1), torch.zeros(2, 1, dtype=torch.int32))
    # INT4 experts whose zeros sit on another device: named (the kernels read every pointer given)
    w13, s13, z13 = qw[None], s[None], z[None]
    w2q, s2, z2, _ = make_int4(64, 8, 8, torch.float32, gen)
    routing = (torch.ones(2, 1).to(DEV), torch.zeros(2, 1, dtype=torch.int32).to(DEV))
    with pytest.raises(ValueError, match="w2_zeros is on meta"):
        w4.fused_moe_w4(x, "int4", w13, s13, z13, w2q[None], s2[None], z2[None].to("meta"), *routing)


def test_skinny_misfit_names_the_kernels_offset_bounds() -> None:
    """The Python gate refuses, by name, what the launcher's 32-bit offsets cannot address (so a
    call is routed to the Triton GEMM instead of failing at launch): meta tensors, nothing allocated."""
    def meta(shape, stride=None, dtype=torch.bfloat16):
        return torch.empty_strided(shape, stride or (shape[1], 1), dtype=dtype, device="meta")

    k = 4096
    x, w, s = meta((1, k)), meta((64, k // 8), dtype=torch.int32), meta((64, k // 128))
    assert w4.skinny_misfit(x, w, s, 1) is None
    big_k = (1 << 22) + 128
    assert "2^22" in w4.skinny_misfit(meta((1, big_k)), meta((64, big_k // 8), dtype=torch.int32),
                                      meta((64, big_k // 128)), 1)
    assert "row offsets" in w4.skinny_misfit(x, meta((64, k // 8), (1 << 25, 1), torch.int32), s, 1)
    assert "row stride" in w4.skinny_misfit(meta((2, k), (1 << 30, 1)), w, s, 1)


_NO_GPU = pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU would run the good calls on fake pointers")


@_NO_GPU
def test_skinny_w4_launchers_check_the_weight_arguments() -> None:
    """The 4-bit launchers' shared argument check (csrc/skinny_launch.h w4_args_ok), through the
    bindings on a machine without a GPU: a bad 4-bit argument is refused before any CUDA call
    ('invalid argument'), while good ones pass every check and fail only at the missing device."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        pytest.skip("minisgl._C was built without CUDA")
    p = 1 << 20  # a 16-byte aligned address, never dereferenced (no launch happens)
    k = 256

    def dense(fmt=1, w_stride=k // 8, zeros=p, q_group=128, k=k, x_stride=k):
        ext.skinny_gemm_w4(p, p, p, zeros, k // q_group if fmt == 1 else k // 32, q_group, fmt, 0, p, 0, 0, 0, 0,
                           1, 64, k, x_stride, w_stride, 64, False, 1, 0, 4, 1, False, 0)

    def moe(fmt=1, w_expert_stride=64 * k // 8, zeros=p, q_group=128, q_stride=None):
        ext.skinny_moe(p, p, 0, p, 0, p, 0, 0, 0, 0, 1, 2, 64, k, k, k // 8 if fmt == 1 else k // 2, 64,
                       w_expert_stride, 0, False, 0, 0.0, 0.0, fmt, p, zeros, q_stride or k // q_group, q_group, 128,
                       1, 0, 4, 1, False, 0)

    bad = [
        lambda: dense(fmt=3),
        lambda: dense(w_stride=k // 8 + 1),  # INT4 rows not 16-byte aligned
        lambda: dense(zeros=0),  # INT4 without zeros
        lambda: dense(q_group=48),  # INT4 group not a multiple of 32
        lambda: dense(fmt=2, w_stride=k // 2, zeros=p, q_group=32),  # MXFP4 with zeros
        lambda: dense(fmt=2, w_stride=k // 2, zeros=0, q_group=64),  # MXFP4 scales per 32 only
        # the kernel's 32-bit offsets and exact group index: K <= 2^22, 64 rows of W and m rows of x
        lambda: dense(k=(1 << 22) + 128, w_stride=((1 << 22) + 128) // 8),
        lambda: dense(w_stride=1 << 25),
        lambda: dense(x_stride=1 << 31),
        lambda: moe(w_expert_stride=64 * k // 8 + 2),  # an expert's rows not 16-byte aligned
        lambda: moe(fmt=2, w_expert_stride=64 * k // 2, zeros=p, q_group=32),
        lambda: moe(q_stride=k // 128 - 1),  # scale rows shorter than K / group (32-bit offsets' bound)
        lambda: moe(fmt=2, w_expert_stride=64 * k // 2, zeros=0, q_group=32, q_stride=2),
    ]
    for call in bad:
        with pytest.raises(RuntimeError, match="invalid argument"):
            call()
    for call in (dense, lambda: dense(fmt=2, w_stride=k // 2, zeros=0, q_group=32), moe,
                 lambda: dense(k=1 << 22, w_stride=(1 << 22) // 8), lambda: dense(w_stride=(1 << 25) - 4),
                 lambda: moe(fmt=2, w_expert_stride=64 * k // 2, zeros=0, q_group=32)):
        with pytest.raises(RuntimeError) as e:
            call()
        assert "invalid argument" not in str(e.value), str(e.value)


@_NO_GPU
def test_every_skinny_table_entry_has_its_kernels() -> None:
    """Each launcher (16-bit, FP8, INT4, MXFP4 dense; MoE 16-bit and 4-bit) finds a kernel for every
    configuration of its table at every row count up to that entry's max m, in both 16-bit
    dtypes (csrc/skinny_launch.h Tiles<W>, the pick functions of csrc/skinny_gemm.cu and skinny_moe.cu):
    those calls pass every check and fail only at the missing device, while one row past max m is
    refused by argument."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        pytest.skip("minisgl._C was built without CUDA")
    p, k, n = 1 << 20, 256, 64

    def bf16(m, dtype, cfg):
        ext.skinny_gemm(p, p, 0, p, 0, 0, 0, 0, m, n, k, k, k, n, False, dtype, cfg, 4, 1, False, 0)

    def fp8(m, dtype, cfg):
        ext.skinny_gemm_fp8(p, p, p, 1, False, 0, p, 0, 0, 0, 0, m, n, k, k, k, n, False, dtype, cfg, 4, 1, False, 0)

    def w4(fmt):
        def call(m, dtype, cfg):
            ext.skinny_gemm_w4(p, p, p, p if fmt == 1 else 0, k // (128 if fmt == 1 else 32), 128 if fmt == 1 else 32,
                               fmt, 0, p, 0, 0, 0, 0, m, n, k, k, k // 8 if fmt == 1 else k // 2, n, False, dtype,
                               cfg, 4, 1, False, 0)
        return call

    def moe(fmt):
        def call(m, dtype, cfg):
            stride = k if fmt == 0 else k // 8 if fmt == 1 else k // 2
            ext.skinny_moe(p, p, 0, p, 0, p, 0, 0, 0, 0, 1, 2, n, k, k, stride, n, n * stride, 0, False, 0, 0.0, 0.0,
                           fmt, p if fmt else 0, p if fmt == 1 else 0, k // 128 if fmt == 1 else k // 32,
                           128 if fmt == 1 else 32, k // 32, dtype, cfg, 4, 1, False, 0)
        return call

    tables = {"16-bit": (ext.skinny_gemm_configs(False), bf16), "fp8": (ext.skinny_gemm_configs(True), fp8),
              "int4": (ext.skinny_gemm_w4_configs(), w4(1)), "mxfp4": (ext.skinny_gemm_w4_configs(), w4(2))}
    for name, (table, launch) in tables.items():
        assert len(table) == 4, name
        for cfg, (_, _, max_m) in enumerate(table):
            for dtype in (0, 1):
                for m in sorted({1, 9, *range(8, max_m + 1, 8)}):
                    if m > max_m:
                        continue
                    with pytest.raises(RuntimeError) as e:
                        launch(m, dtype, cfg)
                    assert "invalid argument" not in str(e.value), f"{name} cfg {cfg} m {m} dtype {dtype}"
                with pytest.raises(RuntimeError, match="invalid argument"):
                    launch(max_m + 1, dtype, cfg)
    for fmt, table in ((0, ext.skinny_gemm_configs(False)), (1, ext.skinny_gemm_w4_configs()),
                       (2, ext.skinny_gemm_w4_configs())):
        for cfg in range(len(table)):
            for dtype in (0, 1):
                with pytest.raises(RuntimeError) as e:
                    moe(fmt)(1, dtype, cfg)
                assert "invalid argument" not in str(e.value), f"moe fmt {fmt} cfg {cfg} dtype {dtype}"
            with pytest.raises(RuntimeError, match="invalid argument"):
                moe(fmt)(1, 2, cfg)  # no such dtype


def test_four_bit_tiles_count_32_element_chunks_for_the_split_rule() -> None:
    """tile_shapes reports every format's chunks in 32-element units (the 4-bit loaders' 128-element
    chunks as 4 x 32), so default_config's and skinny_moe.default_configs' split rule, every warp
    keeps at least two warp groups of K, holds for 4-bit weights too (it counted 32 for them)."""
    ext = compiled()
    if ext is None or not ext.has_cuda:
        pytest.skip("minisgl._C was built without CUDA")
    from minisgl.ops.gemm import skinny as sk
    from minisgl.ops.gemm import skinny_moe

    w4_tiles = ext.skinny_gemm_w4_configs()
    for fmt in ("int4", "mxfp4"):
        assert sk.tile_shapes(fmt) == tuple((rt, 4 * u, mm) for rt, u, mm in w4_tiles)
        for n, k in ((256, 2048), (1031, 4096), (4096, 14336)):
            cfg = sk.default_config(1, n, k, False, 132, fmt)
            group = 128 * w4_tiles[cfg.tile][1]
            assert k // cfg.splits >= 2 * cfg.warps * group, (fmt, n, k, cfg)
        up, down = skinny_moe.default_configs(4, 2880, 2880, 132, fmt)
        for cfg in (up, down):
            assert 2880 // cfg.splits >= 2 * cfg.warps * 128 * w4_tiles[cfg.tile][1], (fmt, cfg)
    assert sk.default_config(1, 256, 2048, False, 132, "int4").splits == 2  # 4 when 32 was counted


@gpu
@pytest.mark.gpu
def test_int4_dispatch_table_is_measured_and_followed(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """The engine-start tuner measures 4-bit shapes too (our configs against the decode + cuBLAS
    path), and ops.linear follows the entry: a config goes to the skinny launch, "cublas" to the
    decode + cuBLAS path, no entry to default_config's launch; each equals the reference."""
    from minisgl import ops
    from minisgl.ops.gemm import tuning
    from minisgl.ops.gemm.dispatch import install_table, table_for
    from minisgl.ops.gemm.skinny import SkinnyConfig
    from minisgl.ops.gemm.table import CUBLAS, GemmCall, GemmShape, GemmTable

    monkeypatch.setattr(env, "CACHE_DIR", str(tmp_path))
    dev = torch.device("cuda", torch.cuda.current_device())
    saved = table_for(dev)
    gen = torch.Generator().manual_seed(3)
    n, k, group = 768, 2048, 128
    qw, s, z, w = make_int4(n, k, group, torch.bfloat16, gen)
    shape = GemmShape("bfloat16-int4g128", n, k, False)
    try:
        table = tuning.tune_gemms([GemmCall(qw, False, "int4", s, 0, z)], dev, [1, 4], torch.bfloat16, budget_s=60)
        assert table is not None and table.has(shape, 1) and table.has(shape, 4)
        seen: list[object] = []
        skinny, dequant = w4.skinny_linear, w4.dequant_linear
        monkeypatch.setattr(w4, "skinny_linear", lambda *a, **kw: seen.append(kw.get("config")) or skinny(*a, **kw))
        monkeypatch.setattr(w4, "dequant_linear", lambda *a, **kw: seen.append(CUBLAS) or dequant(*a, **kw))
        forced = GemmTable()
        forced.set(shape, 1, CUBLAS)
        forced.set(shape, 4, "t0w8s2")
        install_table(dev, forced)
        for m, want in ((1, CUBLAS), (4, SkinnyConfig(0, 8, 2)), (5, None)):
            x = torch.randn(m, k, generator=gen).to(dev, torch.bfloat16)
            seen.clear()
            y = ops.linear(x, qw, fmt="int4", scale=s, zeros=z)
            assert seen == [want], f"M {m}: {seen}"
            assert_close(y, reference(x, w, None, False))
    finally:
        install_table(dev, saved if saved is not None else GemmTable())


def test_the_kv_budget_leaves_room_for_a_decoded_slice(monkeypatch: pytest.MonkeyPatch) -> None:
    """engine/memory.py: on a GPU, a 4-bit model's KV budget also leaves DEQUANT_BYTES for the
    large-M path's decoded slice (beside the 1 GiB for activations); FP8 and 16-bit models do not."""
    import types

    from minisgl.engine.memory import MemoryPlan

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (60 << 30, 80 << 30))

    def budget(fmt: str | None) -> float:
        plan = types.SimpleNamespace(
            device=torch.device("cuda", 0), cfg=types.SimpleNamespace(gpu_memory_fraction=0.9, deterministic=False),
            model_config=types.SimpleNamespace(quantization=None if fmt is None else types.SimpleNamespace(fmt=fmt)))
        return MemoryPlan._kv_budget(plan)

    base = 0.9 * (80 << 30) - (20 << 30) - (1 << 30)
    assert budget(None) == budget("fp8") == base
    assert budget("int4") == budget("mxfp4") == base - w4.DEQUANT_BYTES
