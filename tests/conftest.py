"""Session-wide hooks: the test command's exit status is pytest's, not a native finaliser's.

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

import pytest

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
