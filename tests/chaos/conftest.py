"""Every chaos test has a timeout (pytest-timeout): a fault that wedges the cluster instead of
being recovered from fails its test in minutes, and the rest of the suite still runs, instead of
the whole CI job dying at its limit with no result.

The default is about four times the slowest test here as measured on a loaded 2-core machine
(a killed vLLM engine restarted: 70 s with its fixture; most take under 40 s). test_fault_plan,
whose runs are the longest and whose first test also runs the module's fault-free reference, has
its own larger mark; a mark always wins over this default."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.helpers import default_timeout

TIMEOUT_S = 300


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default_timeout(items, Path(__file__).parent, TIMEOUT_S)
