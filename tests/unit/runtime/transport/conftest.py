"""NIXL and UCX take their settings from this process's environment, and the transport sets them
there by design (runtime/transport/nixl.py: `_load_nixl` quiets NIXL_LOG_LEVEL, and
`apply_ucx_environment` sets runtime.ucx_env's variables before an agent starts). In an engine
that is its own process's business; in the test process every later test's processes would
inherit them (tests/unit/conftest.py), so each transport test gets the environment back as it was."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers import restored_environ


@pytest.fixture(autouse=True)
def _transport_environment_restored() -> Iterator[None]:
    with restored_environ():
        yield
