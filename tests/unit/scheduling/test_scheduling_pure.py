"""The scheduling package is pure: no Ray, so the runtime and the simulator share it unchanged."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dualpath_ray.scheduling as scheduling

PACKAGE_DIR = Path(scheduling.__file__).parent


def _imported_roots(source: str) -> set[str]:
    roots: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            roots.add(node.module.split(".")[0])
    return roots


def test_no_module_in_the_package_imports_ray() -> None:
    modules = sorted(PACKAGE_DIR.rglob("*.py"))
    assert len(modules) >= 2, f"expected the scheduling modules under {PACKAGE_DIR}"
    for module in modules:
        roots = _imported_roots(module.read_text())
        assert "ray" not in roots, f"{module.name} imports ray; the policy must stay Ray-free"
        assert "importlib" not in roots, f"{module.name} imports modules dynamically; keep imports static"


def test_importing_the_package_does_not_load_ray() -> None:
    probe = (
        "import sys, dualpath_ray.scheduling\n"
        "loaded = sorted(m for m in sys.modules if m == 'ray' or m.startswith('ray.'))\n"
        "print(','.join(loaded))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True
    )
    assert result.stdout.strip() == "", f"importing dualpath_ray.scheduling loaded {result.stdout.strip()}"


def test_the_scheduler_core_loads_neither_ray_nor_torch() -> None:
    """The simulator drives the scheduler core at cluster scale: it must stay light and pure."""
    probe = (
        "import sys, dualpath_ray.scheduling.scheduler\n"
        "heavy = sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch'))\n"
        "print(','.join(heavy))\n"
    )
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "", f"the scheduler core pulled in {result.stdout.strip()}"


def test_the_scheduler_actor_module_starts_without_torch() -> None:
    """A restarted scheduler imports only what it needs (no torch): the time Ray takes to bring
    it back is time no request is placed."""
    probe = "import sys, dualpath_ray.runtime.control.scheduler\nprint('torch' in sys.modules)\n"
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "False", "importing the Scheduler actor's module loads torch"
