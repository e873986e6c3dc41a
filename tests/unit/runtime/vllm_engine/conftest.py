"""The VllmConfig these modules build vLLM's KV cache views from."""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

import pytest

from tests.helpers import restored_environ

if TYPE_CHECKING:
    from vllm.config import VllmConfig


@pytest.fixture(scope="module")
def vllm_config() -> Iterator[VllmConfig]:
    """A default VllmConfig, vLLM's environment restored after the module: building one runs the
    CPU platform's config check, which sets this process's vLLM CPU variables (LD_PRELOAD of
    torch's libgomp, LOCAL_WORLD_SIZE, NUMEXPR_MAX_THREADS, ...). A Ray worker or spawned
    process a later test starts would inherit them, and vLLM engines there failed their CPU
    attention's thread check (tests/unit/conftest.py)."""
    pytest.importorskip("vllm")
    from vllm.config import VllmConfig

    with restored_environ():
        yield VllmConfig()
