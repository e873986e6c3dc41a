"""What `dualpath status` shows: one snapshot of a running cluster, asked of its actors.

Everything comes from the live deployment in one Ray namespace: Ray's node table (roles from the
node labels), each storage reader (read queue, exact SNIC bytes by path, buffer use, whether its
buffer is pinned and its SNIC emulated), each engine
(requests, tokens, free HBM, exact CNIC bytes by path) and the scheduler (mode, requests in
flight, call counts, and the TTFT/TPOT of its latest served turns). An actor that does not answer
within the timeout is shown as not answering; it does not stop the snapshot.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from dualpath_ray.protocol.counters import PATHS
from dualpath_ray.protocol.names import ENGINE_PREFIXES, SCHEDULER, is_reader, reader_node
from dualpath_ray.runtime.placement.topology import HEAD_RESOURCE, ROLE_LABEL
from dualpath_ray.runtime.telemetry.status_views import StatusQuery

# Scheduler call counts worth showing an operator (the rest are for tests and benchmarks).
SHOWN_CALLS = ("generate", "retries", "timeouts", "unindexed_blocks", "dead_engines", "dead_readers",
               "lost_assignments", "stale_results")


@dataclass
class RayNodeView:
    node_id: str
    address: str
    role: str  # the dualpath/role label; head for the node with the dualpath_head resource
    alive: bool
    gpus: float
    cpus: float
    hosts: list[str] = field(default_factory=list)  # logical nodes (p0, d0) placed on it


@dataclass
class ReaderView:
    node: str
    answered: bool
    read_q_tokens: int = 0
    snic_read: dict[str, int] = field(default_factory=dict)  # bytes by read path
    snic_write: int = 0
    buffer_used_blocks: int = 0
    buffer_capacity_blocks: int = 0
    ray_node: str = ""
    buffer_pinned: bool | None = None  # None: the reader did not say (an older one)
    pinning: str = ""  # why (not) pinned
    emulation: bool | None = None  # whether its SNIC is paced by token buckets


@dataclass
class EngineView:
    name: str
    role: str
    node: str
    answered: bool
    requests: int = 0
    tokens: int = 0
    free_hbm_tokens: int = 0
    cnic_in: dict[str, int] = field(default_factory=dict)
    cnic_out: dict[str, int] = field(default_factory=dict)


@dataclass
class LatencyView:
    """TTFT / TPOT percentiles (seconds) of the turns served in the last `window_s`."""

    window_s: float
    turns: int
    turns_by_path: dict[str, int]
    ttft_s: dict[str, float]  # p50, p90, p99
    tpot_s: dict[str, float]


@dataclass
class ClusterStatus:
    namespace: str
    collected_at: float
    ray_nodes: list[RayNodeView]
    deployed: bool  # whether a scheduler of this namespace answered
    mode: str = ""
    in_flight: int = 0
    readers: list[ReaderView] = field(default_factory=list)
    engines: list[EngineView] = field(default_factory=list)
    snic_read_by_path: dict[str, int] = field(default_factory=dict)
    cnic_by_path: dict[str, int] = field(default_factory=dict)  # engines' in + out bytes
    latency: LatencyView | None = None
    scheduler_calls: dict[str, int] = field(default_factory=dict)
    emulation: str = "unknown"  # on, off, mixed (readers disagree) or unknown (none said)


def collect(namespace: str, window_s: float = 60.0, timeout_s: float = 5.0) -> ClusterStatus:
    """One snapshot of the deployment in `namespace` (needs a connected Ray driver)."""
    import ray

    names = sorted(a["name"] for a in ray.util.list_named_actors(all_namespaces=True) if a["namespace"] == namespace)
    calls = _Calls(namespace, timeout_s)
    for name in names:
        if name.startswith(ENGINE_PREFIXES):
            calls.ask(name, load=lambda h: h.load.remote(), stats=lambda h: h.stats.remote())
        elif is_reader(name):
            calls.ask(name, read_q=lambda h: h.read_q.remote(), counters=lambda h: h.counters.remote(),
                      pool_integrity=lambda h: h.pool_integrity.remote(), node_labels=lambda h: h.node_labels.remote(),
                      node_setup=lambda h: h.node_setup.remote())
    if SCHEDULER in names:
        calls.ask(SCHEDULER, deployment=lambda h: h.status.remote(StatusQuery.DEPLOYMENT),
                  in_flight=lambda h: h.status.remote(StatusQuery.IN_FLIGHT),
                  call_counts=lambda h: h.status.remote(StatusQuery.CALLS),
                  recent_turns=lambda h: h.status.remote(StatusQuery.RECENT_TURNS))
    readers = [_reader(name, calls) for name in names if is_reader(name)]
    engines = [_engine(name, calls) for name in names if name.startswith(ENGINE_PREFIXES)]
    status = ClusterStatus(namespace, time.time(), _ray_nodes(readers), deployed=calls.answered(SCHEDULER, "deployment"))
    status.readers, status.engines = readers, engines
    status.emulation = emulation_state(readers)
    status.snic_read_by_path = {p: sum(r.snic_read.get(p, 0) for r in readers) for p in PATHS}
    status.cnic_by_path = {p: sum(e.cnic_in.get(p, 0) + e.cnic_out.get(p, 0) for e in engines) for p in PATHS}
    if status.deployed:
        status.mode = calls.get(SCHEDULER, "deployment").mode  # a DeploymentView (runtime/telemetry/status_views.py)
        live = calls.get(SCHEDULER, "in_flight")
        status.in_flight = len(live.requests) if live is not None else 0
        answered = calls.get(SCHEDULER, "call_counts")  # a CallCounts (runtime/telemetry/status_views.py)
        counts = answered.to_json() if answered is not None else {}
        status.scheduler_calls = {k: int(counts[k]) for k in SHOWN_CALLS if k in counts}
        recent = calls.get(SCHEDULER, "recent_turns")
        if recent is not None:
            status.latency = latency(list(recent.turns), status.collected_at, window_s)
    return status


class _Calls:
    """Actor calls sent all at once, then awaited under one shared deadline."""

    def __init__(self, namespace: str, timeout_s: float) -> None:
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.refs: dict[tuple[str, str], Any] = {}
        self.results: dict[tuple[str, str], Any] = {}
        self.deadline: float | None = None

    def ask(self, actor: str, **calls: Callable[[Any], Any]) -> None:
        """Send each call (keyword: the answer's key, value: the call made on the actor's handle)."""
        import ray

        try:
            handle = ray.get_actor(actor, namespace=self.namespace)
        except ValueError:
            return  # it died since the listing
        for key, call in calls.items():
            self.refs[(actor, key)] = call(handle)

    def _settle(self, key: tuple[str, str]) -> None:
        import ray

        if key in self.results or key not in self.refs:
            return
        if self.deadline is None:
            self.deadline = time.monotonic() + self.timeout_s
        try:
            self.results[key] = ray.get(self.refs[key], timeout=max(0.0, self.deadline - time.monotonic()))
        except Exception:  # noqa: BLE001 - dead, hung, or without that method: shown as not answering
            self.results[key] = _NO_ANSWER

    def answered(self, actor: str, key: str) -> bool:
        self._settle((actor, key))
        return self.results.get((actor, key), _NO_ANSWER) is not _NO_ANSWER

    def get(self, actor: str, key: str) -> Any:
        return self.results[(actor, key)] if self.answered(actor, key) else None


_NO_ANSWER = object()


def _reader(name: str, calls: _Calls) -> ReaderView:
    node = reader_node(name)
    if not all(calls.answered(name, m) for m in ("read_q", "counters", "pool_integrity")):
        return ReaderView(node, answered=False)
    counters = calls.get(name, "counters")
    _, leased, in_flight, capacity = calls.get(name, "pool_integrity")
    labels = calls.get(name, "node_labels") or {}
    setup = calls.get(name, "node_setup")  # a NodeSetup (runtime/telemetry/node_setup.py), None unanswered
    return ReaderView(node, True, int(calls.get(name, "read_q")), dict(counters.snic_read), int(counters.snic_write),
                      leased + in_flight, capacity, labels.get("ray.io/node-id", ""),
                      setup.buffer_pinned if setup is not None else None, setup.pinning if setup is not None else "",
                      setup.emulation if setup is not None else None)


def emulation_state(readers: list[ReaderView]) -> str:
    """Whether the deployment's NICs are emulated, from what its readers say."""
    said = {r.emulation for r in readers if r.emulation is not None}
    if not said:
        return "unknown"
    return "mixed" if len(said) > 1 else ("on" if said.pop() else "off")


def _engine(name: str, calls: _Calls) -> EngineView:
    role, node, _ = name.split("/", 2)
    if not (calls.answered(name, "load") and calls.answered(name, "stats")):
        return EngineView(name, role, node, answered=False)
    load, counters = calls.get(name, "load"), calls.get(name, "stats")
    return EngineView(name, role, node, True, load.seq, load.tok, load.free_hbm_tokens,
                      dict(counters.cnic_in), dict(counters.cnic_out))


def _ray_nodes(readers: list[ReaderView]) -> list[RayNodeView]:
    import ray

    hosts: dict[str, list[str]] = {}
    for reader in readers:
        hosts.setdefault(reader.ray_node, []).append(reader.node)
    views = []
    for node in ray.nodes():
        resources = node.get("Resources", {})
        role = node.get("Labels", {}).get(ROLE_LABEL) or ("head" if HEAD_RESOURCE in resources else "-")
        views.append(RayNodeView(node["NodeID"], node.get("NodeManagerAddress", ""), role, bool(node.get("Alive")),
                                 float(resources.get("GPU", 0)), float(resources.get("CPU", 0)),
                                 sorted(hosts.get(node["NodeID"], []))))
    return sorted(views, key=lambda v: (not v.alive, v.role != "head", v.role, v.hosts, v.node_id))


def latency(recent: list[tuple[float, float, float, str]], now: float, window_s: float) -> LatencyView:
    """Percentiles of the turns (finished at, ttft, tpot, path) that finished in the window."""
    turns = [t for t in recent if t[0] >= now - window_s]
    by_path = {p: sum(1 for t in turns if t[3] == p) for p in PATHS}
    return LatencyView(window_s, len(turns), by_path, _percentiles([t[1] for t in turns]),
                       _percentiles([t[2] for t in turns if t[2] > 0]))


def _percentiles(values: list[float]) -> dict[str, float]:
    if not values:
        return {}
    points = np.percentile(np.asarray(values), [50, 90, 99])
    return {name: float(v) for name, v in zip(("p50", "p90", "p99"), points)}
