"""`dualpath demo`: Basic vs DualPath on an embedded 1P1D Ray cluster, same trajectories.

Prints each mode's JCT, the SNIC bytes read per node and per path, and whether every output
matched across modes. `--local` runs the single-process demo instead (model, store and prefix
index in this process, no Ray): a 3-turn conversation whose later turns reuse stored KV layer by
layer, checked against recomputation.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

from dualpath_ray.config import load_config
from dualpath_ray.demos.local import LOGIT_RTOL, LocalDemoResult, run_local_demo


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "demo",
        help="Basic vs DualPath on an embedded 1P1D Ray cluster (--local: one conversation, no Ray)",
        description=__doc__,
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of text")
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--local", action="store_true", help="single process, no Ray")
    parser.add_argument("--agents", type=int, default=8, help="trajectories (Ray demo)")
    parser.add_argument("--turns", type=int, default=10, help="turns per trajectory (Ray demo)")
    parser.add_argument("--first-tokens", type=int, default=1536, help="first prompt length (Ray demo)")
    parser.add_argument(
        "--store-root",
        type=Path,
        default=None,
        help="block store directory, kept afterwards (default: store.root, else a temporary one)",
    )
    parser.set_defaults(func=run_demo)


def run_demo(args: argparse.Namespace) -> int:
    if not args.local:
        return run_ray_demo(args)
    cfg = load_config(args.config)
    store_root = args.store_root or cfg.store.root
    if store_root is not None:
        result = run_local_demo(cfg, store_root)
    else:
        with tempfile.TemporaryDirectory(prefix="dualpath-demo-") as tmp:
            result = run_local_demo(cfg, tmp)
    return emit(args.json, result.to_json(), describe(result), result.within_tolerance,
                "KV reuse changed the model's output (see above)")


def emit(as_json: bool, data: object, text: str, ok: bool, failure: str) -> int:
    """Print the result as JSON or text; exit 1 with `failure` on stderr when it is not ok."""
    print(json.dumps(data, indent=2) if as_json else text)
    if not ok:
        print(f"dualpath demo: {failure}", file=sys.stderr)
        return 1
    return 0


def describe(result: LocalDemoResult) -> str:
    """The demo's result as lines a person reads."""
    lines = []
    for t in result.turns:
        lines.append(
            f"turn {t.turn}: prompt {t.prompt_tokens} tokens, hit {t.hit_tokens} from the store "
            f"({t.bytes_read:,} bytes read), computed {t.computed_tokens}, wrote {t.blocks_written} "
            f"block{'' if t.blocks_written == 1 else 's'}, generated {len(t.generated)} tokens "
            f"({'same' if t.tokens_match else 'DIFFERENT'} as from scratch), "
            f"max |logit diff| {t.max_abs_logit_diff:.3g}"
        )
    lines.append(
        f"total: hit {result.hit_tokens} tokens, read {result.bytes_read:,} bytes, wrote "
        f"{result.bytes_written:,} bytes; max |logit diff| vs recomputing from scratch "
        f"{result.max_abs_logit_diff:.3g} (tolerance {LOGIT_RTOL:g} x max |logit| "
        f"{result.max_abs_logit:.3g}): {'OK' if result.within_tolerance else 'FAILED'}"
    )
    return "\n".join(lines)


def run_ray_demo(args: argparse.Namespace) -> int:
    from dualpath_ray.demos.demo import demo_config, demo_trajectories, format_report
    from dualpath_ray.demos.demo import run_demo as run_cluster_demo

    if args.agents < 1 or args.turns < 1 or args.first_tokens < 1:
        print("dualpath demo: --agents, --turns and --first-tokens must be >= 1", file=sys.stderr)
        return 2
    cfg = load_config(args.config) if args.config else demo_config()
    trajectories = demo_trajectories(args.agents, args.turns, first=args.first_tokens, vocab=cfg.model.vocab_size)
    report = run_cluster_demo(cfg, trajectories)
    return emit(args.json, report.to_json(), format_report(report), report.outputs_match,
                "modes produced different outputs")
