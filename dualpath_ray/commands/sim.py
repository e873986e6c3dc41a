"""`dualpath sim --config X --trace T --mode M [--json]`: simulate a trace on a cluster.

The discrete-event simulator (dualpath_ray/sim/) runs the trace on the config's P/D cluster with
the runtime's own scheduler core making every decision. Without a `sim` section the cluster is
this machine as the runtime emulates it (the emulation profile's engine time, the cluster
section's rates); with `sim.hardware_profile` and `sim.model_profile` it is that GPU-class node
and model (cluster_configs/profiles/). The trace is a Parquet trace (docs/trace-format.md) or a
Mooncake JSONL file (.jsonl).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dualpath_ray.config import ConfigError

if TYPE_CHECKING:
    from dualpath_ray.sim.results import SimResult


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser("sim", help="simulate a trace on a (large) cluster", description=__doc__)
    parser.add_argument("--config", type=Path, default=None, help="cluster config YAML (default: embedded defaults)")
    parser.add_argument("--trace", type=Path, required=True, help="Parquet trace, or Mooncake .jsonl")
    parser.add_argument("--mode", choices=("dualpath", "basic", "oracle"), default=None,
                        help="default: the config's runtime.mode")
    parser.add_argument("--quota-scope", choices=("layer", "forward"), default=None,
                        help="what the compute quota bounds: the whole forward's time (the paper's reading, every "
                        "figure in benchmarks/README.md) or one layer's (the runtime's engines'); default: the "
                        "config's sim.quota_scope, forward unless set")
    parser.add_argument("--warmup-turns", type=int, default=0,
                        help="turns of every trajectory run before the timed phase (default 0)")
    parser.add_argument("--json", action="store_true", help="print the whole result as JSON")
    parser.set_defaults(func=main)


def main(args: argparse.Namespace) -> int:
    from dualpath_ray.sim.profiles import load_sim_config
    from dualpath_ray.sim.settings import SimOptions
    from dualpath_ray.sim.simulator import simulate
    from dualpath_ray.sim.workload import load_workload

    if args.warmup_turns < 0:
        raise ConfigError(f"--warmup-turns: must be >= 0 (got {args.warmup_turns})")
    cfg = load_sim_config(args.config)
    workload = load_workload(args.trace, cfg.store.block_size)
    options = SimOptions(quota_scope=args.quota_scope, warmup_turns=args.warmup_turns)
    result = simulate(cfg, workload, args.mode, options)
    if args.json:
        print(json.dumps(result.to_json(), indent=2))
        return 0
    print(result.headline())
    print(f"compute quota bounds: the {result.quota_scope} (sim.quota_scope / --quota-scope)")
    print(f"SNIC read bytes per node: {json.dumps(result.snic_read_bytes)}")
    parts = ", ".join(f"{part} {seconds:.3f} s" for part, seconds in result.ttft_parts_s.items())
    print(f"mean TTFT by part: {parts}")
    print(_attention_line(result))
    print(result.staging_line())
    print(f"scheduler CPU: {result.scheduler_cpu_s:.2f} s ({result.scheduler_cpu_per_sim_s:.4f} s per simulated s); "
          f"{result.events} events in {result.wall_s:.1f} s")
    return 0


def _attention_line(result: SimResult) -> str:
    balance, full, totals = result.attention_balance, result.attention_balance_full_rounds, result.attention_engine_totals
    if balance is None:
        return "attention Max/Avg: n/a (engines step independently)"
    full_text = "n/a" if full is None else f"{full:.3f}"
    totals_text = "n/a" if totals is None else f"{totals:.3f}"
    return (f"attention Max/Avg across data-parallel peers: {balance:.3f} per round (rounds {result.attention_fill or 0.0:.2f} "
            f"full on average; {full_text} over rounds >= 90% full), {totals_text} per engine over the window")
