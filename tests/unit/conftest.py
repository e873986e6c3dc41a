"""A unit test leaves the process as it found it: the environment, torch's thread count and
`torch.set_num_threads` itself. Everything a test process starts later inherits them: a Ray
cluster's workers and a spawned process take its environment, and a unit test that built a vLLM
config once left vLLM's CPU settings in it (LD_PRELOAD of torch's libgomp among them), after
which every vLLM prefill step of a later integration test in the same pytest run failed inside
vLLM's CPU attention (`cpu_attn_impl.hpp: Check failed: input->metadata->thread_num ==
thread_num (2 vs. 1)`). CI runs unit tests last, so only another order showed it.

Checked per test, and per module for module-scoped fixtures (the check's module fixture is set
up before the module's own and torn down after them); a change fails the test or module that
made it, naming what changed. A fixture that must change them restores them (monkeypatch, or
`restored_environ` in tests/helpers.py).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from typing import Any

import pytest

# Set by pytest itself around every test phase.
_PYTEST_OWN = frozenset({"PYTEST_CURRENT_TEST"})


def _process_state() -> tuple[dict[str, str], Any, Any]:
    env = {name: value for name, value in os.environ.items() if name not in _PYTEST_OWN}
    torch = sys.modules.get("torch")
    if torch is None:
        return env, None, None
    return env, torch.get_num_threads(), torch.set_num_threads


def _check_left_as_found(before: tuple[dict[str, str], Any, Any], what: str) -> None:
    """Fail `what` if the process state differs from `before`; put `before` back first, so the
    failure is this test's alone and not every later one's too."""
    env, threads, setter = before
    after_env, after_threads, after_setter = _process_state()
    changed = sorted(name for name in env.keys() | after_env.keys() if env.get(name) != after_env.get(name))
    problems = [f"environment variables {', '.join(f'{n}: {env.get(n)!r} -> {after_env.get(n)!r}' for n in changed)}"] if changed else []
    for name in changed:
        if name in env:
            os.environ[name] = env[name]
        else:
            del os.environ[name]
    torch = sys.modules.get("torch")
    if setter is not None and after_setter is not setter:
        problems.append(f"torch.set_num_threads replaced by {after_setter!r}")
        torch.set_num_threads = setter
    if threads is not None and after_threads != threads:
        problems.append(f"torch.get_num_threads() {threads} -> {after_threads}")
        torch.set_num_threads(threads)
    if problems:
        pytest.fail(
            f"{what} changed process-wide state that later tests and the processes they start inherit: "
            f"{'; '.join(problems)}. Restore it where it is changed (monkeypatch, tests/helpers.py restored_environ)",
            pytrace=False,
        )


@pytest.fixture(scope="module", autouse=True)
def _module_leaves_process_state(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _process_state()
    yield
    _check_left_as_found(before, f"module {request.node.nodeid} (a module-scoped fixture)")


@pytest.fixture(autouse=True)
def _test_leaves_process_state(request: pytest.FixtureRequest) -> Iterator[None]:
    before = _process_state()
    yield
    _check_left_as_found(before, f"test {request.node.nodeid}")
