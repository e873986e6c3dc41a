"""The package's shape, from every module's source (ast): no import circles, the pure layers never
import the Ray side, no module over the size limit, no class name used twice.

Pure layers (scheduling, kv, sim, faults, config, protocol, workload, model) hold the policy, the
data formats and the simulator; runtime/ and api/ are built on them, never the other way round.
An import inside a function counts too: a circle hidden in a function is still a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "dualpath_ray"
PURE = ("scheduling", "kv", "sim", "faults", "config", "protocol", "workload", "model")
RAY_SIDE = ("runtime", "api")


def module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def modules() -> dict[str, Path]:
    return {module_name(p): p for p in sorted(PACKAGE.rglob("*.py"))}


def imported(path: Path, name: str, known: set[str]) -> set[str]:
    """The package modules `path` imports (a `from package import module` names the module)."""
    tree = ast.parse(path.read_text(), str(path))
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            targets = [f"{base}.{alias.name}" for alias in node.names if f"{base}.{alias.name}" in known] or [base]
        else:
            continue
        for target in targets:
            while target and target not in known:
                target = target.rpartition(".")[0]
            if target and target != name:
                found.add(target)
    return found


def import_graph(package_modules: dict[str, Path] | None = None) -> dict[str, set[str]]:
    mods = package_modules if package_modules is not None else modules()
    known = set(mods)
    return {name: imported(path, name, known) for name, path in mods.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan), as sorted lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def layer(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def upward(graph: dict[str, set[str]]) -> list[str]:
    return sorted(
        f"{mod} imports {dep}" for mod, deps in graph.items() if layer(mod) in PURE
        for dep in deps if layer(dep) in RAY_SIDE
    )


def test_the_package_has_no_import_circles():
    found = cycles(import_graph())
    assert not found, "modules that import each other, directly or around a circle:\n" + "\n".join(map(str, found))


def test_pure_layers_do_not_import_runtime_or_api():
    found = upward(import_graph())
    assert not found, "a pure layer imports the Ray side:\n" + "\n".join(found)


def test_the_check_finds_a_circle_put_back(tmp_path):
    """The check itself: two modules importing each other (one inside a function) are a circle."""
    package = tmp_path / "dualpath_ray"
    (package / "runtime").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "runtime" / "__init__.py").write_text("")
    (package / "runtime" / "a.py").write_text("from dualpath_ray.runtime.b import B\n")
    (package / "runtime" / "b.py").write_text("def f():\n    from dualpath_ray.runtime import a\n")
    (package / "scheduling.py").write_text("import dualpath_ray.runtime.a\n")
    mods = {module_name_in(p, tmp_path): p for p in package.rglob("*.py")}
    graph = {name: imported(path, name, set(mods)) for name, path in mods.items()}
    assert cycles(graph) == [["dualpath_ray.runtime.a", "dualpath_ray.runtime.b"]], "a two-module circle is found"
    assert upward(graph) == ["dualpath_ray.scheduling imports dualpath_ray.runtime.a"], "an upward import is found"


def module_name_in(path: Path, root: Path) -> str:
    parts = path.relative_to(root).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


@pytest.mark.parametrize("limit", [400])
def test_no_module_is_over_the_size_limit(limit):
    """One concept per file: a module over ~400 lines is two concepts (or a class split by size)."""
    long = sorted(f"{name}: {len(path.read_text().splitlines())} lines" for name, path in modules().items()
                  if len(path.read_text().splitlines()) > limit)
    assert not long, "modules over the size limit:\n" + "\n".join(long)


def test_no_two_classes_share_a_name():
    """One name, one thing: a class name found in two modules is two things a reader confuses."""
    defined: dict[str, list[str]] = {}
    for name, path in modules().items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef):
                defined.setdefault(node.name, []).append(name)
    shared = {cls: where for cls, where in defined.items() if len(where) > 1}
    assert not shared, f"class names defined more than once: {shared}"
