"""Every chaos test has a timeout (pytest-timeout): a fault that wedges the cluster instead of
being recovered from fails the run in minutes, with every thread's stack, instead of the whole CI
job dying at its limit with no result.

The default is over six times the slowest test here as measured on a loaded 2-core machine
(test_fault_plan's first test, with the module's fault-free reference run and its recompute: 91
s; most take under 45 s), and above the tests' own bounds on a rollout that does not end (a
120 s wait for the kill point, then a 300 s join, before test_engine_death's and test_abort's
hang reports), so those reports, not this timeout, explain a hang they catch. A
`pytest.mark.timeout` of a test or module always wins over this default.

Each timeout ends the whole pytest process with every thread's stack (pytest-timeout's thread
method, tests.helpers.default_timeout says why): a test stuck in `ray.get` is beyond the reach
of the signal method.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import default_timeout, ray_test_env

# Ray's test settings (auth off, no usage stats) before any test module here imports ray.
ray_test_env()

TIMEOUT_S = 600


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default_timeout(items, Path(__file__).parent, TIMEOUT_S)
