"""`dualpath bench`: one workload through basic, dualpath and oracle on an embedded Ray cluster.

Same config and trajectories for every mode, each run on a fresh store, the modes interleaved
over --repeat rounds. Reports per mode (medians over the rounds): JCT, TTFT and TPOT p50/p99,
SNIC bytes per node, SNIC balance in the high-load window, requests per read path, and the
workload's bounds (I/O: hit bytes / the SNIC rate the mode can use; compute: the Oracle JCT).
The first turn of each trajectory runs untimed by default (--warmup-turns); what is timed and
how each figure is defined: dualpath_ray/bench/run.py, dualpath_ray/bench/figures.py.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from dualpath_ray.bench.figures import parse_modes
from dualpath_ray.config import DualPathConfig, load_config
from dualpath_ray.workload.trace import Trajectory, TraceError

DEFAULT_MODES = "basic,dualpath,oracle"
TRACE_FIX = "pass a Parquet trace (docs/trace-format.md), e.g. one `dualpath trace synth --out T.parquet` wrote"


class BenchInputError(ValueError):
    """A flag's value is unusable: the message names the flag and the fix."""


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "bench", help="Basic vs DualPath vs Oracle on one workload (JCT, TTFT/TPOT, SNIC balance, bounds)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--config", type=Path, default=None,
                        help="YAML config (default: the demo's embedded storage-bound 1P1D cluster)")
    parser.add_argument("--trace", type=Path, default=None,
                        help="Parquet trace (docs/trace-format.md); default: the synthetic agent workload below")
    parser.add_argument("--agents", type=int, default=8, help="synthetic workload: trajectories (default 8)")
    parser.add_argument("--turns", type=int, default=9, help="synthetic workload: turns each (default 9)")
    parser.add_argument("--first", type=int, default=2048, help="synthetic workload: first prompt tokens (default 2048)")
    parser.add_argument("--appended", type=int, default=16, help="synthetic workload: tokens appended per later turn (default 16)")
    parser.add_argument("--gen", type=int, default=8, help="synthetic workload: tokens generated per turn (default 8)")
    parser.add_argument("--seed", type=int, default=0, help="synthetic workload: token seed (default 0)")
    parser.add_argument("--samples", type=int, default=1,
                        help="synthetic workload: grouped sampling, G samples of each of the --agents prompts, which "
                        "share its first turn (GRPO's groups; dualpath_ray/workload/grouped.py); default 1: none")
    parser.add_argument("--modes", default=DEFAULT_MODES, help=f"comma list, run in this order (default {DEFAULT_MODES})")
    parser.add_argument("--repeat", type=int, default=1, help="rounds of every mode, interleaved (default 1)")
    parser.add_argument("--warmup-turns", type=int, default=1,
                        help="leading turns of each trajectory run untimed before the timed phase (default 1; 0: time all)")
    parser.add_argument("--sample-interval", type=float, default=0.25,
                        help="seconds between samples of the SNIC counters (default 0.25)")
    parser.add_argument("--json", action="store_true", help="print the report as one JSON object")
    parser.add_argument("--out", type=Path, default=None, help="also write the JSON report to this file")
    parser.add_argument("--plot", type=Path, default=None,
                        help="write a PNG: JCT per mode against its bounds, SNIC traffic per node over time")
    parser.set_defaults(func=run)


def _at_least(flag: str, value: float, low: float, example: str) -> None:
    if value < low:
        raise BenchInputError(f"{flag} must be >= {low:g} (got {value:g}); e.g. {flag} {example}")


def check_flags(args: argparse.Namespace) -> tuple[str, ...]:
    """Every flag that needs no file or cluster; the modes, parsed."""
    try:
        modes = parse_modes(args.modes)
    except ValueError as exc:
        raise BenchInputError(f"--modes: {exc}") from None
    _at_least("--repeat", args.repeat, 1, "3")
    _at_least("--warmup-turns", args.warmup_turns, 0, "1")
    if not args.sample_interval > 0:
        raise BenchInputError(f"--sample-interval must be > 0 seconds (got {args.sample_interval:g}); e.g. 0.25")
    if args.trace is None:
        for flag, value in (("--agents", args.agents), ("--turns", args.turns), ("--first", args.first),
                            ("--appended", args.appended), ("--gen", args.gen), ("--samples", args.samples)):
            _at_least(flag, value, 1, "8")
    if args.plot is not None:
        from dualpath_ray.bench.plot import PlotUnavailableError, require_matplotlib

        try:
            require_matplotlib()
        except PlotUnavailableError as exc:
            raise BenchInputError(str(exc)) from None
    return modes


def load_workload(args: argparse.Namespace, cfg: DualPathConfig) -> list[Trajectory]:
    """The trace's trajectories, or the synthetic agent workload; each must fit the model."""
    if args.trace is not None:
        from dualpath_ray.workload.trace import read_trace

        try:
            trajectories = read_trace(args.trace, cfg.model.vocab_size)
        except TraceError as exc:
            fix = exc.fix or TRACE_FIX
            raise BenchInputError(f"--trace: {TraceError(exc.problem, **{**exc.location(), 'fix': fix})}") from None
    elif args.samples > 1:
        from dualpath_ray.workload.grouped import grouped_trajectories

        trajectories = grouped_trajectories(args.agents, args.samples, args.turns, args.first, args.appended, args.gen,
                                            cfg.model.vocab_size, seed=args.seed)
    else:
        from dualpath_ray.demos.demo import demo_trajectories

        trajectories = demo_trajectories(args.agents, args.turns, args.first, args.appended, args.gen,
                                         cfg.model.vocab_size, seed=args.seed)
    if all(len(tr.turns) <= args.warmup_turns for tr in trajectories):
        raise BenchInputError(
            f"--warmup-turns {args.warmup_turns}: no trajectory has a turn after its warm-up, so nothing "
            "would be timed; pass --warmup-turns 0 (e.g. for one-turn traces) or a workload with more turns"
        )
    longest = max(sum(len(t.appended) + t.gen_len for t in tr.turns) for tr in trajectories)
    if longest > cfg.model.max_context:
        raise BenchInputError(
            f"the workload's longest trajectory holds {longest} tokens but model.max_context is "
            f"{cfg.model.max_context}; shorten it (--turns, --first, --trace) or raise model.max_context in --config"
        )
    return trajectories


def run(args: argparse.Namespace) -> int:
    try:
        modes = check_flags(args)
        cfg = load_config(args.config) if args.config else _demo_config()
        trajectories = load_workload(args, cfg)
    except BenchInputError as exc:
        print(f"dualpath bench: {exc}", file=sys.stderr)
        return 2
    from dualpath_ray.bench.run import BenchWorkload, run_bench
    from dualpath_ray.bench.report import format_text

    report = run_bench(
        cfg, BenchWorkload(trajectories, args.warmup_turns), modes, args.repeat,
        config_source=str(args.config) if args.config else "<demo defaults>", interval_s=args.sample_interval,
        progress=lambda line: print(f"dualpath bench: {line}", file=sys.stderr, flush=True),
    )
    data = report.to_json()
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(data, indent=2) + "\n")
    if args.plot is not None:
        from dualpath_ray.bench.plot import plot_report

        plot_report(report, args.plot)
    print(json.dumps(data, indent=2) if args.json else format_text(report))
    if not report.outputs_match:
        print("dualpath bench: the modes produced different outputs", file=sys.stderr)
        return 1
    return 0


def _demo_config() -> DualPathConfig:
    from dualpath_ray.demos.demo import demo_config

    return demo_config()
