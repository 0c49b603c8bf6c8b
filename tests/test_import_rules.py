"""The allowed dependency directions of docs/architecture.md, checked statically.

Every module under runtime/ and telemetry/ is parsed with `ast` (nothing is imported). Imports at module
level and inside functions both count; a failure names each offending import as `file:line` and says when
it sits inside a function. `from pkg import name` counts as importing `pkg.name` when that is a module. An
import of `a.b.c` also runs the `__init__` of `a` and `a.b`, so those packages count as imported too (unless
the importer lives inside them). Imports built at run time (`importlib.import_module`) are not seen.
"""

from __future__ import annotations

import ast
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("runtime", "telemetry")


@dataclass(frozen=True)
class Import:
    importer: str  # dotted module name of the importing file
    file: str  # the importing file, relative to the root
    line: int
    target: str  # dotted name of what is imported
    function: str | None  # enclosing function, None at module level
    via: str | None = None  # for a package whose __init__ runs implicitly: the module actually named

    def where(self) -> str:
        inside = f" (inside {self.function}())" if self.function else ""
        return f"{self.file}:{self.line}{inside}"

    def what(self) -> str:
        return f"{self.target} (its __init__, via {self.via})" if self.via else self.target


def module_files(root: Path) -> dict[str, Path]:
    """Dotted module name -> file, for every .py under the checked packages (a package is its __init__)."""
    modules = {}
    for package in PACKAGES:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


class _ImportVisitor(ast.NodeVisitor):
    def __init__(self, module: str, is_package: bool, known: Iterable[str]):
        self.module, self.is_package, self.known = module, is_package, set(known)
        self.functions: list[str] = []
        self.found: list[tuple[int, str, str | None]] = []

    def _function(self, node) -> None:
        self.functions.append(node.name)
        self.generic_visit(node)
        self.functions.pop()

    visit_FunctionDef = visit_AsyncFunctionDef = _function

    def _add(self, line: int, target: str) -> None:
        self.found.append((line, target, self.functions[-1] if self.functions else None))

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node.lineno, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against the importing package
            package = self.module.split(".")
            if not self.is_package:
                package = package[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            self._add(node.lineno, sub if sub in self.known else base)


def parse(path: Path) -> ast.Module:
    """`ast.parse`, retried once: on Python 3.11 the AST converter's recursion counter is shared between
    threads (gh-106905), so a traceback formatted by another thread at that moment (3.11 parses source for its
    carets) fails this parse with a SystemError that says nothing about the file."""
    source = path.read_text()
    try:
        return ast.parse(source, filename=str(path))
    except SystemError:
        return ast.parse(source, filename=str(path))


def scan(root: Path) -> tuple[Import, ...]:
    modules = module_files(root)
    imports = []
    for module, path in modules.items():
        visitor = _ImportVisitor(module, path.name == "__init__.py", modules)
        visitor.visit(parse(path))
        file = str(path.relative_to(root))
        for line, target, function in visitor.found:
            imports.append(Import(module, file, line, target, function))
            # Importing a.b.c runs the __init__ of a and a.b first.
            parts = target.split(".")
            for i in range(1, len(parts)):
                package = ".".join(parts[:i])
                if package in modules and not within(module, package):
                    imports.append(Import(module, file, line, package, function, via=target))
    return tuple(imports)


def within(name: str, prefix: str) -> bool:
    return name == prefix or name.startswith(prefix + ".")


def forbidden(root: Path, importers: tuple[str, ...], targets: dict[str, str]) -> list[str]:
    """`file:line imports X (why)` for each import from a module under `importers` of a module under a key
    of `targets` (whose value says why it is forbidden). Package inits run implicitly are left out: the module
    that was named is reported instead."""
    lines = []
    for imp in scan(root):
        if imp.via or not any(within(imp.importer, p) for p in importers):
            continue
        for target, why in targets.items():
            if within(imp.target, target):
                lines.append(f"  {imp.where()} imports {imp.target} ({why})")
                break
    return sorted(set(lines))


def cycles(root: Path) -> list[str]:
    """One entry per import cycle among the checked modules: the modules in order, then each step's import as
    `file:line`."""
    modules = module_files(root)
    edges: dict[str, dict[str, Import]] = {m: {} for m in modules}
    for imp in scan(root):
        if imp.target in modules and imp.target != imp.importer:
            first = edges[imp.importer].get(imp.target)
            # Name the module-level import where there is one: it is the one that runs at import time.
            if first is None or (first.function is not None and imp.function is None):
                edges[imp.importer][imp.target] = imp
    found = []
    for component in _strongly_connected(edges):
        if len(component) > 1:
            path = _cycle_through(min(component), edges, component)
            steps = [edges[a][b] for a, b in zip(path, path[1:])]
            others = sorted(component - set(path))
            also = f"\n    (the cycle also reaches {', '.join(others)})" if others else ""
            found.append("  " + " -> ".join(path) + also + "\n" + "\n".join(
                f"      {s.where()} imports {s.what()}" for s in steps))
    return found


def _strongly_connected(edges: dict[str, dict[str, Import]]) -> list[set[str]]:
    """Tarjan's algorithm."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            components.append(component)

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return components


def _cycle_through(start: str, edges: dict[str, dict[str, Import]], component: set[str]) -> list[str]:
    """The shortest path start -> ... -> start inside one strongly connected component (breadth first)."""
    parent: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges[v]):
                if w not in component or w in parent:
                    continue
                if w == start:
                    path = [start, v]  # walked backwards
                    while path[-1] != start:
                        path.append(parent[path[-1]])
                    return path[::-1]
                parent[w] = v
                nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start}")


# ---- the rules ------------------------------------------------------------------------------------------------
EXECUTOR = "the executor: model runner, graph runner, forward batch"

# rule -> (failure message, importing packages, {forbidden package: why}); the first matching target names it.
RULES = {
    "telemetry_is_a_leaf": (
        "telemetry must not import runtime (it knows events, sites and numbers, not engines)",
        ("telemetry",), {"runtime": "the engine"},
    ),
    "mem_cache_is_told_the_forward": (
        "runtime/mem_cache must not import the scheduler, the executor or the forward context",
        ("runtime.mem_cache",),
        {"runtime.scheduler": "the scheduler", "runtime.executor": EXECUTOR,
         "runtime.context": "the global forward context: the pool is told which forward runs"},
    ),
    "scheduler_imports_no_model_code": (
        "runtime/scheduler must not import model, layer, attention or executor code, nor torch-side sampling",
        ("runtime.scheduler",),
        {"runtime.layers.sampler": "torch-side sampling belongs to the engine", "runtime.models": "model code",
         "runtime.layers": "layer code", "runtime.attention": "attention backends", "runtime.executor": EXECUTOR},
    ),
    "no_server_below_the_engine": (
        "runtime/mem_cache and telemetry must not import runtime/server",
        ("runtime.mem_cache", "telemetry"), {"runtime.server": "the HTTP server"},
    ),
}


@pytest.mark.parametrize("rule", sorted(RULES))
def test_forbidden_imports(rule):
    message, importers, targets = RULES[rule]
    violations = forbidden(ROOT, importers, targets)
    assert not violations, message + ":\n" + "\n".join(violations)


def test_no_import_cycles():
    found = cycles(ROOT)
    assert not found, "import cycles among runtime/ and telemetry/ modules:\n" + "\n".join(found)


def test_the_scan_sees_the_tree():
    """The rules above pass vacuously if the scan finds nothing: check it sees known imports."""
    modules = module_files(ROOT)
    assert {"runtime", "runtime.engine", "runtime.mem_cache.translation", "telemetry.names"} <= set(modules)
    imports = scan(ROOT)
    assert any(i.importer == "telemetry.collector" and i.target == "telemetry.names" and i.function is None
               for i in imports)
    assert any(i.importer == "runtime.cli" and i.target == "runtime.server.launch" and i.function == "cmd_serve"
               for i in imports)


PLANTED = {
    # rule -> (file, source) that breaks it in a tree of its own
    "telemetry_is_a_leaf": ("telemetry/bad.py", "from runtime import config\n"),
    "mem_cache_is_told_the_forward": ("runtime/mem_cache/bad.py", "def f():\n    from runtime.context import x\n"),
    "scheduler_imports_no_model_code": ("runtime/scheduler/bad.py", "from runtime.layers.sampler import sample\n"),
    "no_server_below_the_engine": ("telemetry/bad.py", "import runtime.server.app\n"),
}
SKELETON = ("runtime/__init__.py", "runtime/config.py", "runtime/context.py", "runtime/mem_cache/__init__.py",
            "runtime/scheduler/__init__.py", "runtime/layers/__init__.py", "runtime/layers/sampler.py",
            "runtime/server/__init__.py", "runtime/server/app.py", "telemetry/__init__.py")


def _tree(tmp_path: Path, files: dict[str, str]) -> Path:
    for name in SKELETON:
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).touch()
    for name, source in files.items():
        (tmp_path / name).write_text(source)
    return tmp_path


@pytest.mark.parametrize("rule", sorted(PLANTED))
def test_each_rule_catches_a_planted_import(tmp_path, rule):
    file, source = PLANTED[rule]
    root = _tree(tmp_path, {file: source})
    _, importers, targets = RULES[rule]
    (violation,) = forbidden(root, importers, targets)
    last_line = source.count("\n")
    assert violation.startswith(f"  {file}:{last_line}")
    assert forbidden(_tree(tmp_path, {file: ""}), importers, targets) == []


def test_the_cycle_check_catches_a_planted_cycle(tmp_path):
    root = _tree(tmp_path, {
        "runtime/a.py": "from . import b\n",
        "runtime/b.py": "import telemetry.c\n",
        "telemetry/c.py": "def late():\n    from runtime.a import thing\n",
    })
    (cycle,) = cycles(root)
    assert cycle.splitlines() == [
        "  runtime.a -> runtime.b -> telemetry.c -> runtime.a",
        "      runtime/a.py:1 imports runtime.b",
        "      runtime/b.py:1 imports telemetry.c",
        "      telemetry/c.py:2 (inside late()) imports runtime.a",
    ]
    assert cycles(_tree(tmp_path, {"telemetry/c.py": ""})) == []
