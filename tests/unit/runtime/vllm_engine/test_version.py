"""The vLLM version check VllmHost makes before it builds an engine (version.py)."""

from __future__ import annotations

import logging

import pytest

from dualpath_ray.runtime.vllm_engine.version import (
    ALLOW_ENV,
    TESTED_RANGE,
    check_vllm_version,
    is_tested,
)


@pytest.mark.parametrize("version", ["0.32.0", "0.32.1", "0.32.0rc1", "0.32.2.dev3+g1a2b3c", "0.32.0+cpu"])
def test_tested_versions_pass(version: str) -> None:
    assert is_tested(version), f"{version} is a 0.32.x release: inside the tested range"
    check_vllm_version(version, allow_untested=False)


@pytest.mark.parametrize("version", ["0.31.9", "0.33.0", "1.0.0", "0.11.2", "dev"])
def test_an_untested_version_fails_naming_it_the_range_and_the_fix(version: str) -> None:
    assert not is_tested(version), f"{version} is outside 0.32.x (or unparsable): untested"
    with pytest.raises(RuntimeError) as info:
        check_vllm_version(version, allow_untested=False)
    message = str(info.value)
    for part, why in [
        (f"vLLM {version} is installed", "the installed version"),
        (TESTED_RANGE, "the tested range"),
        ("pip install 'vllm>=0.32,<0.33'", "the fix"),
        (f"{ALLOW_ENV}=1", "the way to run it anyway"),
    ]:
        assert part in message, f"the refusal names {why}: {message}"


def test_allowing_untested_versions_warns_instead(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="dualpath_ray.vllm"):
        check_vllm_version("0.33.0", allow_untested=True)
    assert any("vLLM 0.33.0" in r.getMessage() and ALLOW_ENV in r.getMessage() for r in caplog.records), (
        "an allowed untested vLLM is a logged warning naming the version and the override"
    )


def test_the_installed_vllm_is_tested() -> None:
    pytest.importorskip("vllm")
    check_vllm_version(allow_untested=False)
