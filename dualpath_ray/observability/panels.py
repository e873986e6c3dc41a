"""The panels of the DualPath Grafana dashboard (dashboards/dualpath_grafana_dashboard.json).

Each query names its metrics through the specs of dualpath_ray/metrics.py, so a renamed metric
renames its panels; `dashboards/generate.py` writes the JSON from this list, and the tests check
that the committed JSON is what this list generates and that every query returns data from a
real Prometheus scraping a real cluster.

Queries follow Ray's dashboards: `{global_filters}` stands for the dashboard's filter
(`SessionName=~"$SessionName"`), rates are over 1 minute.
"""

from __future__ import annotations

from dataclasses import dataclass

from dualpath_ray import metrics as m
from dualpath_ray.metrics import MetricSpec

GLOBAL_FILTERS = 'SessionName=~"$SessionName"'
RATE = "[1m]"
DE_PATH = 'path="de"'
RARE = "[5m]"  # window of increase() for rare events (failures), so a single one stays visible


@dataclass(frozen=True)
class Target:
    """One PromQL query of a panel and the legend of its series."""

    expr: str
    legend: str


@dataclass(frozen=True)
class Panel:
    id: int
    title: str
    description: str
    unit: str  # a Grafana unit id: bytes, Bps, s, short, percentunit, reqps
    targets: tuple[Target, ...]
    stack: bool = False


@dataclass(frozen=True)
class Row:
    id: int
    title: str
    panels: tuple[Panel, ...]


def sel(spec: MetricSpec, suffix: str = "", match: str = "") -> str:
    """The series selector of a metric under the dashboard's filters, e.g.
    ray_dualpath_snic_read_bytes_total{SessionName=~"$SessionName"}; `suffix` picks a
    histogram's _bucket / _sum / _count, `match` adds label matchers."""
    labels = ",".join(part for part in (GLOBAL_FILTERS, match) if part)
    return f"{spec.exported_name}{suffix}{{{labels}}}"


def rate(spec: MetricSpec, by: str, match: str = "") -> str:
    return f"sum by ({by}) (rate({sel(spec, match=match)}{RATE}))"


def total_rate(spec: MetricSpec, match: str = "") -> str:
    return f"sum(rate({sel(spec, match=match)}{RATE}))"


def increase(spec: MetricSpec, by: str) -> str:
    return f"sum by ({by}) (increase({sel(spec)}{RARE}))"


def quantile(q: float, spec: MetricSpec, by: str = "") -> str:
    keys = ", ".join(["le", *([by] if by else [])])
    return f"histogram_quantile({q}, sum by ({keys}) (rate({sel(spec, '_bucket')}{RATE})))"


def quantiles(spec: MetricSpec, qs: tuple[float, ...], by: str = "") -> tuple[Target, ...]:
    suffix = f" {{{{{by}}}}}" if by else ""
    return tuple(Target(quantile(q, spec, by), f"p{round(q * 100)}{suffix}") for q in qs)


def _node_read_rate() -> str:
    return f"sum by (node) (rate({sel(m.SNIC_READ_BYTES)}{RATE}))"


SNIC_ROW = Row(100, "Storage NICs", (
    Panel(101, "SNIC read throughput per node, by read path",
          "Hit KV each node's storage NIC reads from the store, split by the read path of the request it is "
          "for. DualPath's point: decode nodes' SNICs read too (path de), not only prefill nodes'.",
          "Bps", (Target(rate(m.SNIC_READ_BYTES, "node, path"), "{{node}} {{path}}"),), stack=True),
    Panel(102, "SNIC balance (max / avg read throughput across nodes)",
          "1.0 means every storage NIC reads equally; the paper reports 1.53 for round-robin and 1.18 for "
          "its scheduler. Basic mode, reading only on prefill nodes, sits at the number of nodes / prefill nodes.",
          "short", (Target(f"max({_node_read_rate()}) / avg({_node_read_rate()})", "max / avg"),)),
    Panel(103, "SNIC write throughput per node (persisted blocks)",
          "Full Blocks the decode engines persist, written through their node's storage NIC (its transmit "
          "direction, which does not slow reads).",
          "Bps", (Target(rate(m.SNIC_WRITE_BYTES, "node"), "{{node}}"),), stack=True),
    Panel(104, "Storage read queue per node (read_q)",
          "Hit tokens waiting for or being read through each node's SNIC: what the scheduler compares to "
          "pick a read path, and to alpha to pick prefill engines.",
          "short", (Target(f"sum by (node, role) ({sel(m.READ_QUEUE_TOKENS)})", "{{node}} ({{role}})"),)),
))

PATH_ROW = Row(200, "Read paths and compute NICs", (
    Panel(201, "Requests by read path",
          "Requests the scheduler places on prefill engines per second, by the read path it chose.",
          "reqps", (Target(rate(m.REQUESTS, "mode, path"), "{{path}} ({{mode}})"),), stack=True),
    Panel(202, "Path mix (share of requests on the DE path)",
          "Fraction of placed requests whose hit KV is read by the decode node's SNIC.",
          "percentunit", (Target(
              f"{total_rate(m.REQUESTS, DE_PATH)} / {total_rate(m.REQUESTS)}", "de share"),)),
    Panel(203, "CNIC throughput per engine, by direction and read path",
          "KV each engine moves into (in) and out of (out) its memory over the compute network: layer blocks "
          "between buffers and engines, and pages into decode HBM.",
          "Bps", (Target(rate(m.CNIC_BYTES, "engine, direction, path"), "{{engine}} {{direction}} {{path}}"),)),
    Panel(204, "KV load time per request (p50 / p99), by read path",
          "Time to stage a request's hit KV into a node buffer: waiting for free buffer blocks, then reading "
          "through the SNIC.",
          "s", quantiles(m.KV_LOAD_SECONDS, (0.5, 0.99), "path")),
))

ENGINE_ROW = Row(300, "Engines and scheduler", (
    Panel(301, "Engine token load (tok_e)",
          "Tokens of the unfinished requests on each engine; prefill engines over beta get no new work.",
          "short", (Target(f"sum by (engine) ({sel(m.ENGINE_TOKENS)})", "{{engine}}"),)),
    Panel(302, "Unfinished requests per engine (seq_e)",
          "Requests on each engine, from assignment to handoff (prefill) or to the last token (decode).",
          "short", (Target(f"sum by (engine) ({sel(m.ENGINE_REQUESTS)})", "{{engine}}"),)),
    # max/avg is 0/0 while a role's engines are all idle: the `or` branch reads that as 1.0 (balanced),
    # so the panel has a value at every scrape instead of a gap.
    Panel(303, "Engine load balance (max / avg tokens, by role)",
          "1.0 means the engines of a role hold equal token loads; an idle role reads 1.0.",
          "short", (Target(
              f"(max by (role) ({sel(m.ENGINE_TOKENS)}) / (avg by (role) ({sel(m.ENGINE_TOKENS)}) > 0))"
              f" or (0 * avg by (role) ({sel(m.ENGINE_TOKENS)}) + 1)", "{{role}}"),)),
    Panel(304, "Scheduler decision latency (p50 / p99)",
          "Time of one ask of the pure policy for one group in a round, by the role of the group.",
          "s", quantiles(m.DECISION_SECONDS, (0.5, 0.99), "role")),
))

LATENCY_ROW = Row(400, "What the agents see", (
    Panel(401, "TTFT (p50 / p90 / p99)",
          "Time to first token of served turns: queueing, KV load and prefill. The paper's online SLO is 4 s.",
          "s", quantiles(m.TTFT_SECONDS, (0.5, 0.9, 0.99))),
    Panel(402, "TPOT (p50 / p90 / p99)",
          "Time per output token after the first. The paper's online SLO is 50 ms.",
          "s", quantiles(m.TPOT_SECONDS, (0.5, 0.9, 0.99))),
    Panel(403, "Trajectory JCT (p50 / p90)",
          "Completion time of the trajectories of rollouts, from arrival to last turn (recorded by the "
          "driver that runs the rollout).",
          "s", quantiles(m.TRAJECTORY_JCT_SECONDS, (0.5, 0.9))),
    Panel(404, "Served turns per second, by read path",
          "Turns finished per second (the TTFT histogram's count).",
          "reqps", (Target(f"sum by (path) (rate({sel(m.TTFT_SECONDS, '_count')}{RATE}))", "{{path}}"),), stack=True),
))

MEMORY_ROW = Row(500, "Buffers and HBM", (
    Panel(501, "Host staging buffer per node",
          "Bytes of each node's DRAM staging buffer leased to requests or under a store write, and its size.",
          "bytes", (Target(f"sum by (node) ({sel(m.BUFFER_BYTES_USED)})", "used {{node}}"),
                    Target(f"sum by (node) ({sel(m.BUFFER_BYTES_CAPACITY)})", "capacity {{node}}"))),
    Panel(502, "Engine KV memory in use (fraction)",
          "Decode engines: pages reserved for their requests; prefill engines: layer window slots held.",
          "percentunit", (Target(
              f"sum by (engine) ({sel(m.HBM_BYTES_USED)}) / sum by (engine) ({sel(m.HBM_BYTES_CAPACITY)})",
              "{{engine}}"),)),
    Panel(503, "Tool-time staging (last 5 min)",
          "Blocks the decode nodes' readers staged while agents' tools ran, and what became of them: used by "
          "the next turn, expired, cancelled for real leases, skipped, failed, or missed by a claim.",
          "short", (Target(increase(m.STAGED_BLOCKS, "outcome"), "{{outcome}}"),)),
))

FAILURE_ROW = Row(600, "Failures, retries, recomputes", (
    Panel(601, "Retries and recomputed blocks (last 5 min)",
          "Turns tried again after a retryable failure, stored blocks dropped from the index before a "
          "retry so it recomputes them, and hit tokens the compute path placed to be computed instead of "
          "read, per prefill engine (scheduler.compute_path).",
          "short", (Target(increase(m.RETRIES, "mode"), "retries ({{mode}})"),
                    Target(increase(m.RECOMPUTED_BLOCKS, "mode"), "recomputed blocks ({{mode}})"),
                    Target(increase(m.RECOMPUTED_HIT_TOKENS, "engine"), "hit tokens computed, not read ({{engine}})"))),
    Panel(602, "Failed attempts by kind (last 5 min)",
          "Attempts that failed, by ErrorKind (retried ones included); docs/reliability.md says what each means.",
          "short", (Target(increase(m.ATTEMPT_FAILURES, "kind"), "{{kind}}"),), stack=True),
    Panel(603, "Checksum failures (last 5 min)",
          "Stored blocks that failed their checksum at read (per node), and KV tokens that failed their "
          "digest when an engine loaded them (read again once).",
          "short", (Target(increase(m.STORE_CHECKSUM_FAILURES, "node"), "store blocks {{node}}"),
                    Target(increase(m.KV_DIGEST_MISMATCHES, "engine"), "digest tokens {{engine}}"))),
    Panel(604, "Refused store writes (last 5 min)",
          "Block writes the store refused (a full disk, an I/O error), per node: those blocks and the rest of "
          "their chain are not published (a later turn misses them); the turns are served all the same.",
          "short", (Target(increase(m.STORE_WRITE_FAILURES, "node"), "refused writes {{node}}"),)),
    Panel(605, "Prefixes shared in flight (last 5 min)",
          "Prompt tokens requests read after waiting for another request in flight to compute them, instead of "
          "computing them again (scheduler.share_in_flight), the waits and their seconds, per prefill engine; and "
          "hit tokens found at placement beyond what submit found (late binding); waits that read the producer's "
          "decode-node buffer rather than the store.",
          "short", (Target(increase(m.SHARED_PREFIX_TOKENS, "engine"), "shared tokens ({{engine}})"),
                    Target(increase(m.PREFIX_WAITS, "engine"), "waits ({{engine}})"),
                    Target(increase(m.PREFIX_WAIT_SECONDS, "engine"), "wait seconds ({{engine}})"),
                    Target(increase(m.LATE_HIT_TOKENS, "mode"), "late hit tokens ({{mode}})"),
                    Target(increase(m.PREFIX_BUFFER_WAITS, "mode"), "waits on a decode-node buffer ({{mode}})"))),
))

ROWS: tuple[Row, ...] = (SNIC_ROW, PATH_ROW, ENGINE_ROW, LATENCY_ROW, MEMORY_ROW, FAILURE_ROW)
