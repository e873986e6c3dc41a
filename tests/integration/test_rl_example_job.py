"""`ray job submit` of jobs/rl_example.py on a real local Ray cluster (`ray start` nodes, labelled
as `dualpath cluster up` labels them): two rollout steps with a weight update through the
trainer's broadcast group between them; step 2 serves the new weights and hits only version-1
blocks (the job checks both and writes its figures)."""

from __future__ import annotations

import json

import pytest
import yaml

from tests.helpers import ray_test_env, recompute_outputs, runtime_config
from tests.integration.test_jobs import REPO, ray_head, submit_when_ready  # noqa: F401 - ray_head is a fixture

ray_test_env()

# `ray start` nodes and a submitted job: 77 s measured on a loaded 2-core machine, with their teardown.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]


def test_rl_example_job_updates_weights_between_two_steps(ray_head, tmp_path) -> None:  # noqa: F811
    _, dashboard = ray_head
    cfg = runtime_config(transport="gloo", verify_kv=False)
    data = cfg.model_dump(mode="json")
    data["store"]["root"] = str(tmp_path / "store")
    config_path = tmp_path / "cluster.yaml"
    config_path.write_text(yaml.safe_dump(data))
    summary_path = tmp_path / "out" / "rl_example.json"
    submit = submit_when_ready([
        "ray", "job", "submit", f"--address={dashboard}", f"--working-dir={REPO}", "--submission-id=rl-example", "--",
        "python", "jobs/rl_example.py", "--config", str(config_path), "--summary", str(summary_path),
    ])
    assert submit.returncode == 0, f"the job must succeed:\n{submit.stdout[-4000:]}\n{submit.stderr[-4000:]}"
    summary = json.loads(summary_path.read_text())
    checks = summary["checks"]
    assert checks["step2_outputs_from_new_weights"], "step 2's outputs equal a recompute with the new weights"
    assert checks["outputs_changed"], "the weight update changed the outputs"
    assert checks["step1_first_turns_were_stored"], "step 1 stored its prompts (its second turns hit them)"
    assert checks["step2_first_turns_hit_nothing_of_version_0"], "step 2 hits no block of version 0"
    assert checks["step2_later_turns_hit_version_1_blocks"], "step 2 reuses the blocks it stored under version 1"
    assert summary["weight_version"] == 1, "the cluster serves weight version 1 after the update"
    # The job's own verdicts above, checked here against this process's recompute of its batch
    # (jobs/rl_example.py: 4 agents x 2 turns, seed 7; the trainer's new weights are seed 1234).
    from jobs.rl_example import batch

    trajs = batch(cfg, 4, 2, first=150, appended=40, gen=6, seed=7)
    for step, seed in (("step1", cfg.model.seed), ("step2", 1234)):
        expected = recompute_outputs(cfg.with_overrides(model={"seed": seed}), trajs)
        assert summary[step]["outputs"] == {t: [list(o) for o in outs] for t, outs in expected.items()}, (
            f"{step}'s outputs equal a single-process recompute with the weights it served (seed {seed})"
        )
