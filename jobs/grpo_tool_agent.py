"""Ray job: GRPO on a multi-turn tool task, rolled out on DualPath, trained in this process.

    python jobs/grpo_tool_agent.py --out results/grpo                      # embedded local cluster
    ray job submit --working-dir . -- python jobs/grpo_tool_agent.py \
        --config cluster_configs/local-1p1d.yaml --out results/grpo        # the job's cluster

The agent looks a key up with a tool and answers with the tool's result (dualpath_ray/rl/
lookup_task.py). The trainer (plain torch, this process's device) warms the model up on the task's
format, then loops: G samples per prompt through the `rollout-server` (temperature > 0, log-probs
returned, the tool time hinted), reward, the GRPO loss with the rollout's log-probs as the
behaviour policy, an optimizer step, and a broadcast of the weights to every engine as the next
weight version (which moves the KV namespace). `--shape verl` makes the calls verl's
ToolAgentLoop makes instead (docs/rl.md, "The GRPO job").

Writes, under --out: steps.jsonl (one line per step, as it goes), summary.json (settings,
warm-up, checks) and grpo.png. Exit code 1 when a check fails: every sampled token's log-prob
within --max-gap of the trainer's, no turn served at a stale version and no hit of an older
version's block, every later turn hitting its earlier turn's blocks, and (with 10 steps or
more) the mean reward of the last 5 steps at >= 2x that of the first 3 or >= 0.8.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

# Run as a script from a job's working directory: import the package shipped beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dualpath_ray.cli import user_errors  # noqa: E402
from dualpath_ray.config import DualPathConfig, load_config  # noqa: E402

MEAN_GAP_LIMIT = 1e-6


def settings_from(args: argparse.Namespace) -> Any:
    from dualpath_ray.rl.loop import GRPOSettings

    return GRPOSettings(
        steps=args.steps, prompts=args.prompts, group=args.group, temperature=args.temperature, lr=args.lr,
        clip_eps=args.clip_eps, epochs=args.epochs, warmup_steps=args.warmup_steps, tool_s=args.tool_s,
        shape=args.shape, seed=args.seed, time_budget_s=args.time_budget_s, device=args.trainer_device,
    )


def checks(records: list[Any], max_gap: float) -> dict[str, bool]:
    result = {
        "logprob_gap_max": all(r.logprob_gap["max"] <= max_gap for r in records),
        "logprob_gap_mean": all(r.logprob_gap["mean"] <= MEAN_GAP_LIMIT for r in records),
        "served_the_published_version": all(r.namespace["stale_version_turns"] == 0 for r in records),
        "no_hit_of_an_older_version": all(r.namespace["old_version_hit_blocks"] == 0 for r in records),
        "every_hit_from_this_step": all(r.namespace["unexplained_hit_blocks"] == 0 for r in records),
        "later_turns_hit_earlier_turns": all(
            r.namespace["later_turns_hitting_earlier"] == r.namespace["later_turns"] for r in records
        ),
    }
    if len(records) >= 10:
        start = sum(r.mean_reward for r in records[:3]) / 3
        end = sum(r.mean_reward for r in records[-5:]) / 5
        result["reward_learnt"] = end >= 0.8 or end >= 2 * start
    return result


def connect(cfg: DualPathConfig, address: str | None) -> Any:
    """The job's cluster when submitted with `ray job submit` (or --address), else an embedded one."""
    from dualpath_ray.cluster import DualPathCluster

    if address is None and not os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR"):
        return DualPathCluster.start(cfg)
    return DualPathCluster.connect(cfg, address or "auto")


def run(cfg: DualPathConfig, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    import torch

    from dualpath_ray.rl.loop import GRPORun
    from dualpath_ray.rl.report import append_jsonl, plot

    torch.set_num_threads(args.trainer_threads)
    settings = settings_from(args)
    out.mkdir(parents=True, exist_ok=True)
    # A Ray job's working directory is replaced when its driver joins the cluster, and torch
    # looks up the current directory when the optimizer first imports its compiler: work from
    # the output folder, which stays.
    os.chdir(out)
    steps_path = out / "steps.jsonl"
    steps_path.write_text("")
    started = time.monotonic()
    cluster = connect(cfg, args.address)
    try:
        cluster.deploy(replace_existing=args.replace)
        grpo = GRPORun(cluster, settings)
        deployed_s = time.monotonic() - started
        warm = grpo.warm_up()

        def report(record: Any) -> None:
            append_jsonl(steps_path, record)
            print(json.dumps({k: record.as_json()[k] for k in ("step", "mean_reward", "hit_rate", "rollout_s", "train_s")}
                             | {"gap_max": record.logprob_gap["max"]}), flush=True)

        records = grpo.run(report)
    finally:
        if cluster.local_cluster is not None:
            cluster.shutdown()  # the embedded cluster this job started
        else:
            cluster.teardown()  # the job's deployment only: the cluster is the user's
    verdicts = checks(records, args.max_gap)
    title = (f"GRPO, lookup-tool task, {settings.prompts} prompts x G={settings.group}, shape {settings.shape}: "
             f"reward {records[0].mean_reward:.2f} -> {records[-1].mean_reward:.2f} in {records[-1].elapsed_s:.0f} s"
             if records else "GRPO: no step ran")
    if records:
        plot(records, out / "grpo.png", title)
    return {
        "settings": asdict(settings), "trainer_threads": args.trainer_threads, "deploy_s": deployed_s,
        "warm_up": asdict(warm), "chance_reward": grpo.task.chance_reward, "steps_run": len(records),
        "first_reward": records[0].mean_reward if records else None,
        "last_reward": records[-1].mean_reward if records else None,
        "loop_s": records[-1].elapsed_s if records else 0.0, "job_s": time.monotonic() - started,
        "checks": verdicts,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--out", type=Path, required=True, help="folder for steps.jsonl, summary.json, grpo.png")
    parser.add_argument("--address", default=None,
                        help="Ray cluster to use (default: the job's when submitted, else an embedded local one)")
    parser.add_argument("--steps", type=int, default=80)
    parser.add_argument("--time-budget-s", type=float, default=None, help="start no step after this many seconds")
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="G: samples per prompt")
    parser.add_argument("--temperature", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=1e-3, help="Adam, warm-up and RL")
    parser.add_argument("--clip-eps", type=float, default=0.2)
    parser.add_argument("--epochs", type=int, default=4, help="optimizer passes per rollout batch")
    parser.add_argument("--warmup-steps", type=int, default=60, help="supervised steps on the task's format")
    parser.add_argument("--tool-s", type=float, default=0.05, help="seconds the tool takes between turns")
    parser.add_argument("--shape", choices=("dualpath", "verl"), default="dualpath",
                        help="dualpath: sessions, seeds and tool-time hints; verl: the calls verl's ToolAgentLoop makes")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--trainer-threads", type=int, default=1, help="torch threads of the trainer")
    parser.add_argument("--trainer-device", default="cpu", help="the trainer's torch device (cpu, cuda, cuda:1, ...)")
    parser.add_argument("--max-gap", type=float, default=1e-4, help="largest rollout-vs-trainer log-prob gap allowed")
    parser.add_argument("--replace", action="store_true", help="kill a deployment left in runtime.namespace")
    args = parser.parse_args(argv)
    out = args.out.absolute()  # before joining: a job's working directory is replaced then
    try:
        cfg = load_config(args.config)
        summary = run(cfg, args, out)
    except user_errors() as exc:
        print(f"grpo_tool_agent: {exc}", file=sys.stderr)
        return 2
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["checks"]))
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
