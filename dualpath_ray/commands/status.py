"""`dualpath status`: a live view of a running cluster's deployment.

Ray nodes by role, each storage reader's read queue, SNIC bytes by read path and buffer use, each
engine's requests, tokens, free HBM and CNIC bytes, and the TTFT / TPOT of the latest served
turns, redrawn every --interval seconds until Ctrl-C. `--once` prints one snapshot; `--json`
prints it as one JSON object (one per line when live).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import socket
import time
from pathlib import Path

from dualpath_ray.config import load_config


class StatusError(RuntimeError):
    """`dualpath status` cannot reach the cluster, or a flag is bad; the message says which."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("status", help="live view of a running cluster", description=__doc__)
    parser.add_argument("--address", default="auto",
                        help="Ray cluster address, host:port (default: auto = RAY_ADDRESS, else the local cluster)")
    parser.add_argument("--namespace", default=None, help="Ray namespace of the deployment (default: runtime.namespace)")
    parser.add_argument("--config", type=Path, default=None, help="YAML config whose runtime.namespace to watch")
    parser.add_argument("--once", action="store_true", help="print one snapshot and exit")
    parser.add_argument("--json", action="store_true", help="print JSON instead of the text view")
    parser.add_argument("--interval", type=float, default=2.0, help="seconds between live refreshes (default 2)")
    parser.add_argument("--window", type=float, default=60.0, help="TTFT/TPOT over turns of the last N seconds (default 60)")
    parser.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the actors' answers (default 5)")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    for flag in ("interval", "window", "timeout"):
        if getattr(args, flag) <= 0:
            raise StatusError(f"--{flag} must be > 0 (got {getattr(args, flag)})")
    namespace = args.namespace or load_config(args.config).runtime.namespace
    _connect(args.address, namespace)
    from dualpath_ray.observability.status import collect
    from dualpath_ray.observability.status_view import CLEAR_SCREEN, render

    try:
        while True:
            status = collect(namespace, args.window, args.timeout)
            if args.json:
                print(json.dumps(dataclasses.asdict(status), sort_keys=True), flush=True)
            else:
                print(("" if args.once else CLEAR_SCREEN) + render(status), end="", flush=True)
            if args.once:
                return 0
            time.sleep(args.interval)
    except KeyboardInterrupt:
        return 0


def _connect(address: str, namespace: str) -> None:
    """Join the cluster as a quiet driver; a cluster that is not there is a one-line error."""
    import ray

    if address != "auto" and not address.startswith(("ray://", "http")):
        host, _, port = address.rpartition(":")
        try:
            socket.create_connection((host or "127.0.0.1", int(port)), timeout=3).close()
        except (OSError, ValueError):
            raise StatusError(
                f"--address {address}: no Ray cluster answers there; start one (`dualpath cluster up`) "
                "or pass the head's host:port"
            ) from None
    try:
        ray.init(address=address, namespace=namespace, log_to_driver=False, logging_level="ERROR")
    except ConnectionError as exc:
        raise StatusError(f"--address {address}: {exc}; start a cluster (`dualpath cluster up`) or pass --address") from None

