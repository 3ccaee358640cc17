"""minisgl: a compact, fast LLM inference server with its own CUDA and Triton kernels."""

from pathlib import Path as _Path


def _use_installed_parts_from_a_checkout() -> None:
    # Python run in the repository root imports this source tree (the current directory comes
    # first on sys.path), which lacks what `pip install .` adds: `kernels/` mapped to
    # minisgl/kernels, and the compiled minisgl._C. Make both resolvable from here: the
    # checkout's kernels/ folder, and the installed copy of the package (for _C).
    here = _Path(__file__).resolve().parent
    if (here / "kernels").is_dir():
        return  # the installed layout
    if (here.parent / "kernels" / "__init__.py").is_file():
        __path__.append(str(here.parent))  # minisgl.kernels -> <checkout>/kernels
    try:
        from importlib.metadata import distribution

        installed = _Path(str(distribution("minisgl").locate_file("minisgl"))).resolve()
    except Exception:  # noqa: BLE001 - not installed: _C stays missing and ops fall back (logged)
        return
    if installed != here and installed.is_dir():
        __path__.append(str(installed))


_use_installed_parts_from_a_checkout()

__all__ = ["LLM", "SamplingParams"]
__version__ = "0.1.0"

# The public names load on first use: every process imports this package, and most of them
# (the API server, tokenizer workers, detokenizer, DP controller) need neither the engine
# nor torch (DESIGN.md §2).
_LAZY = {"LLM": "minisgl.offline.llm", "SamplingParams": "minisgl.core.sampling_params"}


def __getattr__(name: str):
    if name in _LAZY:
        import importlib

        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'minisgl' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted([*globals(), *_LAZY])
