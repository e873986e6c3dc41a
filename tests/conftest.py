"""Session-wide hooks: the test command's exit status is pytest's, not a native finaliser's; and the
embedded Ray cluster that integration and chaos tests share (`cluster_for`, tests/shared_cluster.py).

Native libraries run threads inside the pytest process: Ray's core worker and gRPC (every
integration test drives its cluster from here), UCX's progress thread under NIXL, torch's pools.
During interpreter finalisation, after pytest has reported every result, one of them can call
into memory that finalisation already freed: CI once saw `766 passed, 7 skipped` and then the
process die of SIGSEGV (exit 139; the kernel log: a thread of the pytest process jumping into the
heap), which failed a run whose every test had passed. So once pytest is done, the process
disconnects from Ray and ends with pytest's exit status without running finalisers.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import pytest

if TYPE_CHECKING:
    from tests.shared_cluster import SharedCluster

_EXIT_STATUS = pytest.StashKey[int]()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    session.config.stash[_EXIT_STATUS] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config: pytest.Config) -> None:
    status = config.stash.get(_EXIT_STATUS, None)
    if status is None:  # pytest stopped before running a session (bad options, --help)
        return
    ray = sys.modules.get("ray")
    if ray is not None and ray.is_initialized():
        ray.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Within each run of consecutive items from one test directory, the modules that share the
    embedded cluster run first, in their collected order, then the rest: a module that starts a
    cluster of its own stops the shared one (a driver holds one Ray connection), so interleaved
    they would start it again after each. Nothing moves across directories. Trylast: after
    pytest grouped the items of module-scoped parameters, an order this stable sort keeps
    within each module."""
    sharing = {item.module for item in items
               if isinstance(item, pytest.Function) and "shared_cluster" in item.fixturenames}
    keys: list[tuple[int, int, int]] = []
    run = 0
    for index, item in enumerate(items):
        if index and item.path.parent != items[index - 1].path.parent:
            run += 1
        keys.append((run, 0 if getattr(item, "module", None) in sharing else 1, index))
    items[:] = [item for _, item in sorted(zip(keys, items), key=lambda keyed: keyed[0])]


@pytest.fixture(scope="session")
def shared_cluster() -> Iterator[SharedCluster]:
    from tests.shared_cluster import SharedCluster

    shared = SharedCluster()
    try:
        yield shared
    finally:
        shared.close()


@pytest.fixture
def cluster_for(shared_cluster: SharedCluster) -> Iterator[Callable[..., Any]]:
    """`cluster_for(cfg, mode=None)`: the session's shared embedded cluster with `cfg` deployed
    (started at first use, and again for another cluster section), its deployment torn down
    after the test. For a test that only needs a deployment, not a Ray cluster of its own; a
    module whose tests share one deployment uses `shared_cluster.deployed(cfg, mode)` in a
    module-scoped fixture instead."""
    try:
        yield shared_cluster.deploy
    finally:
        shared_cluster.end_deployment()


@pytest.fixture(scope="module", autouse=True)
def _one_embedded_cluster_at_a_time(request: pytest.FixtureRequest) -> None:
    """A driver holds one Ray connection: before an integration or chaos module none of whose
    tests share the cluster (through `cluster_for`, or a module fixture of its own on
    `shared_cluster`), the shared cluster, if up, is stopped: the module starts its own, or a
    `ray start` one. (Unit modules never touch it: they import no Ray.)"""
    module = request.module
    if not module.__name__.startswith(("tests.integration.", "tests.chaos.")):
        return
    if any("shared_cluster" in getattr(item, "fixturenames", ()) for item in request.session.items
           if getattr(item, "module", None) is module):
        return
    request.getfixturevalue("shared_cluster").close()
