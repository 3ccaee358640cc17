"""Argument checks shared by the op wrappers: each raises ValueError naming the argument.

Checks run on every direct call. The engine validates a batch once when it builds it and
then runs its forward inside `trusted()`: the ops skip their per-call checks there (about
20 Python checks per op, ~250 ops per forward), but still pick the same implementation.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch

_trusted = False


def enabled() -> bool:
    """False inside `trusted()`: the caller has validated the arguments already."""
    return not _trusted


@contextmanager
def trusted() -> Iterator[None]:
    """Skip the ops' argument checks in this block (the engine's forward, after it checked
    the batch). Process-wide: one engine thread runs forwards; nesting is allowed."""
    global _trusted
    before, _trusted = _trusted, True
    try:
        yield
    finally:
        _trusted = before


def check_tensor(
    name: str,
    t: object,
    *,
    dtype: torch.dtype | Sequence[torch.dtype] | None = None,
    ndim: int | None = None,
    device: torch.device | None = None,
) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if ndim is not None and t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions, got shape {tuple(t.shape)}")
    if dtype is not None:
        allowed = (dtype,) if isinstance(dtype, torch.dtype) else tuple(dtype)
        if t.dtype not in allowed:
            names = ", ".join(str(d).removeprefix("torch.") for d in allowed)
            raise ValueError(f"{name} must have dtype {names}, got {str(t.dtype).removeprefix('torch.')}")
    if device is not None and t.device != device:
        raise ValueError(f"{name} must be on {device}, got {t.device}")
    return t


def check_shape(name: str, t: torch.Tensor, shape: Sequence[int | None]) -> None:
    """`None` in `shape` matches any size."""
    ok = t.dim() == len(shape) and all(s is None or s == d for s, d in zip(shape, t.shape))
    if not ok:
        want = tuple("*" if s is None else s for s in shape)
        raise ValueError(f"{name} must have shape {want}, got {tuple(t.shape)}")


def check_inner_contiguous(name: str, t: torch.Tensor, inner_dims: int = 1) -> None:
    """The last `inner_dims` dimensions must be packed (row strides may be anything)."""
    expected = 1
    for d in range(t.dim() - 1, t.dim() - 1 - inner_dims, -1):
        if t.size(d) != 1 and t.stride(d) != expected:
            raise ValueError(
                f"{name} must be contiguous in its last {inner_dims} dimension(s), "
                f"got strides {t.stride()} for shape {tuple(t.shape)}"
            )
        expected *= t.size(d)


def check_contiguous(name: str, t: torch.Tensor) -> None:
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous, got strides {t.stride()} for shape {tuple(t.shape)}")


def check_same_device(**tensors: torch.Tensor) -> None:
    items = list(tensors.items())
    first_name, first = items[0]
    for name, t in items[1:]:
        if t.device != first.device:
            raise ValueError(f"{name} is on {t.device} but {first_name} is on {first.device}")


def check_window_sinks(q: torch.Tensor, window: int, sinks: object) -> None:
    """window: an int >= 0 (0 = full attention); sinks: None or fp32 contiguous [Hq] on q's device."""
    if not isinstance(window, int) or window < 0:
        raise ValueError(f"window must be an int >= 0 (0 = full attention), got {window!r}")
    if sinks is not None:
        check_tensor("sinks", sinks, dtype=torch.float32, ndim=1)
        check_shape("sinks", sinks, (q.shape[1],))
        check_contiguous("sinks", sinks)
        check_same_device(q=q, sinks=sinks)
