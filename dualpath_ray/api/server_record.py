"""What the `rollout-server` (api/server.py) must find again after Ray restarts it: its weight
version and verl's state (the training step, the submission gate, the OpenAI endpoint's address),
saved on every change in its kept record (runtime/restarts/kept_state.py) and read back by a
restarted incarnation. Turns and session numbers are not kept (see api/server.py)."""

from __future__ import annotations

from typing import Any

from dualpath_ray.api.verl_server import VerlServerControl
from dualpath_ray.runtime.restarts.kept_state import KeptState


class ServerRecord:
    def __init__(self, kept: KeptState) -> None:
        self.kept = kept

    def save(self, weight_version: int, verl: VerlServerControl) -> None:
        gate = verl.gate
        self.kept.save({
            "weight_version": weight_version, "global_steps": verl.global_steps, "http_address": verl.http_address,
            "gate_closed": not gate.opened.is_set(), "gate_rejecting": gate.rejecting,
        })

    def restore(self, weight_version: int, verl: VerlServerControl) -> int:
        """Put the saved verl state back into `verl`; returns the saved weight version
        (`weight_version`, the configured one, when nothing was saved)."""
        record: dict[str, Any] = self.kept.load()
        verl.global_steps = record.get("global_steps")
        address = record.get("http_address")
        verl.http_address = (str(address[0]), int(address[1])) if address else None
        if record.get("gate_closed"):
            verl.gate.close(bool(record.get("gate_rejecting")))
        return int(record.get("weight_version", weight_version))
