"""`dualpath cluster up|down`: a labelled local Ray cluster with its dashboard, on this machine.

`up` starts a head (dashboard, `dualpath_head` resource) and one Ray node per node of the
config's cluster section, labelled by role with their slot resources, as a real cluster's nodes
are; `ray job submit`, `dualpath run --address`, `dualpath status` and the Ray dashboard then
work against it as documented. `--prometheus` also starts a Prometheus (the `prometheus` binary on
PATH) scraping every node's metrics. `down` stops exactly what `up` started.

The dashboard and its job-submission API listen on 127.0.0.1 only. The GCS, the raylets and
their agents listen on every interface: Ray 2.60 binds them to loopback only in a single-node
cluster (it replaces a loopback --node-ip-address with the machine's address, and binds a
non-loopback node address as the wildcard), so Ray's token authentication is what keeps other
machines out. It is on, as `ray.init()` turns it on for a new local cluster (`ray start --head`
alone turns it on only when a token already exists): `up` makes a token in ~/.ray/auth_token if
there is none, and its nodes (and so its jobs' drivers) run with RAY_AUTH_MODE=token. A client
given the address (`dualpath run/status --address`, `DualPathCluster.connect`, `ray job submit`)
needs `export RAY_AUTH_MODE=token` too: Ray reads the token from ~/.ray/auth_token but, for an
explicit address, turns auth on only when told. `RAY_AUTH_MODE=disabled` in up's environment
turns it off, and `up` then says so, and how to turn it on.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from dualpath_ray.config import load_config
from dualpath_ray.local_cluster import DEFAULT_STATE_DIR, LocalCluster, LocalClusterError, UpOptions, down, up


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("cluster", help="start or stop a labelled local Ray cluster", description=__doc__)
    actions = parser.add_subparsers(dest="action", required=True)
    start = actions.add_parser("up", help="start the head and one Ray node per configured node")
    start.add_argument("--config", type=Path, default=None, help="YAML config whose cluster section to start")
    start.add_argument("--port", type=int, default=6379, help="the head's GCS port (default 6379)")
    start.add_argument("--dashboard-port", type=int, default=8265, help="the Ray dashboard's port (default 8265)")
    start.add_argument("--object-store-mb", type=int, default=200, help="object store per node, MiB (default 200)")
    start.add_argument("--temp-dir", type=Path, default=None,
                       help="Ray's temporary directory of the nodes (default /tmp/dualpath-ray-<port>)")
    start.add_argument("--prometheus", action="store_true", help="also start Prometheus (the prometheus binary on PATH)")
    start.add_argument("--prometheus-port", type=int, default=9090, help="Prometheus' port (default 9090)")
    start.add_argument("--scrape-interval", type=float, default=5.0, help="Prometheus scrape interval, s (default 5)")
    start.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help=f"pids, ports, logs (default {DEFAULT_STATE_DIR})")
    start.add_argument("--json", action="store_true", help="print the cluster's addresses as one JSON object")
    start.set_defaults(func=run_up)
    stop = actions.add_parser("down", help="stop the cluster `up` started")
    stop.add_argument("--state-dir", type=Path, default=DEFAULT_STATE_DIR, help=f"as given to up (default {DEFAULT_STATE_DIR})")
    stop.set_defaults(func=run_down)


def _options(args: argparse.Namespace) -> UpOptions:
    for flag in ("port", "dashboard_port", "prometheus_port"):
        value = getattr(args, flag)
        if not 1 <= value <= 65535:
            raise LocalClusterError(f"--{flag.replace('_', '-')} must be a port in [1, 65535] (got {value})")
    if args.object_store_mb < 75:
        raise LocalClusterError(f"--object-store-mb must be >= 75, Ray's minimum (got {args.object_store_mb})")
    if args.scrape_interval <= 0:
        raise LocalClusterError(f"--scrape-interval must be > 0 (got {args.scrape_interval})")
    return UpOptions(
        state_dir=args.state_dir, port=args.port, dashboard_port=args.dashboard_port,
        object_store_mb=args.object_store_mb, temp_dir=args.temp_dir,
        prometheus_port=args.prometheus_port if args.prometheus else None, scrape_interval_s=args.scrape_interval,
    )


AUTH_MODE_ENV = "RAY_AUTH_MODE"


@dataclass(frozen=True)
class RayTokenAuth:
    """Whether `up` starts the nodes with Ray's token authentication, and why."""

    enabled: bool
    mode: str | None  # RAY_AUTH_MODE as the user set it; None: unset, so `up` turns token auth on

    def describe(self) -> str:
        if self.enabled:
            return (f"on: clients need export {AUTH_MODE_ENV}=token (dualpath run/status --address, ray job submit); "
                    "the token is ~/.ray/auth_token, `ray get-auth-token` prints it")
        return (f"OFF ({AUTH_MODE_ENV}={self.mode}): anyone who reaches this machine's Ray ports can run code on the "
                f"cluster; to turn it on, unset {AUTH_MODE_ENV} (or export {AUTH_MODE_ENV}=token), then `dualpath "
                "cluster down` and up")


def ray_token_auth(env: Mapping[str, str]) -> RayTokenAuth:
    """Token auth unless RAY_AUTH_MODE says `disabled` (as tests set it)."""
    mode = env.get(AUTH_MODE_ENV)
    return RayTokenAuth(mode is None or mode.lower() != "disabled", mode)


def enable_ray_token_auth() -> None:
    """What `ray.init()` does for a new local cluster (ray/_private/worker.py): RAY_AUTH_MODE=token
    in this process, whose environment the nodes inherit (a mode the user set is kept), and a
    token in ~/.ray/auth_token unless one exists (there, in RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH)."""
    from ray._private.authentication.authentication_token_setup import (
        enable_token_auth_by_default,
        ensure_token_if_auth_enabled,
    )

    enable_token_auth_by_default()
    ensure_token_if_auth_enabled(None, create_token_if_missing=True)


def run_up(args: argparse.Namespace) -> int:
    options = _options(args)
    cfg = load_config(args.config)
    auth = ray_token_auth(os.environ)
    if auth.enabled:
        enable_ray_token_auth()
    cluster = up(cfg, options)
    if args.json:
        print(json.dumps({**dataclasses.asdict(cluster), "ray_token_auth": auth.enabled}))
    else:
        print(describe(cluster, auth))
    return 0


def describe(cluster: LocalCluster, auth: RayTokenAuth) -> str:
    nodes = ", ".join(f"{n.name} ({n.role})" for n in cluster.nodes)
    lines = [
        f"Local Ray cluster up: {nodes}",
        f"  Ray address      {cluster.address}   (dualpath run/status --address {cluster.address})",
        f"  Ray dashboard    {cluster.dashboard_url}   (ray job submit finds it; with other Ray clusters on this "
        f"machine: export RAY_API_SERVER_ADDRESS={cluster.dashboard_url})",
        "  Listening        the dashboard on 127.0.0.1 only; Ray's own ports (GCS, raylets) on every interface",
        f"  Ray token auth   {auth.describe()}",
    ]
    if cluster.prometheus_url:
        lines.append(f"  Prometheus       {cluster.prometheus_url}   (dashboards/: Grafana, see the README)")
    lines += [f"  Ray files        {cluster.ray_temp_dir}   (Grafana config: session_latest/metrics/grafana/)",
              f"  state and logs   {cluster.state_dir}", "Stop it with: dualpath cluster down"
              + ("" if Path(cluster.state_dir) == DEFAULT_STATE_DIR else f" --state-dir {cluster.state_dir}")]
    return "\n".join(lines)


def run_down(args: argparse.Namespace) -> int:
    cluster = down(args.state_dir)
    print(f"Stopped the local Ray cluster at {cluster.address} ({len(cluster.nodes)} nodes"
          + (", Prometheus" if cluster.prometheus_pid else "") + ")")
    return 0
