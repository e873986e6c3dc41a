"""Ray job: two RL rollout steps with a weight update from a "trainer" between them.

    ray job submit --working-dir . -- python jobs/rl_example.py \
        --config cluster_configs/local-1p1d.yaml --summary results/rl_example.json

Step 1 rolls out a batch of multi-turn trajectories with weight version 0. The trainer (this
driver; it trains nothing) then changes the policy and syncs it the way verl and OpenRLHF do:
it becomes rank 0 of a torch.distributed broadcast group every engine joins and broadcasts the
state dict (`DualPathCluster.attach_weight_sender` / `update_weights_from_group`), which makes it
weight version 1 and moves the KV namespace. Step 2 rolls out the same trajectories.

Checked, and written to the summary (exit code 1 when a check fails):
- step 2's outputs equal a single-process greedy recompute with the new weights, and differ
  from step 1's;
- step 2's first turns, whose prompts step 1 stored under version 0, hit nothing: no block of
  the old version is served; its later turns hit the blocks step 2 itself stored (version 1).
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

# Run as a script from a job's working directory: import the package shipped beside it.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402

from dualpath_ray.cli import user_errors  # noqa: E402
from dualpath_ray.config import DualPathConfig, load_config  # noqa: E402
from dualpath_ray.workload.trace import Trajectory, Turn  # noqa: E402


def batch(cfg: DualPathConfig, count: int, turns: int, first: int, appended: int, gen: int, seed: int) -> list[Trajectory]:
    """The step's prompts: `count` agents, each turn appending a tool observation."""
    rng = np.random.default_rng(seed)
    vocab = cfg.model.vocab_size
    return [
        Trajectory(f"agent{a}", tuple(
            Turn(tuple(int(x) for x in rng.integers(0, vocab, first if k == 0 else appended)), gen) for k in range(turns)
        ))
        for a in range(count)
    ]


def recompute(cfg: DualPathConfig, state: dict[str, Any], trajectories: list[Trajectory]) -> dict[str, list[list[int]]]:
    """Greedy outputs of every turn from scratch in this process, with the given weights."""
    from dualpath_ray.model.llama import DecoderModel

    model = DecoderModel(cfg.model)
    model.load_weights(state)
    outputs: dict[str, list[list[int]]] = {}
    for trajectory in trajectories:
        context: list[int] = []
        outputs[trajectory.trajectory_id] = []
        for turn in trajectory.turns:
            context += list(turn.appended)
            generated = [int(t) for t in model.greedy_generate(context, turn.gen_len).token_ids]
            outputs[trajectory.trajectory_id].append(generated)
            context += generated
    return outputs


def step_figures(result: Any) -> dict[str, Any]:
    rows = result.table.sort_by([("trajectory_id", "ascending"), ("turn", "ascending")]).to_pylist()
    return {
        "outputs": {tid: [list(o) for o in outs] for tid, outs in result.outputs().items()},
        "hits_by_turn": [[r["hit_tokens"] for r in rows if r["turn"] == k] for k in range(max(r["turn"] for r in rows) + 1)],
        "failures": result.failures,
    }


def run(cfg: DualPathConfig, address: str, trajectories: list[Trajectory], new_seed: int, replace: bool) -> dict[str, Any]:
    from dualpath_ray.cluster import DualPathCluster
    from dualpath_ray.model.llama import DecoderModel

    cluster = DualPathCluster.connect(cfg, address)
    try:
        cluster.deploy(replace_existing=replace)
        step1 = step_figures(cluster.rollout(trajectories, progress=False))
        state = DecoderModel(cfg.model.model_copy(update={"seed": new_seed})).checkpoint_tensors()
        sender = cluster.attach_weight_sender(group_name="rl-example")
        version = cluster.update_weights_from_group(sender, 1, state)
        step2 = step_figures(cluster.rollout(trajectories, progress=False))
    finally:
        cluster.teardown()
    expected = recompute(cfg, state, trajectories)
    checks = {
        "step2_outputs_from_new_weights": step2["outputs"] == expected,
        "outputs_changed": step2["outputs"] != step1["outputs"],
        "step2_first_turns_hit_nothing_of_version_0": all(h == 0 for h in step2["hits_by_turn"][0]),
        "step1_first_turns_were_stored": all(h > 0 for h in step1["hits_by_turn"][1]),
        "step2_later_turns_hit_version_1_blocks": all(h > 0 for hs in step2["hits_by_turn"][1:] for h in hs),
        "no_failures": not step1["failures"] and not step2["failures"],
    }
    return {"weight_version": version, "step1": step1, "step2": step2, "checks": checks}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", type=Path, default=None, help="YAML config (default: embedded defaults)")
    parser.add_argument("--summary", type=Path, required=True, help="where to write the summary JSON")
    parser.add_argument("--address", default="auto", help="the Ray cluster (default: the job's)")
    parser.add_argument("--agents", type=int, default=4)
    parser.add_argument("--turns", type=int, default=2)
    parser.add_argument("--new-seed", type=int, default=1234, help="seed of the trainer's new weights")
    parser.add_argument("--replace", action="store_true", help="kill a deployment left in runtime.namespace")
    args = parser.parse_args(argv)
    summary_path = args.summary.absolute()  # before joining: a job's working directory is replaced then
    try:
        cfg = load_config(args.config)
        trajectories = batch(cfg, args.agents, args.turns, first=150, appended=40, gen=6, seed=7)
        summary = run(cfg, args.address, trajectories, args.new_seed, args.replace)
    except user_errors() as exc:
        print(f"rl_example: {exc}", file=sys.stderr)
        return 2
    summary_path.parent.mkdir(parents=True, exist_ok=True)
    summary_path.write_text(json.dumps(summary, indent=2))
    print(json.dumps(summary["checks"]))
    return 0 if all(summary["checks"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
