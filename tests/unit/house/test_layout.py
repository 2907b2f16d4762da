"""Package layout rules (README "Layout"), checked on the source with :mod:`ast` (no jax import).

* no import cycle between modules of ``dspark_jax``, imports inside functions included;
* the layering: errors/config < models < drafters < decoding < evaluation < training, and
  decoding < serving; models < data (the prompt sets) < evaluation, training; inside serving,
  engine < http; the commands wing (``dspark_jax.commands``), the top-level API and the thin
  ``python -m`` entry points sit on top, and nothing else imports upward;
* no module over 600 lines, no function or method over 80 lines.

Every violation of a rule is listed in one failure message, so one run shows all of them.
"""

from __future__ import annotations

import ast
import importlib.metadata
import sys
from pathlib import Path

import pytest

from tests.helpers.env import IN_CI

ROOT = Path(__file__).resolve().parents[3]
PKG = ROOT / "dspark_jax"
MAX_MODULE_LINES = 600
MAX_FUNCTION_LINES = 80

BASE, MODELS, DATA, DRAFTERS, DECODING = "base", "models", "data", "drafters", "decoding"
TRAINING, EVALUATION, SERVING, TOP = "training", "evaluation", "serving", "top"
LOW = {BASE, MODELS, DRAFTERS, DECODING}
# The layers each layer may import (its own included). TOP (the commands wing, dspark_jax/__init__,
# api, the thin python -m entry points) may import anything; no other layer imports TOP.
ALLOWED = {
    BASE: {BASE},
    MODELS: {BASE, MODELS},
    DATA: {BASE, MODELS, DATA},
    DRAFTERS: {BASE, MODELS, DRAFTERS},
    DECODING: {BASE, MODELS, DRAFTERS, DECODING},
    EVALUATION: LOW | {DATA, EVALUATION},
    TRAINING: LOW | {DATA, EVALUATION, TRAINING},
    SERVING: LOW | {SERVING},
}
COMMANDS = "dspark_jax.commands"
# Module paths removed: nothing may import them, and they must not come back.
REMOVED = {"dspark_jax.decode", "dspark_jax.engine"}
SERVING_ENGINE, SERVING_HTTP = "dspark_jax.serving.engine", "dspark_jax.serving.http"


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES: dict[str, Path] = {module_name(p): p for p in sorted(PKG.rglob("*.py"))}
PACKAGES = {m for m, p in MODULES.items() if p.name == "__init__.py"}
TREES: dict[str, ast.Module] = {m: ast.parse(p.read_text(), str(p)) for m, p in MODULES.items()}


def layer(mod: str) -> str:
    parts = mod.split(".")
    if len(parts) == 1:
        return TOP
    if parts[1] in ("errors", "config"):
        return BASE
    if parts[1] in (MODELS, DATA, DRAFTERS, DECODING, TRAINING, EVALUATION, SERVING):
        return parts[1]
    return TOP  # the commands wing, api, the python -m entry points


def _resolve(mod: str, node: ast.ImportFrom) -> str:
    """The absolute module an ``ImportFrom`` names (relative imports resolved)."""
    if not node.level:
        return node.module or ""
    base = mod.split(".")
    base = base if mod in PACKAGES else base[:-1]  # a package's own __init__ is its anchor
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _owner(name: str) -> str | None:
    """The package module ``name`` executes: itself, or its closest parent in the package."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports_of(mod: str, tree: ast.Module) -> dict[str, int]:
    """Package modules ``mod`` (parsed as ``tree``) imports anywhere (module level, functions,
    classes) -> first line.

    ``from pkg import name`` counts as an import of the submodule ``pkg.name`` when that is a
    module, otherwise of ``pkg`` (its ``__init__``)."""
    out: dict[str, int] = {}
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            src = _resolve(mod, node)
            targets = [f"{src}.{a.name}" if f"{src}.{a.name}" in MODULES else src for a in node.names]
        for t in targets:
            owner = _owner(t) if t.split(".")[0] == "dspark_jax" else None
            if owner and owner != mod:
                out.setdefault(owner, node.lineno)
    return out


GRAPH = {m: imports_of(m, t) for m, t in TREES.items()}


def where(mod: str, line: int | None = None) -> str:
    rel = MODULES[mod].relative_to(ROOT)
    return f"{rel}:{line}" if line else str(rel)


def test_the_walk_sees_the_package():
    assert {"dspark_jax.api", "dspark_jax.models.target", "dspark_jax.serving.engine"} <= set(MODULES)
    assert "dspark_jax.models.target" in GRAPH["dspark_jax.api"]


def _cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    problems = []
    for comp in _cycles(GRAPH):
        edges = [f"{where(a, GRAPH[a][b])} imports {b}" for a in comp for b in sorted(GRAPH[a]) if b in comp]
        problems.append("cycle " + " <-> ".join(comp) + ":\n    " + "\n    ".join(edges))
    assert not problems, "import cycles in dspark_jax:\n  " + "\n  ".join(problems)


def test_the_graph_counts_imports_inside_functions_and_finds_cycles():
    src = "def f():\n    from dspark_jax import errors\n    from ..config import TargetConfig\n    import dspark_jax\n"
    assert imports_of("dspark_jax.models.x", ast.parse(src)) == {
        "dspark_jax.errors": 2,
        "dspark_jax.config": 3,
        "dspark_jax": 4,
    }
    assert _cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1}, "d": {"a": 1}}) == [["a", "b", "c"]]


def test_layering():
    problems = []
    for mod, deps in sorted(GRAPH.items()):
        mine = layer(mod)
        for dep, line in sorted(deps.items()):
            if dep in REMOVED:
                problems.append(f"{where(mod, line)}: {mod} imports the removed module {dep}")
            elif dep == "dspark_jax":
                continue  # the root (its __version__): it runs before any submodule anyway, its names load lazily
            elif mine != TOP and layer(dep) not in ALLOWED[mine]:
                problems.append(f"{where(mod, line)}: {mod} ({mine}) imports {dep} ({layer(dep)})")
    assert not problems, "layering violations (README 'Layout'):\n  " + "\n  ".join(problems)


ENTRY_POINTS = {"generate", "eval", "train", "calibrate", "export", "serve"}


def test_the_top_floor_is_the_commands_wing():
    """On top sit only the commands (``dspark_jax.commands.*``), the package's ``__init__``, the
    Python API and the ``python -m dspark_jax.<name>`` entry points, each of which imports its
    command and nothing else of the package; no module elsewhere is a command line."""
    top = {m for m in MODULES if layer(m) == TOP}
    expected = {"dspark_jax", "dspark_jax.api"} | {f"dspark_jax.{n}" for n in ENTRY_POINTS}
    assert {m for m in top if not m.startswith(COMMANDS)} == expected
    problems = [
        f"{where(f'dspark_jax.{n}')}: imports {sorted(GRAPH[f'dspark_jax.{n}'])}"
        for n in sorted(ENTRY_POINTS)
        if n != "serve" and set(GRAPH[f"dspark_jax.{n}"]) != {f"{COMMANDS}.{n}"}
    ]
    problems += [where(m) for m in MODULES if m.rpartition(".")[2] == "cli"]
    assert not problems, "commands outside the commands wing:\n  " + "\n  ".join(problems)


def test_the_serving_engine_does_not_import_http():
    """``serving.engine`` runs without the HTTP server; ``serving.http`` sits on top of it."""
    problems = [
        f"{where(mod, line)}: {mod} imports {dep}"
        for mod, deps in sorted(GRAPH.items())
        if mod.startswith(SERVING_ENGINE)
        for dep, line in sorted(deps.items())
        if dep.startswith(SERVING_HTTP)
    ]
    assert {m for m in MODULES if m.startswith(SERVING_HTTP)}, "the walk sees no serving.http module"
    assert not problems, "serving.engine imports serving.http:\n  " + "\n  ".join(problems)


# The size caps hold in the benchmark suite too (it is read and changed like the package).
CAPPED: dict[str, Path] = {
    **{str(p.relative_to(ROOT)): p for p in MODULES.values()},
    **{str(p.relative_to(ROOT)): p for p in sorted((ROOT / "benchmarks").rglob("*.py"))},
}


def test_no_module_over_600_lines():
    """Every module of ``dspark_jax/`` and ``benchmarks/``."""
    assert any(rel.startswith("benchmarks/") for rel in CAPPED), "the walk sees no benchmark"
    problems = [
        f"{rel}: {n} lines" for rel, p in CAPPED.items() if (n := len(p.read_text().splitlines())) > MAX_MODULE_LINES
    ]
    assert not problems, f"modules over {MAX_MODULE_LINES} lines:\n  " + "\n  ".join(problems)


def test_no_function_over_80_lines():
    """Every function and method of ``dspark_jax/`` and ``benchmarks/``."""
    problems = []
    for rel, p in CAPPED.items():
        tree = TREES.get(module_name(p)) if p.is_relative_to(PKG) else ast.parse(p.read_text(), str(p))
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                n = (node.end_lineno or node.lineno) - node.lineno + 1
                if n > MAX_FUNCTION_LINES:
                    problems.append(f"{rel}:{node.lineno}: {node.name} is {n} lines")
    assert not problems, f"functions over {MAX_FUNCTION_LINES} lines:\n  " + "\n  ".join(sorted(problems))


def test_removed_module_paths_are_gone():
    """``dspark_jax.decode`` and ``dspark_jax.engine`` (deprecated shims) were removed, and the
    package's public names are the curated ones of its ``__init__``."""
    assert not REMOVED & set(MODULES), sorted(REMOVED & set(MODULES))
    import dspark_jax

    assert set(dspark_jax.__all__) == {"__version__", *dspark_jax._PUBLIC}
    for name in dspark_jax.__all__:
        assert hasattr(dspark_jax, name), name


def test_version_is_the_installed_distributions():
    import dspark_jax

    assert dspark_jax.__version__ == importlib.metadata.version("dspark_jax")


# ----------------------------------------------------------------------------- dependencies

EXTRAS_ONLY = {"fastapi", "uvicorn", "prometheus_client", "pydantic", "matplotlib"}


def _canonical(name: str) -> str:
    return name.lower().replace("_", "-").replace(".", "-")


def test_every_third_party_import_is_declared_in_pyproject():
    # Python >= 3.11; in CI a missing module fails instead of skipping (conftest.IN_CI)
    tomllib = __import__("tomllib") if IN_CI else pytest.importorskip("tomllib")
    from packaging.requirements import Requirement

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    core = {_canonical(Requirement(r).name) for r in project["dependencies"]}
    extras = {_canonical(Requirement(r).name) for rs in project["optional-dependencies"].values() for r in rs}
    dists = importlib.metadata.packages_distributions()
    problems = []
    for mod, tree in sorted(TREES.items()):
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            else:
                continue
            for top in {n.split(".")[0] for n in names} - set(sys.stdlib_module_names) - {"dspark_jax"}:
                declared = {_canonical(d) for d in dists.get(top, [top])}
                where_ok = extras if top in EXTRAS_ONLY else core
                if not declared & where_ok:
                    problems.append(f"{where(mod, node.lineno)}: {top} ({', '.join(sorted(declared))})")
    assert not problems, "imports not declared in pyproject.toml:\n  " + "\n  ".join(sorted(set(problems)))


def _module_level_imports(tree: ast.Module) -> list[tuple[str, int]]:
    """``(absolute name, line)`` of the imports that run when the module is imported: not inside a
    function (``if``/``try``/class bodies at module level count). Relative imports are skipped
    (the package uses absolute ones; :func:`imports_of` resolves them for the graph)."""
    out, todo = [], list(tree.body)
    while todo:
        node = todo.pop()
        if isinstance(node, ast.Import):
            out += [(a.name, node.lineno) for a in node.names]
        elif isinstance(node, ast.ImportFrom) and not node.level:
            out += [(f"{node.module}.{a.name}", node.lineno) for a in node.names]
        elif not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda)):
            todo += list(ast.iter_child_nodes(node))
    return out


def test_core_import_needs_no_extras():
    """``import dspark_jax`` (the API) runs no import of the HTTP server's or the plots' packages:
    the module-level imports reachable from ``dspark_jax`` and ``dspark_jax.api``."""
    seen, todo, problems = set(), ["dspark_jax", "dspark_jax.api"], []
    while todo:
        mod = todo.pop()
        if mod in seen:
            continue
        seen.add(mod)
        for name, line in _module_level_imports(TREES[mod]):
            top = name.split(".")[0]
            if top in EXTRAS_ONLY:
                problems.append(f"{where(mod, line)}: {name}")
            elif top == "dspark_jax":
                todo += [o for o in (_owner(name),) if o] + [p for p in PACKAGES if name.startswith(p + ".")]
    assert "dspark_jax.models.target" in seen
    assert not problems, "the core import needs an extra:\n  " + "\n  ".join(sorted(problems))


# ----------------------------------------------------------------------------- moved names


def _top_level_names(mod: str, seen: frozenset[str] = frozenset()) -> set[str]:
    """Names bound at the top level of package module ``mod`` (through ``import *`` too)."""
    names: set[str] = set()
    todo = list(TREES[mod].body)
    while todo:
        node = todo.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            for a in node.names:
                if a.name == "*" and isinstance(node, ast.ImportFrom):
                    src = _resolve(mod, node)
                    if src in MODULES and src not in seen:
                        names |= _top_level_names(src, seen | {mod})
                else:
                    names.add(a.asname or a.name.split(".")[0])
        elif isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            names |= {n.id for t in targets for n in ast.walk(t) if isinstance(n, ast.Name)}
        elif isinstance(node, (ast.If, ast.Try, ast.With)):
            todo += list(ast.iter_child_nodes(node))
        elif isinstance(node, ast.ExceptHandler):
            todo += node.body
    return names


def test_every_import_of_the_package_resolves():
    """``from dspark_jax.x import y`` anywhere in the package, tests, benchmarks and serve/ names a
    module that exists and a name it defines (catches call sites left behind by a move)."""
    problems = []
    files = [p for d in ("dspark_jax", "tests", "benchmarks", "serve") for p in sorted((ROOT / d).rglob("*.py"))]
    for path in files:
        tree = TREES.get(module_name(path)) if path.is_relative_to(PKG) else ast.parse(path.read_text())
        mod = module_name(path)
        for node in ast.walk(tree):
            rel = path.relative_to(ROOT)
            if isinstance(node, ast.Import):
                problems += [
                    f"{rel}:{node.lineno}: no module {a.name}"
                    for a in node.names
                    if a.name.split(".")[0] == "dspark_jax" and a.name not in MODULES
                ]
            elif isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").split(".")[0] == "dspark_jax"):
                src = _resolve(mod, node)
                if src not in MODULES:
                    problems.append(f"{rel}:{node.lineno}: no module {src}")
                    continue
                defined = _top_level_names(src)
                problems += [
                    f"{rel}:{node.lineno}: {src} has no {a.name}"
                    for a in node.names
                    if a.name != "*" and f"{src}.{a.name}" not in MODULES and a.name not in defined
                ]
    assert not problems, "imports that do not resolve:\n  " + "\n  ".join(problems)
