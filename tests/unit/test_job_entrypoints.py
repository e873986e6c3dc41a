"""The `ray job submit` entrypoints as scripts: arguments, metadata, output (no cluster needed)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def run_script(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=REPO, capture_output=True, text=True, timeout=120, env=env)


def test_bounds_job_prints_the_range_of_the_configured_hardware():
    out = run_script("jobs/bounds.py", "--config", "cluster_configs/local-1p1d.yaml")
    assert out.returncode == 0, f"the bounds job runs as a plain script: {out.stderr}"
    report = json.loads(out.stdout)
    assert {"lower", "upper", "binding", "constraints", "ratio", "inside"} <= set(report), (
        "the job reports the range, the binding constraint and where the configured P/D lies"
    )
    assert report["ratio"] == 1.0, "local-1p1d is one prefill node per decode node"


def test_rollout_job_reads_the_trainer_run_id_from_the_job_metadata():
    sys.path.insert(0, str(REPO / "jobs"))
    try:
        import rollout
    finally:
        sys.path.pop(0)
    import os

    saved = os.environ.get("RAY_JOB_CONFIG_JSON_ENV_VAR")
    os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] = json.dumps({"metadata": {"trainer_run_id": "run-9"}})
    try:
        assert rollout.job_metadata() == {"trainer_run_id": "run-9"}, "metadata set by `ray job submit` is read back"
    finally:
        if saved is None:
            os.environ.pop("RAY_JOB_CONFIG_JSON_ENV_VAR")
        else:
            os.environ["RAY_JOB_CONFIG_JSON_ENV_VAR"] = saved
    help_text = run_script("jobs/rollout.py", "--help")
    assert help_text.returncode == 0 and "--trace" in help_text.stdout, "the rollout job documents its arguments"


def test_rollout_job_rejects_a_bad_config_naming_the_field(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  snic_gbps: -3\n")
    out = run_script("jobs/rollout.py", "--config", str(bad), "--trace", "t.parquet", "--out", str(tmp_path / "o.parquet"))
    assert out.returncode == 2 and "cluster.snic_gbps" in out.stderr, f"a bad config is a clear error: {out.stderr}"


def test_grpo_job_documents_its_arguments_and_rejects_a_bad_config(tmp_path):
    help_text = run_script("jobs/grpo_tool_agent.py", "--help")
    assert help_text.returncode == 0 and "--shape" in help_text.stdout and "--address" in help_text.stdout, (
        "the GRPO job documents its arguments (the call shape, the cluster)"
    )
    bad = tmp_path / "bad.yaml"
    bad.write_text("cluster:\n  snic_gbps: -3\n")
    out = run_script("jobs/grpo_tool_agent.py", "--config", str(bad), "--out", str(tmp_path / "out"))
    assert out.returncode == 2 and "cluster.snic_gbps" in out.stderr, f"a bad config is a clear error: {out.stderr}"
