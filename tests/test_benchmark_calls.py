"""The benchmark scripts' calls into minisgl (and into each other) still bind to the callees' current
signatures (CPU, ast + inspect). The benchmarks run only on a GPU, so a call that lost a positional
parameter (benchmarks/kernels/skinny_moe.py's `skinny_moe._launch` without `q`) used to show up
only there. Resolved statically: names imported from minisgl or from a benchmark file, attribute
chains on them, and Triton launches `kernel[grid](...)`. Not checked: methods on instances
(`llm.generate`), calls with *args / **kwargs, and callees without a Python signature (pybind11)."""

from __future__ import annotations

import ast
import dataclasses
import importlib
import inspect
from pathlib import Path

import pytest
from triton.backends.nvidia.compiler import CUDAOptions

_BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
_LOCAL_DIRS = (_BENCH, _BENCH / "kernels")  # the benchmarks put both on sys.path themselves
# keywords a Triton launch takes besides the kernel's own parameters (num_warps, launch_pdl, ...)
_LAUNCH_OPTIONS = {f.name for f in dataclasses.fields(CUDAOptions)}


def _import(module: str, name: str | None = None) -> object:
    """What `from module import name` (or `import module`) binds, as Python finds it."""
    mod = importlib.import_module(module)
    if name is None or hasattr(mod, name):
        return mod if name is None else getattr(mod, name)
    return importlib.import_module(f"{module}.{name}")  # a submodule not imported yet


def _ours(module: str) -> bool:
    root = module.split(".")[0]
    return root == "minisgl" or any((d / f"{root}.py").exists() for d in _LOCAL_DIRS)


def _scope(node: ast.AST):
    """The nodes of one function (or module) scope, without the bodies of nested functions."""
    todo = list(ast.iter_child_nodes(node))
    while todo:
        n = todo.pop()
        yield n
        if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
            todo.extend(ast.iter_child_nodes(n))


def _bind_scope(node: ast.AST, outer: dict, errors: list[str], where: str) -> dict:
    """The names this scope sees: the outer ones, less those it assigns, plus its own imports."""
    nodes = list(_scope(node))
    shadowed = {n.id for n in nodes if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    shadowed |= {a.arg for a in nodes if isinstance(a, ast.arg)}
    names = {k: v for k, v in outer.items() if k not in shadowed}
    for n in nodes:
        try:
            if isinstance(n, ast.Import):
                for a in (a for a in n.names if _ours(a.name)):
                    names[a.asname or a.name.split(".")[0]] = _import(a.name if a.asname else a.name.split(".")[0])
                    _import(a.name)  # `import minisgl.ops` binds minisgl with ops imported
            elif isinstance(n, ast.ImportFrom) and n.module and n.level == 0 and _ours(n.module):
                for a in n.names:
                    names[a.asname or a.name] = _import(n.module, a.name)
        except (ImportError, AttributeError) as e:
            errors.append(f"{where}:{n.lineno}: import fails: {e}")
    return names


def _resolve(expr: ast.expr, names: dict, errors: list[str], where: str) -> object | None:
    """The object a Name / attribute chain names, or None when it does not start at our import."""
    chain = []
    while isinstance(expr, ast.Attribute):
        chain.append(expr.attr)
        expr = expr.value
    if not isinstance(expr, ast.Name) or expr.id not in names:
        return None
    obj = names[expr.id]
    for attr in reversed(chain):
        if inspect.ismodule(obj) and not hasattr(obj, attr):
            try:
                obj = importlib.import_module(f"{obj.__name__}.{attr}")
            except ImportError:
                errors.append(f"{where}: {obj.__name__} has no attribute {attr!r}")
                return None
        else:
            obj = getattr(obj, attr, None)  # a class's instance field: not resolvable, skip
    return obj


@pytest.fixture(autouse=True)
def _bench_on_sys_path(monkeypatch: pytest.MonkeyPatch) -> None:
    for d in _LOCAL_DIRS:  # as when the benchmarks run; monkeypatch gives other tests their sys.path back
        monkeypatch.syspath_prepend(str(d))


def check_calls(paths: list[Path]) -> tuple[dict[str, int], list[str]]:
    """Per file the number of calls bound against their callee's signature, and the failures."""
    counts, errors = {}, []
    for path in paths:
        where, checked = str(path.relative_to(_BENCH.parent) if path.is_relative_to(_BENCH) else path.name), 0
        scopes = [(ast.parse(path.read_text(), str(path)), {})]
        while scopes:
            node, outer = scopes.pop()
            names = _bind_scope(node, outer, errors, where)
            for n in _scope(node):
                if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    scopes.append((n, names))
                if not isinstance(n, ast.Call):
                    continue
                func, launch = n.func, isinstance(n.func, ast.Subscript)
                obj = _resolve(func.value if launch else func, names, errors, f"{where}:{n.lineno}")
                while launch and hasattr(obj, "fn") and not inspect.isfunction(obj):
                    obj = obj.fn  # kernel[grid](...): the kernel's Python function (under autotune, heuristics)
                if launch and not inspect.isfunction(obj):
                    continue
                kws = [k.arg for k in n.keywords if not (launch and k.arg in _LAUNCH_OPTIONS)]
                splat = None in kws or any(isinstance(a, ast.Starred) for a in n.args)
                if splat or obj is None or inspect.ismodule(obj) or not callable(obj):
                    continue
                try:
                    sig = inspect.signature(obj)
                except (TypeError, ValueError):  # a builtin (pybind11, torch op): no signature
                    continue
                params = sig.parameters.values()
                if params and all(p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD) for p in params):
                    continue  # binds anything: a wrapper, a JITFunction called directly
                checked += 1
                try:
                    sig.bind(*[None] * len(n.args), **dict.fromkeys(kws))
                except TypeError as e:
                    errors.append(f"{where}:{n.lineno}: {ast.unparse(func)}(...) against {sig}: {e}")
        counts[where] = checked
    return counts, errors


def test_benchmark_calls_bind_to_current_signatures() -> None:
    counts, errors = check_calls(sorted(_BENCH.rglob("*.py")))
    print("\n".join(f"{n:4d} {f}" for f, n in sorted(counts.items())))
    assert not errors, "\n".join(errors)
    # not vacuous: the kernel benchmarks alone call minisgl a few hundred times
    assert sum(counts.values()) > 200, counts
    assert counts["benchmarks/kernels/skinny_moe.py"] >= 10, counts


def test_a_stale_call_is_reported(tmp_path: Path) -> None:
    bench = tmp_path / "stale.py"
    bench.write_text(
        "from _bench import time_calls\n"
        "from minisgl.ops.gemm import skinny_moe\n"
        "import minisgl.kernels.norm as N\n"
        "def sweep(x, w, b, ids, wts, out, act, cfg):\n"
        "    skinny_moe._launch(x, w, b, ids, wts, out, False, act, cfg)\n"  # q missing
        "    skinny_moe._launch(x, w, b, ids, wts, out, False, act, cfg, None)\n"
        "    skinny_moe.no_such_function()\n"
        "    time_calls([], reps=3, graph=False)\n"  # the keyword is use_graph
        "    N._rmsnorm_kernel[(1,)](x, num_warps=4)\n"  # too few kernel arguments
    )
    counts, errors = check_calls([bench])
    assert counts == {"stale.py": 4}, (counts, errors)
    errors.sort(key=lambda e: int(e.split(":")[1]))
    assert [e.split(":")[1] for e in errors] == ["5", "7", "8", "9"], errors
    assert "missing a required argument: 'q'" in errors[0], errors
