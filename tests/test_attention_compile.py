"""The extend kernel compiles for sm_90 in every constexpr variant the engine launches (compiled on
the CPU, no GPU needed): the Triton interpreter runs these kernels as Python and checks none of what
the compiler does (a loop-carried variable that changes type, a name one branch leaves undefined),
and a tile or pipelining change could overflow an H100's 227 KB of shared memory per block."""

from __future__ import annotations

import pytest
import torch

from minisgl import env
from minisgl.kernels import deterministic_attention as DA
from minisgl.kernels import extend_attention as K

POINTERS = ("Q", "KCache", "VCache", "Out", "ReqToSlot", "ReqRows", "PrefixLens", "CuSeqlensQ", "Tiles", "PartAcc",
            "PartML", "Sinks")


def _variants() -> list:
    """(dtype, constexprs, config): the default kernel (plain and tile-map launches, windows and
    sinks), and deterministic mode's prefill tile and decode tile, sequential and split decode."""
    cuda = torch.device("cuda")
    out = []
    for dtype, d in (("bf16", 128), ("bf16", 64), ("fp32", 128)):
        cfg = K.default_config(d, torch.float32 if dtype == "fp32" else torch.bfloat16, cuda)
        for tiled, windowed in ((False, False), (True, False), (True, True)):
            consts = dict(GROUP=8 if d == 64 else 2, HEAD_DIM=d, TILED=tiled, HEADS=1, SPLIT=0, PARTIAL=False,
                          WINDOWED=windowed, HAS_SINKS=windowed)
            name = f"default-{dtype}-d{d}-tiled{int(tiled)}-window{int(windowed)}"
            out.append(pytest.param(dtype, consts, cfg, id=name))
    for cfg in (DA.DETERMINISTIC_CONFIGS[0], DA.DECODE_TILE):
        heads = DA.heads_per_tile(2, cfg[0])
        for partial in (False, True):
            for windowed in (False, True):
                consts = dict(GROUP=2, HEAD_DIM=128, TILED=True, HEADS=heads, SPLIT=DA.SPLIT, PARTIAL=partial,
                              WINDOWED=windowed, HAS_SINKS=windowed)
                out.append(pytest.param("bf16", consts, cfg, id=f"mode-{cfg[0]}x{cfg[1]}x{cfg[2]}-partial{int(partial)}"
                                                                f"-window{int(windowed)}"))
    return out


@pytest.mark.slow
@pytest.mark.parametrize("dtype,consts,config", _variants())
def test_extend_kernel_compiles_for_sm90(dtype: str, consts: dict, config: tuple[int, ...]) -> None:
    if env.TRITON_INTERPRET:
        pytest.skip("under TRITON_INTERPRET the kernels are interpreted functions, not compilable")
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    block_m, block_n, warps, stages = config
    fn = K._extend_attn_kernel
    consts = consts | dict(BLOCK_D=triton.next_power_of_2(consts["HEAD_DIM"]), BLOCK_M=block_m, BLOCK_N=block_n,
                           DOT_PREC=K.dot_precision(torch.float32 if dtype == "fp32" else torch.bfloat16))
    types = {n: f"*{dtype}" for n in ("Q", "KCache", "VCache", "Out")}
    types |= {n: "*i32" for n in ("ReqToSlot", "ReqRows", "PrefixLens", "CuSeqlensQ", "Tiles")}
    types |= {n: "*fp32" for n in ("PartAcc", "PartML", "Sinks")} | {"qk_scale": "fp32", "v_scale": "fp32"}
    sig = {n: types.get(n, "i32") for n in fn.arg_names} | {c: "constexpr" for c in consts}
    # As a launch specializes them: pointers and strides divisible by 16 (16-byte loads).
    aligned = [n for n in fn.arg_names if n in POINTERS or n.startswith("stride")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()},
                    attrs={(fn.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned})
    compiled = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": warps, "num_stages": stages})
    assert compiled.metadata.shared <= 227 * 1024, (consts, config, compiled.metadata.shared)
