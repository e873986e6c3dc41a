"""A labelled Ray cluster of `ray start` nodes on this machine (`dualpath cluster up/down`).

The same shape as a real cluster: a head with the dashboard and the `dualpath_head` resource,
and one Ray node per configured prefill or decode node, labelled `dualpath/role=<role>` and
offering `dualpath_<role>_slot: 1` and its GPU slots (GPUs Ray only counts, on a machine without
them). `ray job submit`, `dualpath run --address`, `dualpath status` and the Ray dashboard then
work exactly as on a cluster started with cluster_configs/ray-cluster-launcher.yaml.

Each node is one `ray start --block` process in its own session, so `down` stops exactly this
cluster's processes (never other Ray instances of the machine, as `ray stop` would). The nodes
share a Ray temporary directory of their own (default /tmp/dualpath-ray-<port>): Ray resolves
"the local cluster" (a job's driver, `ray.init("auto")`) through a file in that directory, so
with Ray's shared /tmp/ray another Ray instance started later on the machine would receive this
cluster's jobs. Every node exports its metrics on a port chosen here, so a Prometheus
(`--prometheus`) scrapes a fixed list of endpoints. The state (pids, ports, logs) lives in the
state directory.
"""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from dualpath_ray.config import DualPathConfig
from dualpath_ray.observability.prometheus import (
    PrometheusError,
    PrometheusServer,
    find_prometheus,
    scrape_config,
    write_targets,
)
from dualpath_ray.runtime.placement.topology import HEAD_RESOURCE, ROLE_LABEL, plan_nodes, slot_resource

STATE_FILE = "cluster.json"
DEFAULT_STATE_DIR = Path.home() / ".dualpath" / "cluster"
NODE_START_TIMEOUT_S = 180.0  # one raylet registering on 2 busy cores can take a minute
STOP_TIMEOUT_S = 60.0


class LocalClusterError(RuntimeError):
    """A local cluster cannot be started or stopped as asked; the message says what to do."""


@dataclass(frozen=True)
class UpOptions:
    """How `up` starts the cluster (the CLI's flags)."""

    state_dir: Path = DEFAULT_STATE_DIR
    port: int = 6379
    dashboard_port: int = 8265
    object_store_mb: int = 200
    temp_dir: Path | None = None  # /tmp/dualpath-ray-<port> when None (see the module docstring)
    prometheus_port: int | None = None  # start a Prometheus on this port; None: no Prometheus
    scrape_interval_s: float = 5.0


@dataclass
class NodeProcess:
    name: str  # head, or the logical node id (p0, d0, ...)
    role: str  # head, prefill or decode
    pid: int
    metrics_port: int
    log: str


@dataclass
class LocalCluster:
    state_dir: str
    address: str  # GCS address: ray.init(address=...), dualpath run --address ...
    dashboard_url: str  # ray job submit --address ...; the Ray dashboard
    nodes: list[NodeProcess] = field(default_factory=list)
    prometheus_pid: int | None = None
    prometheus_url: str | None = None
    ray_temp_dir: str = ""  # the nodes' Ray files: sessions, logs, Ray's generated Grafana config

    def save(self) -> None:
        path = Path(self.state_dir) / STATE_FILE
        path.write_text(json.dumps(asdict(self), indent=2))

    @classmethod
    def load(cls, state_dir: Path) -> LocalCluster:
        path = state_dir / STATE_FILE
        if not path.exists():
            raise LocalClusterError(f"no local cluster recorded in {state_dir}; start one with `dualpath cluster up`")
        data = json.loads(path.read_text())
        return cls(**{**data, "nodes": [NodeProcess(**node) for node in data["nodes"]]})

    def metrics_targets(self) -> list[str]:
        return [f"127.0.0.1:{node.metrics_port}" for node in self.nodes]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def node_commands(cfg: DualPathConfig, options: UpOptions, ports: dict[str, int]) -> list[tuple[str, str, list[str]]]:
    """(name, role, `ray start` arguments) of the head and of every configured node, in start
    order. `ports` holds the head's agent and client ports and each node's metrics port."""
    common = ["--block", "--disable-usage-stats", f"--object-store-memory={options.object_store_mb << 20}",
              f"--temp-dir={ray_temp_dir(options)}"]
    # The dashboard (and its job-submission API) on loopback only. Ray 2.60 binds the GCS and the
    # raylets to all interfaces whatever the flags of a multi-node cluster (it replaces a loopback
    # --node-ip-address with the machine's address), so token auth is what guards those.
    head = [
        "--head", f"--port={options.port}", f"--dashboard-port={options.dashboard_port}", "--include-dashboard=true",
        "--dashboard-host=127.0.0.1",
        f"--dashboard-agent-listen-port={ports['agent']}", f"--ray-client-server-port={ports['client']}",
        "--num-cpus=1", f"--resources={json.dumps({HEAD_RESOURCE: 1})}", f"--labels={ROLE_LABEL}=head",
        f"--metrics-export-port={ports['head']}",
    ]
    commands = [("head", "head", head + common)]
    for spec in plan_nodes(cfg):
        commands.append((spec.node_id, spec.role, [
            f"--address=127.0.0.1:{options.port}", f"--num-cpus={math.ceil(cfg.cluster.cpus_per_node)}",
            f"--num-gpus={spec.gpus}", f"--resources={json.dumps({slot_resource(spec.role): 1})}",
            f"--labels={ROLE_LABEL}={spec.role}", f"--metrics-export-port={ports[spec.node_id]}", *common,
        ]))
    return commands


def ray_temp_dir(options: UpOptions) -> Path:
    return options.temp_dir or Path(f"/tmp/dualpath-ray-{options.port}")


def node_env(options: UpOptions) -> dict[str, str]:
    """The nodes' environment: this Python's bin directory first on PATH, so a job's `python`
    is this virtualenv's (job entrypoints run with the head's PATH), and the Ray dashboard told
    where Prometheus is."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env.setdefault("RAY_raylet_start_wait_time_s", "120")
    env.pop("RAY_ADDRESS", None)
    if options.prometheus_port is not None:
        env["RAY_PROMETHEUS_HOST"] = f"http://127.0.0.1:{options.prometheus_port}"
    return env


def up(cfg: DualPathConfig, options: UpOptions) -> LocalCluster:
    """Start the head and every node (one at a time: concurrent raylet registrations time out
    on a busy machine), then Prometheus if asked; stops what it started if anything fails."""
    state_dir = options.state_dir
    state_dir.mkdir(parents=True, exist_ok=True)
    _refuse_running(state_dir)
    _require_free_ports(options)
    ray_bin = Path(sys.executable).parent / "ray"
    if not ray_bin.exists():
        raise LocalClusterError(f"no `ray` command next to {sys.executable}; install dualpath-ray into this environment")
    ports = {"agent": free_port(), "client": free_port(), "head": free_port()}
    ports.update({spec.node_id: free_port() for spec in plan_nodes(cfg)})
    cluster = LocalCluster(str(state_dir), f"127.0.0.1:{options.port}", f"http://127.0.0.1:{options.dashboard_port}",
                           ray_temp_dir=str(ray_temp_dir(options)))
    env = node_env(options)
    try:
        for expected, (name, role, args) in enumerate(node_commands(cfg, options, ports), start=1):
            log = state_dir / f"{name}.log"
            with log.open("w") as out:
                process = subprocess.Popen([str(ray_bin), "start", *args], env=env, stdout=out,
                                           stderr=subprocess.STDOUT, start_new_session=True)
            metrics_port = ports["head" if role == "head" else name]
            cluster.nodes.append(NodeProcess(name, role, process.pid, metrics_port, str(log)))
            cluster.save()
            _wait_for_nodes(cluster, expected, process, log)
        if options.prometheus_port is not None:
            _start_prometheus(cluster, options)
    except BaseException:
        stop(cluster)
        raise
    cluster.save()
    return cluster


def _refuse_running(state_dir: Path) -> None:
    try:
        running = LocalCluster.load(state_dir)
    except LocalClusterError:
        return
    if any(_alive(node.pid) for node in running.nodes):
        raise LocalClusterError(
            f"a local cluster recorded in {state_dir} is still running (Ray at {running.address}); "
            "stop it with `dualpath cluster down` or pass another --state-dir"
        )


def _require_free_ports(options: UpOptions) -> None:
    """A port already taken (another Ray head or dashboard, a Prometheus) is an error before
    anything starts: a dashboard that cannot bind would leave `up` talking to the other one."""
    wanted = {"--port": options.port, "--dashboard-port": options.dashboard_port}
    if options.prometheus_port is not None:
        wanted["--prometheus-port"] = options.prometheus_port
    for flag, port in wanted.items():
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                raise LocalClusterError(f"{flag} {port}: the port is in use (another Ray cluster?); pass another {flag}")


def _wait_for_nodes(cluster: LocalCluster, count: int, process: subprocess.Popen[bytes], log: Path) -> None:
    """Wait until the dashboard lists `count` alive nodes (the head's dashboard answers first)."""
    from ray.util.state import list_nodes

    deadline = time.monotonic() + NODE_START_TIMEOUT_S
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise LocalClusterError(f"`ray start` exited with {process.returncode}; its log {log}:\n{_tail(log)}")
        try:
            alive = list_nodes(address=cluster.dashboard_url, filters=[("state", "=", "ALIVE")], raise_on_missing_output=False)
            if len(alive) >= count:
                return
        except Exception:  # noqa: BLE001 - the dashboard is not up yet
            pass
        time.sleep(2)
    raise LocalClusterError(f"{count} Ray nodes were not alive within {NODE_START_TIMEOUT_S:.0f}s; see {log}:\n{_tail(log)}")


def _start_prometheus(cluster: LocalCluster, options: UpOptions) -> None:
    binary = find_prometheus()
    if binary is None:
        raise LocalClusterError(
            "--prometheus: no `prometheus` on PATH; install it (Debian/Ubuntu: apt-get install prometheus) "
            "or leave out --prometheus"
        )
    state_dir = Path(cluster.state_dir)
    targets = state_dir / "prometheus-targets.json"
    write_targets(targets, cluster.metrics_targets())
    config = state_dir / "prometheus.yml"
    config.write_text(scrape_config(targets, options.scrape_interval_s))
    assert options.prometheus_port is not None
    try:
        server = PrometheusServer.launch(binary, config, state_dir / "prometheus-data", options.prometheus_port,
                                         state_dir / "prometheus.log")
    except PrometheusError as exc:
        raise LocalClusterError(f"--prometheus: {exc}") from None
    assert server.process is not None
    cluster.prometheus_pid = server.process.pid
    cluster.prometheus_url = server.url


def down(state_dir: Path) -> LocalCluster:
    """Stop the cluster recorded in `state_dir` (Prometheus first, then the nodes, head last)."""
    cluster = LocalCluster.load(state_dir)
    stop(cluster)
    (state_dir / STATE_FILE).unlink(missing_ok=True)
    return cluster


def stop(cluster: LocalCluster) -> None:
    pids = ([cluster.prometheus_pid] if cluster.prometheus_pid else []) + [n.pid for n in reversed(cluster.nodes)]
    for pid in pids:
        _stop_group(pid)


def _stop_group(pid: int) -> None:
    """SIGTERM the process group a node (or Prometheus) leads; SIGKILL it if it outlives the wait.
    Every node is started in a session of its own, so its group is exactly its processes."""
    try:
        os.killpg(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline and _alive(pid):
        time.sleep(0.5)
    try:
        os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie left to a parent that has not reaped it counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (FileNotFoundError, ProcessLookupError, IndexError):
        return False


def _tail(log: Path, chars: int = 3000) -> str:
    return log.read_text()[-chars:] if log.exists() else ""
