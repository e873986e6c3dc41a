"""Observability as an operator uses it, on one local cluster started by `dualpath cluster up
--prometheus` (ray start nodes labelled by role, a real Prometheus scraping every node's Ray
metrics export): a small dualpath workload with a fault plan (so failures, retries, recomputes
and checksum failures happen), then

- every PromQL query of every panel of the committed Grafana dashboard returns data,
- the SNIC byte counters in Prometheus equal the runtime's exact per-node accounting,
- `dualpath status --once --json` reports the live deployment,
- the `ray job submit` line of docs/rl.md ("Rollouts from RL pipelines and Ray jobs") runs on
  the cluster as written.

Without a `prometheus` binary (.ci/run installs Debian's package) the Prometheus tests skip.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import ray_test_env, runtime_config, trajectories

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.local_cluster import free_port  # noqa: E402
from dualpath_ray.metrics import ALL_METRICS, READ_QUEUE_TOKENS, TRAJECTORY_JCT_SECONDS, MetricKind  # noqa: E402
from dualpath_ray.observability.grafana import panel_targets  # noqa: E402
from dualpath_ray.observability.prometheus import PrometheusServer, find_prometheus  # noqa: E402
from dualpath_ray.workload.trace import write_trace  # noqa: E402

# `dualpath cluster up` nodes and Prometheus: 65 s measured on a loaded 2-core machine, with their teardown.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
DASHBOARD = REPO / "dashboards" / "dualpath_grafana_dashboard.json"
NO_PROMETHEUS = "no `prometheus` binary on PATH: .ci/run installs Debian's package (apt-get install prometheus)"
EXPORT_WAIT_S = 120.0


def cli_env() -> dict[str, str]:
    """The operator's shell: this venv first on PATH, auth off for this test cluster only, and
    Ray's metric export every second instead of every ten (so the test waits less)."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env.update(RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0", RAY_metrics_report_interval_ms="1000")
    env.pop("RAY_ADDRESS", None)
    return env


def dualpath(*args: str, timeout_s: float = 600) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(BIN / "dualpath"), *args], check=False, env=cli_env(), capture_output=True, text=True,
                          timeout=timeout_s, cwd=REPO)


def workload_config():
    cfg = runtime_config(transport="gloo", verify_kv=False, metrics_interval_s=0.5, heartbeat_timeout_s=30.0)
    # One corrupted stored block per reader (a checksum failure, a retry that recomputes it), one
    # corrupted layer transfer per engine (a digest mismatch, read again) and one block write per
    # reader the store refuses (counted; its turn is served, the block is a later miss).
    return cfg.with_overrides(faults={"seed": 3, "faults": [
        {"site": "store_read", "mode": "corrupt", "nth": 3, "actors": "reader/*"},
        {"site": "layer_transfer", "mode": "corrupt", "nth": 5},
        {"site": "store_publish", "mode": "fail", "nth": 1, "actors": "reader/*"},
    ]})


@pytest.fixture(scope="module")
def observed(tmp_path_factory: pytest.TempPathFactory):
    """A local cluster with Prometheus, a deployment that ran two rollouts and stays up."""
    os.environ["RAY_metrics_report_interval_ms"] = "1000"  # this driver's own metrics (trajectory JCT)
    state = tmp_path_factory.mktemp("cluster")
    temp_dir = Path(tempfile.mkdtemp(prefix="dp", dir="/tmp"))  # short: Ray's socket paths live under it
    port, dashboard, prometheus_port = free_port(), free_port(), free_port()
    binary = find_prometheus()
    up = dualpath("cluster", "up", f"--port={port}", f"--dashboard-port={dashboard}", f"--state-dir={state}",
                  f"--temp-dir={temp_dir}", "--json",
                  *(["--prometheus", f"--prometheus-port={prometheus_port}", "--scrape-interval=1"] if binary else []))
    assert up.returncode == 0, f"`dualpath cluster up` failed:\n{up.stdout[-3000:]}\n{up.stderr[-3000:]}"
    info = json.loads(up.stdout.strip().splitlines()[-1])
    cfg = workload_config()
    cluster = None
    try:
        cluster = DualPathCluster.connect(cfg, info["address"])
        cluster.deploy()
        server = PrometheusServer(info["prometheus_url"]) if binary else None
        started = time.time()
        first = cluster.rollout(trajectories(count=6, turns=4, seed=7), progress=False)
        # Two agents with tool time between turns: the rollout hints it and their next turns' KV
        # is staged, so the staging metric has series too.
        staged = cluster.rollout(trajectories(count=2, turns=3, seed=9, tool_s=0.5), progress=False)
        if server is not None:
            # Every series exists in Prometheus before the second rollout, so the second one's
            # observations show up as rates (a series' first sample has no rate before it).
            wait_for(lambda: missing_metrics(server) == [], "every dualpath metric in Prometheus",
                     lambda: f"missing: {missing_metrics(server)}")
        second = cluster.rollout(trajectories(count=6, turns=4, seed=8), progress=False)
        yield {"cfg": cfg, "cluster": cluster, "info": info, "server": server, "started": started,
               "results": [first, staged, second], "counters": cluster.counters(), "temp_dir": temp_dir, "scratch": state}
    finally:
        if cluster is not None:
            cluster.teardown()
        ray.shutdown()
        down = dualpath("cluster", "down", f"--state-dir={state}")
        shutil.rmtree(temp_dir, ignore_errors=True)
        assert down.returncode == 0, f"`dualpath cluster down` failed:\n{down.stderr[-3000:]}"


def submit_documented_job(dashboard_url: str, scratch: Path) -> subprocess.CompletedProcess[str]:
    """The `ray job submit` line of docs/rl.md (relative --out and --summary, which land in the job's
    working directory on the head), on a small trace."""
    trace = write_trace(trajectories(count=2, turns=2, seed=5), scratch / "trace.parquet")
    command = ["ray", "job", "submit", "--working-dir", ".", "--metadata-json", '{"trainer_run_id": "run-42"}', "--",
               "python", "jobs/rollout.py", "--config", "cluster_configs/local-1p1d.yaml", "--trace", str(trace),
               "--out", "results/results.parquet", "--summary", "results/summary.json"]
    env = {**cli_env(), "RAY_API_SERVER_ADDRESS": dashboard_url}  # other Ray instances may run here
    return subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


def wait_for(check: Any, what: str, detail: Any, timeout_s: float = EXPORT_WAIT_S) -> None:
    deadline = time.monotonic() + timeout_s
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} within {timeout_s:.0f}s: {detail()}")
        time.sleep(1.0)


def missing_metrics(server: PrometheusServer) -> list[str]:
    present = {r["metric"]["__name__"] for r in server.query('count by (__name__) ({__name__=~"ray_dualpath_.+"})')}
    # Every metric the workload's config can produce (one behind a switch it leaves off has no series).
    wanted = [s.exported_name + ("_count" if s.kind is MetricKind.HISTOGRAM else "") for s in ALL_METRICS if not s.only_when]
    return [name for name in wanted if name not in present]


def prometheus_snic(server: PrometheusServer) -> dict[str, Any]:
    read = server.query("sum by (node, path) (ray_dualpath_snic_read_bytes_total)")
    write = server.query("sum by (node) (ray_dualpath_snic_write_bytes_total)")
    return {
        "read": {(r["metric"]["node"], r["metric"]["path"]): float(r["value"][1]) for r in read},
        "write": {r["metric"]["node"]: float(r["value"][1]) for r in write},
    }


def runtime_snic(counters: dict[str, Any]) -> dict[str, Any]:
    return {
        "read": {(node, path): float(n) for node, c in counters.items() for path, n in c.snic_read.items() if n},
        "write": {node: float(c.snic_write) for node, c in counters.items() if c.snic_write},
    }


def prometheus_trajectories(server: PrometheusServer) -> float:
    """Trajectories the driver's JCT histogram has counted, as Prometheus last scraped them."""
    counted = server.query(f"sum({TRAJECTORY_JCT_SECONDS.exported_name}_count)")
    return float(counted[0]["value"][1]) if counted else 0.0


def scrapes_of_refused_writes(server: PrometheusServer) -> float:
    """Scrapes that saw the refused-writes counter: a counter first exported at 1 (Ray has no
    zero increment) needs two samples before a panel's increase() has a value."""
    seen = server.query("max(count_over_time(ray_dualpath_store_write_failures_total[10m]))")
    return float(seen[0]["value"][1]) if seen else 0.0


def needs_prometheus(observed: dict[str, Any]) -> PrometheusServer:
    if observed["server"] is None:
        pytest.skip(NO_PROMETHEUS)
    return observed["server"]


def test_workload_served_every_turn_on_both_paths(observed):
    for result in observed["results"]:
        assert not result.failures, f"every trajectory finishes despite the injected faults: {result.failures}"
    paths = {p for result in observed["results"] for p in result.table["path"].to_pylist()}
    assert paths == {"pe", "de"}, f"the dualpath workload reads through both paths (saw {paths})"


def test_prometheus_snic_bytes_equal_the_runtimes_exact_counters(observed):
    server = needs_prometheus(observed)
    expected = runtime_snic(observed["counters"])
    assert expected["read"] and expected["write"], "the workload read hit KV and persisted blocks"
    wait_for(lambda: prometheus_snic(server) == expected,
             "Prometheus' SNIC read/write bytes per node (and path) equal DualPathCluster.counters()",
             lambda: f"prometheus {prometheus_snic(server)} != runtime {expected}")


def test_every_dashboard_query_returns_data_from_prometheus(observed):
    server = needs_prometheus(observed)
    wait_for(lambda: prometheus_snic(server) == runtime_snic(observed["counters"]),
             "the last exports scraped", lambda: "SNIC counters still behind the runtime's")
    # The driver exports its own metrics (trajectory JCT) on its own cadence, apart from the
    # readers': a fast second rollout can be scraped from the readers before it is from the driver.
    finished = sum(len(set(r.table["trajectory_id"].to_pylist()) | set(r.failures)) for r in observed["results"])
    wait_for(lambda: prometheus_trajectories(server) == finished, "the driver's last export scraped",
             lambda: f"Prometheus counts {prometheus_trajectories(server)} trajectories, the rollouts finished {finished}")
    wait_for(lambda: scrapes_of_refused_writes(server) >= 2, "the refused writes scraped twice",
             lambda: f"{scrapes_of_refused_writes(server)} scrapes saw the refused-writes counter")
    sessions = server.label_values("SessionName", READ_QUEUE_TOKENS.exported_name)
    assert len(sessions) == 1, f"the dashboard's SessionName variable lists this cluster's one session: {sessions}"
    document = json.loads(DASHBOARD.read_text())
    targets = panel_targets(document)
    assert len(targets) >= 20, f"the committed dashboard has its panels' queries ({len(targets)})"
    start, end = observed["started"] - 60, time.time()
    empty = []
    # A metric behind a switch the workload's config leaves off (MetricSpec.only_when) has no data here.
    switched_off = [spec.exported_name for spec in ALL_METRICS if spec.only_when]
    for title, expr in targets:
        if any(name in expr for name in switched_off):
            continue
        query = expr.replace("$SessionName", sessions[0])
        series = server.query_range(query, start, end, 1.0)
        if not any(math.isfinite(float(v)) for s in series for _, v in s["values"]):
            empty.append(f"{title}: {query}")
    assert not empty, "every panel query returns a finite value during the run; without data:\n" + "\n".join(empty)


def test_failure_metrics_count_what_the_fault_plan_injected(observed):
    server = needs_prometheus(observed)
    report = observed["cluster"].integrity_report()
    corrupt = server.query("sum(ray_dualpath_store_checksum_failures_total)")
    assert corrupt and float(corrupt[0]["value"][1]) == len(report["corrupt_keys"]) > 0, (
        f"store checksum failures in Prometheus ({corrupt}) equal the blocks the readers found corrupt "
        f"({len(report['corrupt_keys'])})"
    )
    refused = server.query("sum(ray_dualpath_store_write_failures_total)")
    assert refused and float(refused[0]["value"][1]) >= 1, (
        f"the block writes the fault plan failed are counted as refused store writes ({refused})"
    )
    retries = server.query("sum(ray_dualpath_retries_total)")
    assert retries and float(retries[0]["value"][1]) >= 1, f"the corrupt blocks' turns were retried ({retries})"


def test_status_once_json_reports_the_live_deployment(observed):
    info, cfg, counters = observed["info"], observed["cfg"], observed["counters"]
    run = dualpath("status", "--once", "--json", f"--address={info['address']}",
                   f"--namespace={cfg.runtime.namespace}", "--window=3600", timeout_s=300)
    assert run.returncode == 0, f"`dualpath status --once --json` failed:\n{run.stderr[-3000:]}"
    status = json.loads(run.stdout.strip().splitlines()[-1])
    assert status["deployed"] and status["mode"] == "dualpath", f"the live dualpath deployment answers: {status}"
    roles = {n["role"]: n["hosts"] for n in status["ray_nodes"] if n["alive"]}
    assert roles == {"head": [], "prefill": ["p0"], "decode": ["d0"]}, f"Ray nodes by role, with what they host: {roles}"
    readers = {r["node"]: r for r in status["readers"]}
    assert {n: readers[n]["snic_read"] for n in readers} == {n: c.snic_read for n, c in counters.items()}, (
        "each reader's SNIC bytes by path equal DualPathCluster.counters()"
    )
    assert all(r["read_q_tokens"] == 0 and r["buffer_used_blocks"] == 0 for r in readers.values()), (
        "an idle deployment has empty read queues and buffers"
    )
    engines = {e["name"]: e for e in status["engines"]}
    assert sorted(engines) == sorted(f"{r}/{n}/g{g}" for r, n in (("prefill", "p0"), ("decode", "d0")) for g in (0, 1)), (
        f"every engine is listed: {sorted(engines)}"
    )
    assert all(e["answered"] and e["requests"] == 0 and e["tokens"] == 0 for e in engines.values()), (
        "idle engines answer with no requests and no tokens"
    )
    cnic = {p: sum(c.cnic_in[p] + c.cnic_out[p] for c in counters.values()) for p in ("pe", "de")}
    assert status["cnic_by_path"] == cnic, "CNIC bytes by path equal the runtime's counters"
    served = [p for result in observed["results"] for p in result.table["path"].to_pylist()]
    latency = status["latency"]
    assert latency["turns"] == len(served), f"every served turn is among the recent turns ({latency['turns']})"
    assert latency["turns_by_path"] == {p: served.count(p) for p in ("pe", "de")}, "recent turns by read path"
    assert 0 < latency["ttft_s"]["p50"] <= latency["ttft_s"]["p99"], f"TTFT percentiles are ordered: {latency}"


def test_the_ray_dashboard_shows_actor_names_and_the_drivers_job_metadata(observed):
    from ray.job_submission import JobSubmissionClient
    from ray.util.state import list_actors

    cfg, dashboard = observed["cfg"], observed["info"]["dashboard_url"]
    actors = list_actors(address=dashboard, filters=[("state", "=", "ALIVE")], detail=True, limit=1000)
    named = {a.name: a.repr_name for a in actors if a.ray_namespace == cfg.runtime.namespace and a.name}
    engines_and_readers = {n: r for n, r in named.items() if n.startswith(("prefill/", "decode/", "reader/"))}
    assert len(engines_and_readers) == 6 and all(n == r for n, r in engines_and_readers.items()), (
        f"engines and readers are named by role and place, and log under that name: {named}"
    )
    jobs = JobSubmissionClient(dashboard).list_jobs()
    tagged = [job.metadata for job in jobs if job.metadata.get("dualpath.namespace") == cfg.runtime.namespace]
    assert tagged and tagged[0]["dualpath.topology"] == "1P1D x 2 GPUs", (
        f"the driver's job carries its namespace and topology in the Jobs view: {[j.metadata for j in jobs]}"
    )


@pytest.fixture(scope="module")
def documented_job(observed):
    """The documented job, once the checks on the live deployment are done: its deployment needs
    the cluster's GPU slots, and its byte counters would add to the deployment's in Prometheus."""
    observed["cluster"].teardown()
    return submit_documented_job(observed["info"]["dashboard_url"], observed["scratch"])


def test_the_documented_job_line_runs_on_a_cluster_up_cluster(observed, documented_job):
    job = documented_job
    assert job.returncode == 0, f"the documented ray job submit line succeeds:\n{job.stdout[-3000:]}\n{job.stderr[-3000:]}"
    working_dirs = observed["temp_dir"] / "session_latest" / "runtime_resources" / "working_dir_files"
    outputs = list(working_dirs.glob("*/results/results.parquet"))
    assert len(outputs) == 1, f"its relative --out is written in the job's working directory on the head: {outputs}"
    summary = json.loads((outputs[0].parent / "summary.json").read_text())
    assert summary["failed_trajectories"] == [] and summary["metadata"].get("trainer_run_id") == "run-42", (
        f"every trajectory served, the job's metadata kept: {summary}"
    )
