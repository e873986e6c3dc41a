"""The runtime's compute path needs a measured latency profile: `auto` without
emulation.profile_path is refused at deploy with the fix named; with one, the estimate is that
profile's (no Ray)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath_ray.config import ConfigError, parse_config
from dualpath_ray.model.profile import load_profile_for
from dualpath_ray.runtime.control.scheduler_core import prefill_s_of


def config(compute_path: str, profile: Path | None = None):  # type: ignore[no-untyped-def]
    emulation = {"profile_path": str(profile)} if profile is not None else {}
    return parse_config({"scheduler": {"compute_path": compute_path}, "emulation": emulation}, source="<test>")


def test_auto_without_a_measured_profile_is_refused_naming_the_fix() -> None:
    with pytest.raises(ConfigError, match="emulation.profile_path is unset.*dualpath profile"):
        prefill_s_of(config("auto"))
    assert prefill_s_of(config("off")) is None, "off needs no latency model"


def test_with_a_profile_the_estimate_is_its_forward_time(tmp_path: Path) -> None:
    profile = load_profile_for(config("off"))  # the built-in one, saved as if it had been measured
    path = tmp_path / "profile.json"
    profile.save(path)
    estimate = prefill_s_of(config("auto", path))
    assert estimate is not None
    assert estimate(1024, 512) == pytest.approx(profile.forward_ms([(1024, 512)]) / 1000.0), (
        "one request's prefill seconds are the profile's forward time of (cached, new)"
    )
    assert estimate(1024, 0) == 0.0, "nothing to compute costs nothing"
