"""The import structure: floors that import downward, no circles, imports at module tops.

CONVENTIONS.md: a module imports only from its own floor or below, and an import hidden inside a
function to dodge a cycle is a design question, not a fix. These tests read the source (ast; no
import runs), so a change that breaks the layering fails here with the edge named.
"""

from __future__ import annotations

import ast
import pathlib

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGES = ("rl", "sampler", "learner", "launch", "configs")

# Lowest first. A module's floor is that of the longest prefix listed here.
FLOORS: tuple[tuple[str, ...], ...] = (
    # the ground floor: types, pure math, registries, models, rewards, tasks, configs, logging
    (
        "rl",  # the packages themselves (their __init__ modules import nothing upward)
        "sampler",
        "learner",
        "launch",
        "rl.types",
        "rl.sections",
        "rl.registry",
        "rl.compiles",
        "rl.timeline",
        "rl.logs",
        "rl.passk",
        "rl.kl",
        "rl.aggregation",
        "rl.loss_config",
        "rl.losses",
        "rl.advantages",
        "rl.overlong",
        "rl.metrics",
        "rl.metrics_writer",
        "rl.curves",
        "rl.models",
        "rl.rewards",
        "rl.tasks",
        "configs",
    ),
    # policies: pure, clock-free decisions shared by the runtimes and the simulator
    (
        "rl.admission",
        "rl.formation",
        "rl.queue",
        "rl.round_planner",
        "rl.schedules",
        "rl.elastic",
        "rl.runtime.routing",  # request -> replica: pure bookkeeping (learner.mesh checks names)
    ),
    # machines (and their virtual twin): decode, train, simulate
    ("sampler.", "learner.", "rl.sim", "rl.device_split"),
    # a run carried out: the driver, the runtimes, evaluation
    ("rl.driver", "rl.runtime", "rl.evaluate"),
    # a whole run from a config (or a sweep of them)
    ("rl.run", "rl.export_run", "rl.config_check", "rl.sweep"),
    # entry points
    ("launch.",),
)

# Function-level imports of in-house modules that an optional dependency needs (module -> target).
LAZY_ALLOWED = {
    ("rl.runtime.factory", "rl.runtime.ray_runtime"),  # Ray starts only for config.runtime="ray"
}


def _modules() -> dict[str, pathlib.Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = path.relative_to(ROOT).with_suffix("").parts
            name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
            out[name] = path
    return out


MODULES = _modules()


def _resolve(name: str) -> str | None:
    while name and name not in MODULES:
        name = name.rpartition(".")[0]
    return name or None


def _targets(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
    if node.level:
        parts = base.split(".")
        base = ".".join(parts[: len(parts) - node.level + 1])
        name = base + ("." + node.module if node.module else "")
    else:
        name = node.module or ""
    subs = [f"{name}.{a.name}" for a in node.names]
    return subs if all(s in MODULES for s in subs) else [*subs, name]


def _is_type_checking(node: ast.AST) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def _imports() -> tuple[dict[str, set[str]], list[tuple[str, int, str]]]:
    """(module -> in-house modules it imports at run time, [(module, line, target)] of in-house
    imports inside functions or classes)."""
    graph: dict[str, set[str]] = {m: set() for m in MODULES}
    inner: list[tuple[str, int, str]] = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        top = set()
        for stmt in tree.body:
            if _is_type_checking(stmt):
                top.update(id(n) for n in ast.walk(stmt))  # annotations only: not an import
                continue
            if isinstance(stmt, (ast.Import, ast.ImportFrom, ast.If, ast.Try)):
                for n in ast.walk(stmt):
                    if isinstance(n, (ast.Import, ast.ImportFrom)):
                        top.add(id(n))
                        graph[module].update(
                            r for t in _targets(module, n) if (r := _resolve(t)) and r != module
                        )
        for n in ast.walk(tree):
            if isinstance(n, (ast.Import, ast.ImportFrom)) and id(n) not in top:
                for r in {_resolve(t) for t in _targets(module, n)} - {None, module}:
                    graph[module].add(r)
                    inner.append((module, n.lineno, r))
    return graph, inner


GRAPH, INNER = _imports()


def _floor(module: str) -> int:
    best, floor = -1, None
    for i, prefixes in enumerate(FLOORS):
        for p in prefixes:
            hit = (
                module.startswith(p)
                if p.endswith(".")
                else module == p or module.startswith(p + ".")
            )
            if hit and len(p) > best:
                best, floor = len(p), i
    assert floor is not None, f"{module} is on no floor; add it to FLOORS in {__file__}"
    return floor


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in GRAPH[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in MODULES:
        if v not in index:
            visit(v)
    return out


def test_every_module_is_on_a_floor():
    for module in MODULES:
        _floor(module)


def test_no_import_circles():
    assert _cycles() == []


def test_imports_run_downward():
    up = sorted(
        f"{m} (floor {_floor(m)}) imports {t} (floor {_floor(t)})"
        for m, targets in GRAPH.items()
        for t in targets
        if _floor(t) > _floor(m)
    )
    assert up == []


def test_in_house_imports_sit_at_module_tops():
    inner = sorted(f"{m}:{line} imports {t}" for m, line, t in INNER if (m, t) not in LAZY_ALLOWED)
    assert inner == []


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _privates_read_across_modules() -> list[str]:
    """`from x import _y` of an in-house module, and `obj._y` where no `_y` is defined in the
    reading module (a private of another module's object)."""
    out = []
    for module, path in MODULES.items():
        tree = ast.parse(path.read_text())
        own = set()
        for n in ast.walk(tree):
            if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                own.add(n.name)
            elif isinstance(n, ast.Attribute) and isinstance(n.ctx, ast.Store):
                own.add(n.attr)
            elif isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store):
                own.add(n.id)
            elif isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name):
                own.add(n.target.id)
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and _resolve(n.module or ""):
                out += [
                    f"{module}:{n.lineno} imports {n.module}.{a.name}"
                    for a in n.names
                    if _private(a.name)
                ]
            elif isinstance(n, ast.Attribute) and _private(n.attr) and n.attr not in own:
                out.append(f"{module}:{n.lineno} reads {ast.unparse(n)}")
    return sorted(out)


def test_no_module_reads_another_modules_privates():
    assert _privates_read_across_modules() == []
