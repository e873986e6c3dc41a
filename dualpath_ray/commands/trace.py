"""`dualpath trace`: synthesise, import and inspect trajectory traces (docs/trace-format.md)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any

from dualpath_ray.config import ConfigError, load_config
from dualpath_ray.workload.mooncake import convert_mooncake
from dualpath_ray.workload.stats import TraceStats, shapes_of, trace_stats
from dualpath_ray.workload.tokens import MAX_VOCAB_SIZE
from dualpath_ray.workload.synth import SynthParams, param_doc, parse_token_count, synthesize
from dualpath_ray.workload.trace import (
    TraceError,
    read_table,
    table_to_trajectories,
    trace_shapes,
    write_table,
)

# Token-count flags also accept 64K / 1M forms.
_TOKEN_COUNT_FIELDS = frozenset({"max_len", "max_appended", "max_gen"})


def register(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "trace", help="synthesise, import and inspect trajectory traces", description=__doc__
    )
    commands = parser.add_subparsers(dest="trace_command", required=True)
    _register_synth(commands)
    _register_import(commands)
    _register_stats(commands)


def _add_config_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", type=Path, help="cluster config YAML whose model.vocab_size / store.block_size to use"
    )
    parser.add_argument("--block-size", type=int, help="tokens per KV block for the hit rate "
                        "(default: the config's store.block_size, 64)")


def _register_synth(commands: Any) -> None:
    parser = commands.add_parser(
        "synth",
        help="write a synthetic coding-agent trace with the paper's statistics",
        description="Synthetic agentic trace (one trajectory per agent), written as Parquet.",
    )
    parser.add_argument("--out", type=Path, required=True, help="output Parquet file")
    for spec in dataclasses.fields(SynthParams):
        kind = parse_token_count if spec.name in _TOKEN_COUNT_FIELDS else type(spec.default)
        parser.add_argument(
            f"--{spec.name.replace('_', '-')}",
            dest=spec.name,
            type=kind,
            default=spec.default,
            help=f"{param_doc(spec.name)} (default {spec.default})",
        )
    _add_config_flags(parser)
    parser.set_defaults(func=run_synth)


def _register_import(commands: Any) -> None:
    parser = commands.add_parser(
        "import-mooncake",
        help="convert a Mooncake FAST'25 .jsonl trace to a Parquet trace",
        description="Each JSON line becomes a one-turn trajectory arriving at timestamp/1000 s.",
    )
    parser.add_argument("input", type=Path, help="Mooncake trace, one JSON object per line")
    parser.add_argument("--out", type=Path, required=True, help="output Parquet file")
    parser.add_argument(
        "--vocab-size", type=int, help="token ids lie in [0, V) (default: the config's model.vocab_size)"
    )
    _add_config_flags(parser)
    parser.set_defaults(func=run_import_mooncake)


def _register_stats(commands: Any) -> None:
    parser = commands.add_parser(
        "stats", help="validate a Parquet trace and print its statistics",
        description="Turns, lengths and the expected steady-state KV hit rate of a trace.",
    )
    parser.add_argument("trace", type=Path, help="Parquet trace")
    parser.add_argument(
        "--vocab-size", type=int,
        help="also check every token id against this vocabulary (expands seeded rows)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")
    _add_config_flags(parser)
    parser.set_defaults(func=run_stats)


def _block_size(args: argparse.Namespace) -> int:
    if args.block_size is not None:
        if args.block_size < 1:
            raise ConfigError(f"--block-size must be >= 1, got {args.block_size}")
        return args.block_size
    return load_config(args.config).store.block_size


def _vocab_size(args: argparse.Namespace) -> int:
    if args.vocab_size is None:
        return load_config(args.config).model.vocab_size
    if not 2 <= args.vocab_size <= MAX_VOCAB_SIZE:
        raise ConfigError(f"--vocab-size must be in [2, {MAX_VOCAB_SIZE}], got {args.vocab_size}")
    return args.vocab_size


def _print_stats(stats: TraceStats, as_json: bool) -> None:
    if as_json:
        print(json.dumps(stats.as_dict(), indent=2))
        return
    rows = stats.as_dict()
    width = max(len(name) for name in rows)
    for name, value in rows.items():
        shown = f"{value:.4f}" if isinstance(value, float) else str(value)
        print(f"{name:<{width}}  {shown}")


def _guarded(command: str, args: argparse.Namespace, body: Any) -> int:
    try:
        return body(args)
    except (TraceError, ConfigError) as exc:
        print(f"dualpath trace {command}: {exc}", file=sys.stderr)
        return 2


def run_synth(args: argparse.Namespace) -> int:
    return _guarded("synth", args, _synth)


def _synth(args: argparse.Namespace) -> int:
    params = SynthParams(**{spec.name: getattr(args, spec.name) for spec in dataclasses.fields(SynthParams)})
    table = synthesize(params)
    write_table(table, args.out)
    print(f"wrote {table.num_rows} turns of {params.agents} agents to {args.out}")
    _print_stats(trace_stats(trace_shapes(table), _block_size(args)), as_json=False)
    return 0


def run_import_mooncake(args: argparse.Namespace) -> int:
    return _guarded("import-mooncake", args, _import_mooncake)


def _import_mooncake(args: argparse.Namespace) -> int:
    table = convert_mooncake(args.input, args.out, _vocab_size(args))
    print(f"wrote {table.num_rows} requests from {args.input} to {args.out}")
    _print_stats(trace_stats(trace_shapes(table), _block_size(args)), as_json=False)
    return 0


def run_stats(args: argparse.Namespace) -> int:
    return _guarded("stats", args, _stats)


def _stats(args: argparse.Namespace) -> int:
    table = read_table(args.trace)
    try:
        if args.vocab_size is not None:
            shapes = shapes_of(table_to_trajectories(table, _vocab_size(args)))
        else:
            shapes = trace_shapes(table)
    except TraceError as exc:
        raise exc.with_source(str(args.trace)) from None
    if not shapes:
        raise TraceError("the trace has no rows", source=str(args.trace))
    _print_stats(trace_stats(shapes, _block_size(args)), args.json)
    return 0
