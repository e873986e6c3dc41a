"""The `dualpath` command: one subcommand per module in dualpath_ray.commands."""

from __future__ import annotations

import argparse
import importlib
import sys

from dualpath_ray.config import ConfigError

# Each module defines `register(subparsers)`, which adds its parser and sets `func(args) -> int`.
COMMAND_MODULES = (
    "dualpath_ray.commands.demo",
    "dualpath_ray.commands.bounds",
    "dualpath_ray.commands.profile",
    "dualpath_ray.commands.trace",
    "dualpath_ray.commands.run",
    "dualpath_ray.commands.bench",
    "dualpath_ray.commands.cluster",
    "dualpath_ray.commands.status",
    "dualpath_ray.commands.sim",
    "dualpath_ray.commands.serve",
    "dualpath_ray.commands.qos",
)


def user_errors() -> tuple[type[Exception], ...]:
    from dualpath_ray.api.tokenizer import TokenizerError
    from dualpath_ray.api.validation import RequestError
    from dualpath_ray.runtime.deploy.deployment import DeploymentConflictError
    from dualpath_ray.commands.status import StatusError
    from dualpath_ray.local_cluster import LocalClusterError
    from dualpath_ray.config.hf import WeightsError
    from dualpath_ray.workload.validate import TraceError

    return (ConfigError, TraceError, RequestError, WeightsError, DeploymentConflictError, LocalClusterError, StatusError,
            TokenizerError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="dualpath", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    known = user_errors()
    try:
        return int(args.func(args) or 0)
    except known as exc:
        # Bad input is the user's to fix: one line naming the field or file, no traceback.
        print(f"dualpath: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
