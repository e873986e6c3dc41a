"""Every metric dualpath_ray exports, defined in this one place (docs/metrics.md documents them).

Metrics are `ray.util.metrics` objects: each actor process records them and its node's Ray
metrics agent serves them to Prometheus, where Ray prefixes every name with `ray_` and gives
counters a `_total` suffix (`dualpath_snic_read_bytes` is scraped as
`ray_dualpath_snic_read_bytes_total`). Ray adds its own labels (SessionName, NodeAddress,
WorkerId, ...) to the tags below.

`RayMetrics` creates the Ray metric objects of a process lazily, the first time each is used,
so an actor only registers the metrics it records. Code that records metrics takes a
`MetricSink`, which `RayMetrics` implements; a disabled sink (runtime.metrics: false) records
nothing and costs one attribute test per call.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Mapping, Protocol

RAY_PREFIX = "ray_"


class MetricKind(str, enum.Enum):
    COUNTER = "counter"
    GAUGE = "gauge"
    HISTOGRAM = "histogram"


@dataclass(frozen=True)
class MetricSpec:
    """One metric: its name (under `dualpath_`), kind, meaning, tags and histogram buckets."""

    name: str
    kind: MetricKind
    description: str
    tags: tuple[str, ...]
    unit: str
    boundaries: tuple[float, ...] = ()
    # The config switch without which the metric never has a series ("" = any deployment has one).
    only_when: str = ""

    @property
    def exported_name(self) -> str:
        """The name Prometheus sees (histograms add _bucket, _sum and _count to it)."""
        suffix = "_total" if self.kind is MetricKind.COUNTER else ""
        return f"{RAY_PREFIX}{self.name}{suffix}"


# What each tag means; docs/metrics.md repeats these and a unit test keeps the two in step.
TAGS: dict[str, str] = {
    "node": "logical node id of the configuration (p0, p1, ... prefill; d0, d1, ... decode)",
    "role": "prefill or decode: the role of the node (or engine) the figure belongs to",
    "engine": "engine actor name, <role>/<node>/g<gpu> (e.g. prefill/p0/g1)",
    "path": "read path of the request the bytes or time belong to: pe (storage -> prefill node) or de "
    "(storage -> decode node -> RDMA -> prefill engine)",
    "direction": "in (KV moved into the engine's memory) or out (KV moved out of it)",
    "mode": "the deployment's read-path mode: dualpath, basic or oracle",
    "kind": "why an attempt failed: an ErrorKind value (kv_missing, kv_corrupt, kv_unreadable, kv_mismatch, "
    "transfer, call_failed, store_io, peer_died, hbm_full, stale_weights, timeout, internal)",
    "why": "why stored tokens were computed instead of read: compute_path (scheduler.compute_path judged it sooner)",
    "outcome": "of a trajectory: ok (every turn served), failed (a turn failed after its retries) or aborted (its "
    "caller aborted it); of staged blocks: staged, used, expired, cancelled, skipped, failed or missed",
}

_SECONDS_LATENCY = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0)
_SECONDS_PER_TOKEN = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
_SECONDS_DECISION = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 0.01, 0.025, 0.1)
_SECONDS_JCT = (1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0, 1200.0, 3600.0, 7200.0)

SNIC_READ_BYTES = MetricSpec(
    "dualpath_snic_read_bytes", MetricKind.COUNTER,
    "Hit KV read from the store through the node's storage NIC (verified Full Blocks), by read path.",
    ("node", "role", "path"), "bytes",
)
SNIC_WRITE_BYTES = MetricSpec(
    "dualpath_snic_write_bytes", MetricKind.COUNTER,
    "Persisted Full Blocks written to the store through the node's storage NIC.",
    ("node", "role"), "bytes",
)
CNIC_BYTES = MetricSpec(
    "dualpath_cnic_bytes", MetricKind.COUNTER,
    "KV an engine moved into or out of its memory over the compute network, by read path.",
    ("engine", "node", "role", "direction", "path"), "bytes",
)
REQUESTS = MetricSpec(
    "dualpath_requests", MetricKind.COUNTER,
    "Requests (attempts) the scheduler placed on a prefill engine, by the read path it chose.",
    ("mode", "path"), "requests",
)
READ_QUEUE_TOKENS = MetricSpec(
    "dualpath_read_queue_tokens", MetricKind.GAUGE,
    "Hit tokens waiting for, or being read through, the node's storage NIC (the scheduler's read_q).",
    ("node", "role"), "tokens",
)
ENGINE_TOKENS = MetricSpec(
    "dualpath_engine_tokens", MetricKind.GAUGE,
    "Tokens of the unfinished requests on the engine (the scheduler's tok_e).",
    ("engine", "node", "role"), "tokens",
)
ENGINE_REQUESTS = MetricSpec(
    "dualpath_engine_requests", MetricKind.GAUGE,
    "Unfinished requests on the engine (the scheduler's seq_e).",
    ("engine", "node", "role"), "requests",
)
BUFFER_BYTES_USED = MetricSpec(
    "dualpath_buffer_bytes_used", MetricKind.GAUGE,
    "Host staging buffer of the node leased to requests or under a store write.",
    ("node", "role"), "bytes",
)
BUFFER_BYTES_CAPACITY = MetricSpec(
    "dualpath_buffer_bytes_capacity", MetricKind.GAUGE,
    "Size of the node's host staging buffer.",
    ("node", "role"), "bytes",
)
HBM_BYTES_USED = MetricSpec(
    "dualpath_hbm_bytes_used", MetricKind.GAUGE,
    "Engine KV memory in use: reserved decode pages, or the prefill layer window's held slots.",
    ("engine", "node", "role"), "bytes",
)
HBM_BYTES_CAPACITY = MetricSpec(
    "dualpath_hbm_bytes_capacity", MetricKind.GAUGE,
    "Size of the engine's KV memory (decode page pool, or prefill layer window).",
    ("engine", "node", "role"), "bytes",
)
TTFT_SECONDS = MetricSpec(
    "dualpath_ttft_seconds", MetricKind.HISTOGRAM,
    "Time to first token of each served turn, from submission to its first sampled token.",
    ("mode", "path"), "seconds", _SECONDS_LATENCY,
)
TPOT_SECONDS = MetricSpec(
    "dualpath_tpot_seconds", MetricKind.HISTOGRAM,
    "Time per output token after the first, of each served turn.",
    ("mode", "path"), "seconds", _SECONDS_PER_TOKEN,
)
KV_LOAD_SECONDS = MetricSpec(
    "dualpath_kv_load_seconds", MetricKind.HISTOGRAM,
    "Time to stage one request's hit KV into a node's buffer: waiting for free buffer blocks, "
    "then reading them through the SNIC.",
    ("node", "role", "path"), "seconds", _SECONDS_LATENCY,
)
DECISION_SECONDS = MetricSpec(
    "dualpath_scheduler_decision_seconds", MetricKind.HISTOGRAM,
    "Time of one scheduling decision: the policy's placement for one group in a round.",
    ("role",), "seconds", _SECONDS_DECISION,
)
TRAJECTORY_JCT_SECONDS = MetricSpec(
    "dualpath_trajectory_jct_seconds", MetricKind.HISTOGRAM,
    "Completion time of each trajectory of a rollout, from its arrival to its last turn.",
    ("outcome",), "seconds", _SECONDS_JCT,
)
RETRIES = MetricSpec(
    "dualpath_retries", MetricKind.COUNTER,
    "Turns tried again with attempt + 1 after a retryable failure.",
    ("mode",), "attempts",
)
RECOMPUTED_BLOCKS = MetricSpec(
    "dualpath_recomputed_blocks", MetricKind.COUNTER,
    "Stored blocks dropped from the prefix index before a retry (missing or corrupt), so the retry "
    "recomputes them.",
    ("mode",), "blocks",
)
RECOMPUTED_HIT_TOKENS = MetricSpec(
    "dualpath_recomputed_hit_tokens", MetricKind.COUNTER,
    "Stored prompt tokens placed to be computed instead of read, by prefill engine and why "
    "(compute_path: scheduler.compute_path judged computing them sooner than reading them).",
    ("mode", "engine", "why"), "tokens", only_when="scheduler.compute_path: auto or all",
)
SHARED_PREFIX_TOKENS = MetricSpec(
    "dualpath_shared_prefix_tokens", MetricKind.COUNTER,
    "Prompt tokens shared in flight: a request waited for another request in flight to compute and publish "
    "them, then read them instead of computing them again, by the prefill engine it was then placed on.",
    ("mode", "engine"), "tokens", only_when="scheduler.share_in_flight: true",
)
PREFIX_WAITS = MetricSpec(
    "dualpath_prefix_waits", MetricKind.COUNTER,
    "Requests that waited for a producer's prefix (scheduler.share_in_flight), by the prefill engine each was "
    "then placed on.",
    ("mode", "engine"), "requests", only_when="scheduler.share_in_flight: true",
)
PREFIX_WAIT_SECONDS = MetricSpec(
    "dualpath_prefix_wait_seconds", MetricKind.COUNTER,
    "Seconds those requests waited for their producers, summed, by the prefill engine each was then placed on.",
    ("mode", "engine"), "seconds", only_when="scheduler.share_in_flight: true",
)
PREFIX_BUFFER_WAITS = MetricSpec(
    "dualpath_prefix_buffer_waits", MetricKind.COUNTER,
    "Waits for a producer's prefix whose rule chose the producer's decode-node buffer as the source (read over "
    "the CNIC from that node's memory) rather than the store (scheduling/share_rule.py).",
    ("mode",), "requests", only_when="scheduler.share_in_flight: true, dualpath mode, scheduler.share_buffer_blocks > 0",
)
LATE_HIT_TOKENS = MetricSpec(
    "dualpath_late_hit_tokens", MetricKind.COUNTER,
    "Hit tokens a request found when it was placed on a prefill engine beyond what it found at submit "
    "(persisted by other turns while it waited; scheduler.bind_hits: late).",
    ("mode",), "tokens",
    # A counter's series appears with its first increment: a workload whose turns never wait in
    # the queue while blocks they hit are published (each agent's next turn after its last) has none.
    only_when="a queued turn finds blocks persisted while it waited (scheduler.bind_hits: late)",
)
ATTEMPT_FAILURES = MetricSpec(
    "dualpath_attempt_failures", MetricKind.COUNTER,
    "Attempts that failed, by why (retried or not; timeouts included).",
    ("mode", "kind"), "attempts",
)
STORE_CHECKSUM_FAILURES = MetricSpec(
    "dualpath_store_checksum_failures", MetricKind.COUNTER,
    "Distinct stored blocks that failed their checksum when the node's reader read them.",
    ("node", "role"), "blocks",
)
STORE_WRITE_FAILURES = MetricSpec(
    "dualpath_store_write_failures", MetricKind.COUNTER,
    "Block writes (persists) the store refused (a full disk, an I/O error), or that the node's reader "
    "refused because the bytes written differ from the digest of the KV their engine computed "
    "(runtime.kv_digests): the block and those after it in its chain are not published, a later turn "
    "misses them; the turn itself is served.",
    ("node", "role"), "writes",
)
STAGED_BLOCKS = MetricSpec(
    "dualpath_staged_blocks", MetricKind.COUNTER,
    "Tool-time staging on the node's reader, in blocks, by outcome: staged (read into the buffer ahead), used "
    "(claimed by the next turn), expired, cancelled (buffer pressure), skipped (order refused or dropped unread), failed (store "
    "read failed), missed (a claim found nothing usable and read them as usual).",
    ("node", "role", "outcome"), "blocks",
)
KV_DIGEST_MISMATCHES = MetricSpec(
    "dualpath_kv_digest_mismatches", MetricKind.COUNTER,
    "(layer, token)s of KV that failed their digest when the engine loaded them (read again once).",
    ("engine", "node", "role"), "tokens",
)

ALL_METRICS: tuple[MetricSpec, ...] = (
    SNIC_READ_BYTES, SNIC_WRITE_BYTES, CNIC_BYTES, REQUESTS, READ_QUEUE_TOKENS, ENGINE_TOKENS,
    ENGINE_REQUESTS, BUFFER_BYTES_USED, BUFFER_BYTES_CAPACITY, HBM_BYTES_USED, HBM_BYTES_CAPACITY,
    TTFT_SECONDS, TPOT_SECONDS, KV_LOAD_SECONDS, DECISION_SECONDS, TRAJECTORY_JCT_SECONDS, RETRIES,
    RECOMPUTED_BLOCKS, RECOMPUTED_HIT_TOKENS, SHARED_PREFIX_TOKENS, PREFIX_WAITS, PREFIX_WAIT_SECONDS,
    PREFIX_BUFFER_WAITS, LATE_HIT_TOKENS, ATTEMPT_FAILURES, STORE_CHECKSUM_FAILURES, STORE_WRITE_FAILURES,
    KV_DIGEST_MISMATCHES,
    STAGED_BLOCKS,
)

Tags = Mapping[str, str]


class MetricSink(Protocol):
    """Where metric updates go: Ray's metrics in actors, a recording sink in unit tests."""

    enabled: bool

    def inc(self, spec: MetricSpec, value: float, tags: Tags) -> None: ...

    def set(self, spec: MetricSpec, value: float, tags: Tags) -> None: ...

    def observe(self, spec: MetricSpec, value: float, tags: Tags) -> None: ...


class RayMetrics:
    """The `ray.util.metrics` objects of this process, created on first use.

    Each method checks that the spec is of the kind the call needs and that the tags are exactly
    the spec's, so a wrong call fails where it is made instead of exporting a broken series.
    """

    def __init__(self, enabled: bool = True) -> None:
        self.enabled = enabled
        self._metrics: dict[str, Any] = {}

    def inc(self, spec: MetricSpec, value: float, tags: Tags) -> None:
        """Add `value` (> 0; Ray refuses 0) to a counter."""
        if self.enabled and value > 0:
            self._metric(spec, MetricKind.COUNTER, tags).inc(value, tags=_labels(tags))

    def set(self, spec: MetricSpec, value: float, tags: Tags) -> None:
        if self.enabled:
            self._metric(spec, MetricKind.GAUGE, tags).set(value, tags=_labels(tags))

    def observe(self, spec: MetricSpec, value: float, tags: Tags) -> None:
        if self.enabled:
            self._metric(spec, MetricKind.HISTOGRAM, tags).observe(value, tags=_labels(tags))

    def _metric(self, spec: MetricSpec, kind: MetricKind, tags: Tags) -> Any:
        if spec.kind is not kind:
            raise TypeError(f"{spec.name} is a {spec.kind.value}, not a {kind.value}")
        if tuple(sorted(tags)) != tuple(sorted(spec.tags)):
            raise ValueError(f"{spec.name} takes tags {spec.tags}, got {tuple(tags)}")
        metric = self._metrics.get(spec.name)
        if metric is None:
            metric = self._metrics[spec.name] = _create(spec)
        return metric


def _labels(tags: Tags) -> dict[str, str]:
    """Tag values as plain strings (the runtime's names are str enums; Ray wants str)."""
    return {key: str(value) for key, value in tags.items()}


def _create(spec: MetricSpec) -> Any:
    from ray.util import metrics

    if spec.kind is MetricKind.COUNTER:
        return metrics.Counter(spec.name, description=spec.description, tag_keys=spec.tags)
    if spec.kind is MetricKind.GAUGE:
        return metrics.Gauge(spec.name, description=spec.description, tag_keys=spec.tags)
    return metrics.Histogram(
        spec.name, description=spec.description, boundaries=list(spec.boundaries), tag_keys=spec.tags
    )
