"""Every integration test has a timeout (pytest-timeout), so a hang fails the run in minutes, with
every thread's stack, instead of the whole CI job dying at its limit with no result.

The default is about four times the slowest test here as measured on a loaded 2-core machine
(test_runtime's first test, its module fixture included: 71 s; most take under 40 s), so a slow
CI machine does not trip it. Modules that need more, or less, say so with their own
`pytest.mark.timeout` (test_jobs, test_observability and test_rl_example_job start and stop
`ray start` clusters; test_long_prompts, test_transport, ...), and a mark always wins over this
default.

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

TIMEOUT_S = 300


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    default_timeout(items, Path(__file__).parent, TIMEOUT_S)
