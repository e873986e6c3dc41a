"""State a front-end actor must find again after Ray restarts it, kept outside its process.

Ray restarts a dead actor by running its `__init__` again with the same arguments: what the dead
process learnt later (the rollout-server's weight version after a trainer's update, verl's step
and submission gate, the port the openai-server bound) would be lost. Such an actor writes that
state here whenever it changes, and a restarted incarnation reads it back. The record lives in
Ray's GCS key-value store (one small JSON object per actor name and Ray namespace), which lives
as long as the cluster: its head is the one thing every actor already depends on.

Only a restarted incarnation reads the record; a first one writes its own at once, so a record a
crashed deployment left in the same namespace is never taken for this one's. `forget` (called
at teardown) removes it.
"""

from __future__ import annotations

import json
from typing import Any

from ray.experimental import internal_kv

# The GCS key-value namespace of these records (not a Ray actor namespace).
KV_NAMESPACE = "dualpath-kept-state"


class KeptState:
    """The record of actor `actor` of the deployment in Ray namespace `namespace`."""

    def __init__(self, namespace: str, actor: str) -> None:
        self.key = f"{namespace}/{actor}"

    def save(self, state: dict[str, Any]) -> None:
        """Replace the record (JSON-serialisable values only). Blocking, about a millisecond:
        called on rare changes (a weight version, a verl step, a bound port), never per turn."""
        internal_kv._internal_kv_put(self.key, json.dumps(state, sort_keys=True), True, namespace=KV_NAMESPACE)

    def load(self) -> dict[str, Any]:
        """The last record saved ({} when none was)."""
        raw = internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        return dict(json.loads(raw)) if raw else {}

    def forget(self) -> None:
        internal_kv._internal_kv_del(self.key, namespace=KV_NAMESPACE)


class IncarnationCounter:
    """How many incarnations of actor `actor` (in Ray namespace `namespace`) began, kept in the
    GCS: `begin` counts one more and returns its number (1 for the first). Unlike a clock, it
    never goes back (an NTP step, another host's clock), so numbers derived from it order the
    incarnations for sure. One incarnation runs at a time (Ray restarts an actor only once the
    old process is gone), so the read-then-write needs no lock."""

    def __init__(self, namespace: str, actor: str) -> None:
        self.key = f"{namespace}/{actor}/incarnations"

    def begin(self) -> int:
        raw = internal_kv._internal_kv_get(self.key, namespace=KV_NAMESPACE)
        number = (int(raw) if raw else 0) + 1
        internal_kv._internal_kv_put(self.key, str(number), True, namespace=KV_NAMESPACE)
        return number
