"""Emulation is explicit per deployment (runtime/emulation/choice.py): on for a cluster started
on this machine, off when connecting to an existing one, unless the config says; the driver
resolves it before deploying, so every actor gets an explicit value."""

from __future__ import annotations

import pytest

from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.config import DualPathConfig
from dualpath_ray.runtime.emulation import make_link
from dualpath_ray.runtime.emulation.choice import choose_emulation, resolve_emulation


@pytest.mark.parametrize(
    ("configured", "embedded", "enabled"),
    [(None, True, True), (None, False, False), (True, False, True), (False, True, False), (True, True, True)],
)
def test_the_config_decides_when_it_says_else_embedded_clusters_emulate(
    configured: bool | None, embedded: bool, enabled: bool
) -> None:
    choice = choose_emulation(configured, embedded)
    assert choice.enabled is enabled, f"configured {configured}, embedded {embedded}: emulation {enabled}"
    assert ("ON" if enabled else "off") in choice.line(), f"the log line says which: {choice.line()}"


def test_the_default_is_unset_and_real_hardware_is_not_emulated_by_default() -> None:
    cfg = DualPathConfig()
    assert cfg.emulation.enabled is None, "no silent default: unset until the deployment decides"
    connected, choice = resolve_emulation(cfg, embedded=False)
    assert connected.emulation.enabled is False and "existing cluster" in choice.reason, (
        "connecting to an existing cluster does not emulate unless the config says so"
    )
    embedded, _ = resolve_emulation(cfg, embedded=True)
    assert embedded.emulation.enabled is True, "a cluster started on this machine emulates its NICs"


def test_the_driver_resolves_it_before_anything_is_deployed() -> None:
    cfg = DualPathConfig()
    assert DualPathCluster(cfg, local_cluster=None).cfg.emulation.enabled is False, (
        "DualPathCluster.connect's instance deploys with emulation off"
    )
    started = DualPathCluster(cfg, local_cluster=object())
    assert started.cfg.emulation.enabled is True and started.emulation.enabled, (
        "DualPathCluster.start's instance (the README demo) deploys with emulation on"
    )
    explicit = DualPathCluster(cfg.with_overrides(emulation={"enabled": True}), local_cluster=None)
    assert explicit.cfg.emulation.enabled is True, "the config's true holds on a connected cluster"


def test_a_process_outside_any_deployment_counts_as_this_machine() -> None:
    link = make_link(DualPathConfig(), "snic-read/p0", 8.0)
    assert link.bucket is not None, "an unresolved config (the in-process demo, the harness) paces its links"
