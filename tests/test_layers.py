"""The house's floors (DESIGN.md §2), read from the source: every import of minisgl/ and
kernels/ (module level, inside functions and under TYPE_CHECKING alike) runs from a floor to
the same one or a lower one, never in a circle between files; and the processes that need no
torch (the API server, tokenizer workers, detokenizer, DP controller) do not import it (while
they run: tests/test_torch_free_processes.py)."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# Lowest first. A module sits on the floor of the longest entry that names it (a folder names
# everything in it); folders on one floor never import each other.
FLOORS: list[tuple[str, ...]] = [
    ("minisgl.env",),
    ("minisgl.logging_setup",),
    ("minisgl.core",),
    ("minisgl.message", "minisgl.parsers"),
    ("minisgl.kernels",),
    ("minisgl.ops",),
    ("minisgl.kvcache", "minisgl.distributed"),
    ("minisgl.grammar",),
    ("minisgl.layers",),
    ("minisgl.attention",),
    ("minisgl.models",),
    ("minisgl.step", "minisgl.sampling"),
    ("minisgl.speculative",),
    ("minisgl.engine",),
    ("minisgl.tokenizer",),
    ("minisgl.scheduler",),
    ("minisgl.dp",),
    ("minisgl.offline", "minisgl.server"),
    ("minisgl.launch",),
    ("minisgl", "minisgl.serve"),
]
# Imports allowed to run up a floor (at most two), each with its reason in DESIGN.md §2.
UPWARD_ALLOWED: set[tuple[str, str]] = set()
# Entry modules of the processes that never need torch, and what each must not load.
TORCH_FREE_ENTRIES = [
    "minisgl.launch.launcher",  # the launcher, which is also the API server's process
    "minisgl.launch.child",  # every child's start, before it imports its worker
    "minisgl.server.api",
    "minisgl.tokenizer.worker",
    "minisgl.tokenizer.detokenizer",
    "minisgl.dp.controller",
    "minisgl.serve",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[0] == "kernels":  # installed as minisgl/kernels
        parts = ["minisgl", *parts]
    if parts[-1] == "__init__":
        parts = parts[:-1]
    return ".".join(parts)


def _sources() -> dict[str, Path]:
    files = {}
    for folder in ("minisgl", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            files[_module_name(path)] = path
    return files


def _resolve(name: str, files: dict[str, Path]) -> str | None:
    parts = name.split(".")
    while parts:
        candidate = ".".join(parts)
        if candidate in files:
            return candidate
        parts.pop()
    return None


def import_graph() -> dict[str, set[str]]:
    """module -> the project modules it imports (a `from pkg import name` of a submodule
    counts as importing that submodule; compiled `minisgl._C` is not a source file)."""
    files = _sources()
    edges: dict[str, set[str]] = {}
    for mod, path in files.items():
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        out: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    base = ".".join([*up, *([base] if base else [])])
                names = [f"{base}.{a.name}" for a in node.names]
                targets = [n if n in files or n == "minisgl._C" else base for n in names]
            else:
                continue
            for target in targets:
                if target.startswith("minisgl") and target != "minisgl._C":
                    resolved = _resolve(target, files)
                    if resolved is not None and resolved != mod:
                        out.add(resolved)
        edges[mod] = out
    return edges


def floor_of(module: str) -> tuple[int, str]:
    """(floor index, the entry that places it)."""
    best = None
    for i, floor in enumerate(FLOORS):
        for entry in floor:
            if (module == entry or module.startswith(entry + ".")) and (best is None or len(entry) > len(best[1])):
                best = (i, entry)
    assert best is not None, f"{module} is on no floor: add it to FLOORS (and to DESIGN.md §2)"
    return best


def circles(edges: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan, iteratively)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    for root in sorted(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(edges.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_circles_between_files():
    assert circles(import_graph()) == []


def test_circle_finder_finds_a_circle():
    # The check above can fail: a planted circle is found.
    assert circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_imports_run_down_the_floors():
    upward, sideways = [], []
    for mod, targets in import_graph().items():
        (floor, entry) = floor_of(mod)
        for target in targets:
            (t_floor, t_entry) = floor_of(target)
            if t_floor > floor and (mod, target) not in UPWARD_ALLOWED:
                upward.append(f"{mod} (floor {floor}) -> {target} (floor {t_floor})")
            elif t_floor == floor and t_entry != entry and not (entry.startswith(t_entry) or t_entry.startswith(entry)):
                sideways.append(f"{mod} -> {target}")
    assert not upward, "imports that run up a floor:\n" + "\n".join(sorted(upward))
    assert not sideways, "imports between folders of one floor:\n" + "\n".join(sorted(sideways))


def test_scheduler_meets_the_engine_at_its_face():
    """The scheduler describes steps in the engine face's vocabulary (engine/face.py) and builds
    no engine objects: of the engine's floors it imports the face, the Engine class and its
    config (to build one), and the speculation gate, nothing of step/ or sampling/."""
    engine_side = ("minisgl.engine", "minisgl.step", "minisgl.sampling", "minisgl.speculative")
    allowed = {"minisgl.engine.face", "minisgl.engine.engine", "minisgl.engine.config", "minisgl.speculative.gate"}
    reached = {
        target
        for mod, targets in import_graph().items() if mod.startswith("minisgl.scheduler.")
        for target in targets if target.startswith(engine_side)
    }
    assert reached <= allowed, f"the scheduler reaches past the engine's face: {sorted(reached - allowed)}"


def test_every_module_is_on_a_floor():
    for mod in import_graph():
        floor_of(mod)


def test_allowed_upward_imports_are_few_and_named_in_design():
    assert len(UPWARD_ALLOWED) <= 2
    design = (ROOT / "DESIGN.md").read_text()
    for mod, target in UPWARD_ALLOWED:
        assert mod in design and target in design, f"{mod} -> {target} is not explained in DESIGN.md"


def test_design_names_every_floor():
    """DESIGN.md's layer diagram lists every folder of FLOORS."""
    design = (ROOT / "DESIGN.md").read_text()
    section = design[design.index("## 2. Layout"):design.index("## 3.")]
    for floor in FLOORS:
        for entry in floor:
            if entry in ("minisgl", "minisgl.env", "minisgl.logging_setup", "minisgl.serve"):
                continue
            folder = entry.split(".", 1)[1] + "/"
            assert re.search(rf"(?<![\w/]){re.escape(folder)}", section), f"DESIGN.md §2 does not name {folder}"


@pytest.mark.parametrize("module", TORCH_FREE_ENTRIES)
def test_process_entry_does_not_import_torch(module):
    code = f"import sys, {module}; print(sorted(m for m in ('torch', 'triton') if m in sys.modules))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]", f"importing {module} loads {out.stdout.strip()}"


def test_package_root_loads_nothing():
    code = "import sys, minisgl; print(sorted(m for m in sys.modules if m.startswith('minisgl.') or m == 'torch'))"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120, cwd="/")
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


# What a cached function may take: values whose keys keep nothing big alive.
_VALUE_TYPES = {"int", "float", "str", "bool", "torch.device", "torch.dtype", "Path", "int | torch.device"}
# Cached functions that take something else on purpose: (module, function) -> why.
_CACHE_EXCEPTIONS = {("minisgl.tokenizer.incremental", "_added_ids"): "a tokenizer, at most 8 kept (lru_cache(8))"}


def _cached_non_values(source: str, name: str) -> list[str]:
    """Functions under functools.cache / lru_cache with a parameter that is not annotated as a
    value type (unannotated, *args / **kwargs, self, a tensor, object, Any: anything a cache key
    would keep alive), and functools.cache / lru_cache called on a function rather than decorating
    it (not checked here: refused)."""
    found = []
    tree = ast.parse(source)
    decorators = set()
    for node in ast.walk(tree):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        decorators |= {id(d) for d in node.decorator_list}
        if not any("cache" in ast.unparse(d.func if isinstance(d, ast.Call) else d) for d in node.decorator_list):
            continue
        if (name, node.name) in _CACHE_EXCEPTIONS:
            continue
        args = [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]
        bad = [a.arg for a in args if a.annotation is None or ast.unparse(a.annotation) not in _VALUE_TYPES]
        bad += [f"*{a.arg}" for a in (node.args.vararg, node.args.kwarg) if a is not None]
        if bad:
            found.append(f"{name}:{node.lineno} {node.name} ({', '.join(bad)})")
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and id(node) not in decorators and node.args:
            called = ast.unparse(node.func)
            if called.endswith(("functools.cache", "lru_cache")) or called == "cache" or "lru_cache(" in called:
                found.append(f"{name}:{node.lineno} {called}(...) called on a function")
    return found


def test_no_cache_keeps_a_tensor():
    """A functools.cache keeps every argument it is called with alive: 8d6af49 left one on
    ops/moe.py check_shared, and each MoE call's activations stayed (~21 GiB at CUDA graph capture).
    Cached functions take values only (_VALUE_TYPES), every parameter annotated; others are named
    in _CACHE_EXCEPTIONS with the reason."""
    found = [f for mod, path in _sources().items() for f in _cached_non_values(path.read_text(), mod)]
    assert not found, f"cached functions that take more than values: {found}"


def test_the_cache_check_finds_what_a_cache_keeps():
    src = "import functools\n@functools.cache\ndef f(x: torch.Tensor, n: int) -> None: ...\n"
    assert _cached_non_values(src, "m") == ["m:3 f (x)"]
    assert _cached_non_values(src.replace("@functools.cache", "@functools.lru_cache(8)"), "m") == ["m:3 f (x)"]
    assert _cached_non_values(src.replace("torch.Tensor", "object"), "m") == ["m:3 f (x)"]
    assert _cached_non_values(src.replace("x: torch.Tensor", "x"), "m") == ["m:3 f (x)"]
    assert _cached_non_values(src.replace("n: int", "*n"), "m") == ["m:3 f (x, *n)"]
    assert not _cached_non_values(src.replace("x: torch.Tensor", "x: torch.device"), "m")
    assert _cached_non_values("import functools\ng = functools.cache(len)\n", "m") == [
        "m:2 functools.cache(...) called on a function"]
