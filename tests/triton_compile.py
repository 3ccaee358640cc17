"""A Triton kernel compiled for a GPU architecture on the CPU (no GPU needed: Triton's own ptxas), so
tests can check what a launch would need (its shared memory) for tiles that CI never runs."""

from __future__ import annotations

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource


def shared_bytes(fn, types: dict[str, str], consts: dict, warps: int, stages: int, arch: int = 90) -> int:
    """Shared memory per block of `fn` compiled for sm_<arch>: `types` gives the pointer and tensor
    descriptor arguments' types (the rest are i32), `consts` every constexpr."""
    sig = {n: types.get(n, "i32") for n in fn.arg_names} | dict.fromkeys(consts, "constexpr")
    src = ASTSource(fn=fn, signature=sig, constexprs={(fn.arg_names.index(c),): v for c, v in consts.items()})
    options = {"num_warps": warps, "num_stages": stages}
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options).metadata.shared
