"""A MetricSink that keeps what would go to Ray, for unit tests of what the exporters record."""

from __future__ import annotations

from collections import defaultdict
from typing import Mapping

from dualpath_ray.metrics import MetricKind, MetricSpec


def key(tags: Mapping[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted(tags.items()))


class RecordingSink:
    """Counters summed, gauges' last values, histograms' observations; by (metric, tags)."""

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self.counters: dict[tuple[str, tuple[tuple[str, str], ...]], float] = defaultdict(float)
        self.gauges: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
        self.observations: dict[tuple[str, tuple[tuple[str, str], ...]], list[float]] = defaultdict(list)
        self.increments = 0

    def _check(self, spec: MetricSpec, kind: MetricKind, tags: Mapping[str, str]) -> None:
        assert spec.kind is kind, f"{spec.name} is a {spec.kind.value}, recorded as a {kind.value}"
        assert sorted(tags) == sorted(spec.tags), f"{spec.name} takes tags {spec.tags}, got {sorted(tags)}"

    def inc(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._check(spec, MetricKind.COUNTER, tags)
        assert value > 0, f"{spec.name}: Ray refuses a counter increment of {value}"
        self.counters[(spec.name, key(tags))] += value
        self.increments += 1

    def set(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._check(spec, MetricKind.GAUGE, tags)
        self.gauges[(spec.name, key(tags))] = value

    def observe(self, spec: MetricSpec, value: float, tags: Mapping[str, str]) -> None:
        self._check(spec, MetricKind.HISTOGRAM, tags)
        self.observations[(spec.name, key(tags))].append(value)

    def counter(self, spec: MetricSpec, **tags: str) -> float:
        return self.counters.get((spec.name, key(tags)), 0.0)

    def gauge(self, spec: MetricSpec, **tags: str) -> float | None:
        return self.gauges.get((spec.name, key(tags)))
