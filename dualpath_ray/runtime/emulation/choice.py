"""Whether a deployment emulates its hardware, decided once by the driver and said out loud.

`emulation.enabled` left unset means: emulate (NIC token buckets at the cluster section's rates)
on a cluster dualpath starts on this machine, where the paper's NICs are absent, and not on a
cluster it connects to, which is presumably real hardware; true or false in the config decides
either way. The driver resolves it before anything is deployed (`DualPathCluster`), so every
actor gets an explicit value, logs the choice as its first line, and `dualpath status` shows it
(each reader reports whether its links are paced).
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath_ray.config import DualPathConfig


@dataclass(frozen=True)
class EmulationChoice:
    enabled: bool
    reason: str

    def line(self) -> str:
        """The log line that says which."""
        state = "ON: NIC rates are emulated by token buckets" if self.enabled else "off: NICs run at their real rates"
        return f"dualpath emulation {state} ({self.reason})"


def choose_emulation(configured: bool | None, embedded: bool) -> EmulationChoice:
    """The choice for a deployment: the config's when it says, else on exactly when embedded."""
    if configured is not None:
        return EmulationChoice(configured, f"emulation.enabled: {str(configured).lower()} in the config")
    if embedded:
        return EmulationChoice(True, "a cluster started on this machine; emulation.enabled: false turns it off")
    return EmulationChoice(False, "connected to an existing cluster; emulation.enabled: true turns it on")


def resolve_emulation(cfg: DualPathConfig, embedded: bool) -> tuple[DualPathConfig, EmulationChoice]:
    """The config with `emulation.enabled` made explicit for this deployment, and the choice."""
    choice = choose_emulation(cfg.emulation.enabled, embedded)
    if cfg.emulation.enabled == choice.enabled:
        return cfg, choice
    return cfg.with_overrides(emulation={"enabled": choice.enabled}), choice
