"""`dualpath bounds`: the bottleneck-free P/D range of a hardware configuration (paper 4.2)."""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from dualpath_ray.analysis.report import RESOURCE_OF, PDBounds, RatioCheck, classify_ratio, pd_bounds


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "bounds",
        help="bottleneck-free prefill/decode node ratio for given NIC and DRAM rates",
        description=__doc__,
    )
    parser.add_argument("--gpus-per-node", type=int, default=8, help="g (default 8)")
    parser.add_argument("--snic-gbps", type=float, default=400.0, help="storage NIC per node, Gbit/s")
    parser.add_argument("--cnic-gbps", type=float, default=400.0, help="compute NIC per GPU, Gbit/s")
    parser.add_argument("--dram-gbs", type=float, default=500.0, help="DRAM bandwidth per node, GB/s")
    parser.add_argument("--prefill-nodes", type=int, help="P: check this ratio (with --decode-nodes)")
    parser.add_argument("--decode-nodes", type=int, help="D: check this ratio (with --prefill-nodes)")
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    parser.set_defaults(func=run)


def _usage_error(message: str) -> int:
    print(f"dualpath bounds: {message}", file=sys.stderr)
    return 2


def _validated_inputs(args: argparse.Namespace) -> str | None:
    """The first bad argument as an error message, or None."""
    for flag, value in (
        ("--gpus-per-node", args.gpus_per_node),
        ("--snic-gbps", args.snic_gbps),
        ("--cnic-gbps", args.cnic_gbps),
        ("--dram-gbs", args.dram_gbs),
    ):
        if not value > 0 or value == float("inf"):
            return f"{flag} must be a positive number (got {value})"
    given = [args.prefill_nodes is not None, args.decode_nodes is not None]
    if any(given) and not all(given):
        return "give both --prefill-nodes and --decode-nodes, or neither"
    for flag, value in (("--prefill-nodes", args.prefill_nodes), ("--decode-nodes", args.decode_nodes)):
        if value is not None and value < 1:
            return f"{flag} must be a positive integer (got {value})"
    return None


def as_json(bounds: PDBounds, check: RatioCheck | None) -> dict[str, Any]:
    """The --json object: lower, upper, binding, constraints, empty_reason, and the ratio check."""
    data: dict[str, Any] = {
        "lower": bounds.lower,
        "upper": bounds.upper,
        "binding": list(bounds.binding),
        "constraints": dict(bounds.constraints),
        "empty": bounds.is_empty,
        "empty_reason": bounds.empty_reason,
        "s": bounds.s,
        "cnic_gbytes": bounds.cnic_gbytes,
    }
    if check is not None:
        data["ratio"] = check.ratio
        data["inside"] = check.inside
        data["saturates"] = list(check.saturates)
    return data


def _bound_text(bound: float | None) -> str:
    return "none (no positive ratio)" if bound is None else f"{bound:.4g}"


def as_text(bounds: PDBounds, check: RatioCheck | None) -> str:
    lines = [f"s = {bounds.s:.4g}, B = {bounds.cnic_gbytes:.4g} GB/s, g = {bounds.gpus_per_node}"]
    for name, bound in bounds.constraints.items():
        side = ">=" if name == "pe_cnic_write" else "<="
        lines.append(f"  {name:<14} P/D {side} {_bound_text(bound)}   [{RESOURCE_OF[name]}]")
    if bounds.empty_reason is not None:
        lines.append(f"no bottleneck-free P/D: {bounds.empty_reason}")
    else:
        lines.append(
            f"bottleneck-free: {bounds.lower:.4g} <= P/D <= {bounds.upper:.4g} "
            f"(binding: {', '.join(bounds.binding)})"
        )
    if check is not None:
        where = "inside" if check.inside else "outside"
        lines.append(f"P/D = {check.prefill_nodes}/{check.decode_nodes} = {check.ratio:.4g}: {where}")
        if check.saturates:
            names = ", ".join(RESOURCE_OF[name] for name in check.saturates)
            lines.append(f"  saturates: {names}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    problem = _validated_inputs(args)
    if problem is not None:
        return _usage_error(problem)
    try:
        bounds = pd_bounds(args.gpus_per_node, args.snic_gbps, args.cnic_gbps, args.dram_gbs)
        check = None
        if args.prefill_nodes is not None:
            check = classify_ratio(bounds, args.prefill_nodes, args.decode_nodes)
    except ValueError as exc:
        return _usage_error(str(exc))
    print(json.dumps(as_json(bounds, check), indent=2) if args.json else as_text(bounds, check))
    return 0
