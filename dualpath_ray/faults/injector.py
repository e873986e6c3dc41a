"""A process's fault injector: decides at each event of a site whether to inject, and counts.

Each process (actor) builds one from the config's plan and its own actor name. Decisions come
from one random stream per (plan seed, actor, fault) so a rerun injects at the same events; the
counters say how many eligible events each fault saw and how many it injected, so a test can
check detected == injected and that every site was hit.
"""

from __future__ import annotations

import logging
import os
import random
import sys
import threading
import time
import zlib
from dataclasses import dataclass

from dualpath_ray.faults.plan import CallPhase, FaultMode, FaultPlan, FaultSite, FaultSpec

LOG = logging.getLogger("dualpath_ray.faults")


class InjectedFault(RuntimeError):
    """An operation failed because the fault plan said so (never raised without a plan)."""

    def __init__(self, site: str, detail: str) -> None:
        super().__init__(f"injected {site} fault: {detail}")
        self.site = site
        self.detail = detail

    def __reduce__(self) -> tuple[type, tuple[str, str]]:
        return (type(self), (self.site, self.detail))


@dataclass
class FaultCount:
    events: int = 0
    injected: int = 0


def fault_label(spec: FaultSpec) -> str:
    label = f"{spec.site.value}:{spec.mode.value}"
    if spec.site is FaultSite.ACTOR_CALL and spec.mode is FaultMode.FAIL:
        label += f":{spec.phase.value}"
    return label


class FaultInjector:
    """Thread-safe; `decide` is the only entry point of the sites."""

    def __init__(self, plan: FaultPlan, actor: str, restarted: bool = False) -> None:
        self.actor = actor
        # A kill ends an actor's first incarnation only: Ray's restart is the recovery from it,
        # and killing every incarnation at its n-th event would only use the restarts up.
        self._specs = [
            spec for spec in plan.faults
            if spec.applies_to(actor) and not (restarted and spec.mode is FaultMode.KILL)
        ]
        self._rngs = [random.Random(zlib.crc32(f"{plan.seed}/{actor}/{i}".encode())) for i in range(len(self._specs))]
        self._counts = [FaultCount() for _ in self._specs]
        # Where a corrupt fault flips its byte: a stream of its own, so it does not shift decisions.
        self.corruption_rng = random.Random(zlib.crc32(f"{plan.seed}/{actor}/corrupt".encode()))
        self._lock = threading.Lock()

    @property
    def active(self) -> bool:
        return bool(self._specs)

    def decide(self, site: FaultSite, method: str | None = None) -> FaultSpec | None:
        """One eligible event at `site`: the fault to apply, or None. Delays are served here and
        a kill ends the process here; the caller applies fail, corrupt and drop itself."""
        chosen = None
        with self._lock:
            for index, spec in enumerate(self._specs):
                if spec.site is not site or (method is not None and method not in spec.methods):
                    continue
                if spec.phase is CallPhase.RESPONSE and spec.site is FaultSite.ACTOR_CALL:
                    continue  # asked after the call (fail_call)
                count = self._counts[index]
                count.events += 1
                if chosen is None and self._fires(spec, count, self._rngs[index]):
                    count.injected += 1
                    chosen = spec
        if chosen is None:
            return None
        if chosen.mode is FaultMode.DELAY:
            time.sleep(chosen.delay_s)
            return None
        if chosen.mode is FaultMode.KILL:
            LOG.warning("%s: fault plan kills this process at %s", self.actor, site.value)
            sys.stderr.flush()
            os._exit(1)
        return chosen

    def fail_call(self, method: str, phase: CallPhase) -> bool:
        """Whether this call's `phase` (request or response) is to be lost."""
        spec = self.decide(FaultSite.ACTOR_CALL, method) if phase is CallPhase.REQUEST else self._pending_response(method)
        return spec is not None and spec.mode is FaultMode.FAIL and spec.phase is phase

    def _pending_response(self, method: str) -> FaultSpec | None:
        # Response faults are separate specs (phase: response); only they are asked here, so a
        # call counts one event for its request specs and one for its response specs.
        with self._lock:
            for index, spec in enumerate(self._specs):
                if spec.site is not FaultSite.ACTOR_CALL or spec.phase is not CallPhase.RESPONSE or method not in spec.methods:
                    continue
                count = self._counts[index]
                count.events += 1
                if self._fires(spec, count, self._rngs[index]):
                    count.injected += 1
                    return spec
        return None

    @staticmethod
    def _fires(spec: FaultSpec, count: FaultCount, rng: random.Random) -> bool:
        draw = rng.random()  # drawn for every event, so the stream does not depend on earlier outcomes
        if spec.max_count is not None and count.injected >= spec.max_count:
            return False
        if spec.nth is not None:
            return count.events == spec.nth
        if count.events <= spec.after:
            return False
        if count.injected < spec.min_count:
            return True
        return draw < spec.probability

    def counts(self) -> dict[str, FaultCount]:
        """label ("site:mode[:phase]") -> events seen and injections, summed over this process's faults."""
        out: dict[str, FaultCount] = {}
        with self._lock:
            for spec, count in zip(self._specs, self._counts):
                total = out.setdefault(fault_label(spec), FaultCount())
                total.events += count.events
                total.injected += count.injected
        return out


def merge_counts(parts: list[dict[str, FaultCount]]) -> dict[str, FaultCount]:
    """Sum the counters of several processes (cluster.fault_counts)."""
    total: dict[str, FaultCount] = {}
    for part in parts:
        for label, count in part.items():
            into = total.setdefault(label, FaultCount())
            into.events += count.events
            into.injected += count.injected
    return total
