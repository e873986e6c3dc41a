"""`dualpath qos --fabric ib|roce [--json] [--config X]`: the traffic isolation to deploy.

Prints the environment each actor kind runs with (injected into its Ray runtime_env by the
cluster) and the fabric policy that gives those classes their priorities: an OpenSM snippet on
InfiniBand, the DSCP -> priority -> traffic class mapping with mlnx_qos commands on RoCE.
Nothing is applied here: the subnet manager and the switches are the operator's.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from dualpath_ray.config import ConfigError, load_config
from dualpath_ray.config.qos import QosConfig
from dualpath_ray.runtime.placement.qos import ActorKind, actor_environment, collective_class, kv_class
from dualpath_ray.runtime.placement.qos_fabric import opensm_policy, roce_policy

FABRICS = ("ib", "roce")


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "qos",
        help="KV traffic isolation: each actor's environment and the fabric's QoS policy",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--fabric", default=None, help="ib or roce (default: the config's qos.fabric)")
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _usage_error(message: str) -> int:
    print(f"dualpath qos: {message}", file=sys.stderr)
    return 2


def as_json(qos: QosConfig) -> dict[str, Any]:
    """The --json object: fabric, per-actor environment, the two classes and the fabric policy."""
    data: dict[str, Any] = {
        "fabric": qos.fabric,
        "enabled": qos.enabled,
        "environment": {str(kind): actor_environment(qos, kind) for kind in ActorKind},
        "kv": {**vars(kv_class(qos)), "virtual_lane": qos.kv_virtual_lane},
        "collectives": {**vars(collective_class(qos)), "virtual_lane": qos.collective_virtual_lane},
    }
    if qos.fabric == "ib":
        data["opensm"] = list(opensm_policy(qos).lines)
    else:
        policy = roce_policy(qos)
        data["roce"] = {
            "dscp_to_priority": {str(dscp): priority for dscp, priority in policy.dscp_to_priority},
            "priority_to_tc": list(policy.priority_to_tc),
            "tc_bandwidth_percent": list(policy.tc_bandwidth),
            "pfc": list(policy.pfc),
            "commands": list(policy.commands),
        }
    return data


def as_text(qos: QosConfig) -> str:
    kv, collectives = kv_class(qos), collective_class(qos)
    level, lane = ("SL", "VL") if qos.fabric == "ib" else ("priority", "TC")
    summary = (
        f"fabric: {qos.fabric}; KV on {level} {kv.service_level} -> {lane} {qos.kv_virtual_lane} (low priority), "
        f"collectives on {level} {collectives.service_level} -> {lane} {qos.collective_virtual_lane} (high priority)"
    )
    lines = [
        summary,
        "",
        "environment by actor (Ray runtime_env env_vars)" + ("" if qos.enabled else ": none, qos.enabled is false"),
    ]
    for kind in ActorKind:
        env = actor_environment(qos, kind)
        lines.append(f"  {kind!s:<15} {' '.join(f'{k}={v}' for k, v in env.items()) or '(none)'}")
    lines.append("")
    if qos.fabric == "ib":
        lines.append("OpenSM (add to opensm.conf or the cached options file, then restart OpenSM):")
        lines.extend(f"  {line}" for line in opensm_policy(qos).lines)
        return "\n".join(lines)
    policy = roce_policy(qos)
    lines.append("RoCE: DSCP -> priority -> traffic class (every NIC port and switch on the path):")
    for (dscp, priority), what in zip(policy.dscp_to_priority, ("KV", "collectives")):
        tc = policy.priority_to_tc[priority]
        lines.append(f"  {what:<11} DSCP {dscp:>2} (traffic class byte {dscp << 2}) -> priority {priority} -> TC {tc}")
    lines.append(f"  ETS minimum share per TC 0..7 (%): {','.join(map(str, policy.tc_bandwidth))}")
    lines.append(f"  PFC per priority 0..7: {','.join(map(str, policy.pfc))}")
    lines.append("NIC ports (NVIDIA mlnx_qos; <netdev> is each RoCE port's interface):")
    lines.extend(f"  {command}" for command in policy.commands)
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.fabric is not None and args.fabric not in FABRICS:
        return _usage_error(f"--fabric must be one of {', '.join(FABRICS)} (got {args.fabric!r})")
    cfg = load_config(args.config)
    if args.fabric is not None:
        try:
            cfg = cfg.with_overrides(qos={"fabric": args.fabric})
        except ConfigError as exc:
            return _usage_error(f"--fabric {args.fabric}: the config's qos section does not fit it: {' '.join(str(exc).split())}")
    print(json.dumps(as_json(cfg.qos), indent=2) if args.json else as_text(cfg.qos))
    return 0
