"""`ray job submit` as a user runs it, against a real local Ray cluster started with `ray start`
(a head plus one prefill and one decode node, labelled and with slot resources)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from tests.helpers import ray_test_env, runtime_config, trajectories

ray_test_env()

import pyarrow.parquet as pq  # noqa: E402

from dualpath_ray.workload.trace import write_trace  # noqa: E402

# `ray start` nodes and a submitted job: 120 s measured on a loaded 2-core machine, with their teardown.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]
REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def cli_env() -> dict[str, str]:
    """The user's shell: the venv first on PATH, token auth off only for this test's cluster."""
    env = dict(os.environ)
    env["PATH"] = f"{BIN}{os.pathsep}{env.get('PATH', '')}"
    env["RAY_AUTH_MODE"] = "disabled"
    env["RAY_USAGE_STATS_ENABLED"] = "0"
    env["RAY_raylet_start_wait_time_s"] = "120"
    env.pop("RAY_ADDRESS", None)
    return env


def start_node(args: list[str], log: Path) -> subprocess.Popen:
    return subprocess.Popen(
        [str(BIN / "ray"), "start", "--block", "--disable-usage-stats", "--object-store-memory=90000000", *args],
        env=cli_env(), stdout=log.open("w"), stderr=subprocess.STDOUT, start_new_session=True,
    )


@pytest.fixture(scope="module")
def ray_head(tmp_path_factory):
    logs = tmp_path_factory.mktemp("ray-nodes")
    port, dashboard = free_port(), free_port()
    nodes = [start_node(["--head", f"--port={port}", f"--dashboard-port={dashboard}", "--include-dashboard=true",
                         "--num-cpus=1", '--resources={"dualpath_head": 1}'], logs / "head.log")]
    address = f"127.0.0.1:{port}"
    try:
        wait_for_nodes(address, 1, logs)
        # One node at a time: on 2 busy cores concurrent raylet registrations can time out.
        for count, role in enumerate(("prefill", "decode"), start=2):
            nodes.append(start_node([f"--address={address}", "--num-cpus=1", "--num-gpus=2",
                                     f'--resources={{"dualpath_{role}_slot": 1}}', f"--labels=dualpath/role={role}"],
                                    logs / f"{role}.log"))
            wait_for_nodes(address, count, logs)
        yield address, f"http://127.0.0.1:{dashboard}"
    finally:
        for node in reversed(nodes):
            os.killpg(node.pid, signal.SIGTERM)
        for node in nodes:
            node.wait(timeout=60)


def wait_for_nodes(address: str, count: int, logs: Path, timeout_s: float = 120.0) -> None:
    probe = f"import ray; ray.init(address='{address}'); print(sum(n['Alive'] for n in ray.nodes()))"
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run([sys.executable, "-c", probe], env=cli_env(), capture_output=True, text=True)
        if out.returncode == 0 and out.stdout.strip().splitlines()[-1:] == [str(count)]:
            return
        time.sleep(2)
    tails = "\n".join(f"--- {log.name}\n{log.read_text()[-2000:]}" for log in sorted(logs.glob("*.log")))
    raise TimeoutError(f"{count} Ray nodes did not come up at {address}; last probe: {out.stderr[-1000:]}\n{tails}")


def test_ray_job_submit_rollout_matches_a_direct_rollout(ray_head, tmp_path):
    address, dashboard = ray_head
    cfg = runtime_config(transport="gloo", verify_kv=False)
    config_path = tmp_path / "cluster.yaml"
    job_store, direct_store = tmp_path / "job-store", tmp_path / "direct-store"
    data = cfg.model_dump(mode="json")
    data["store"]["root"] = str(job_store)
    config_path.write_text(yaml.safe_dump(data))
    trajs = trajectories(count=3, turns=3)
    trace = write_trace(trajs, tmp_path / "trace.parquet")
    out, summary = tmp_path / "out" / "results.parquet", tmp_path / "out" / "summary.json"
    command = [
        "ray", "job", "submit", f"--address={dashboard}", f"--working-dir={REPO}", "--submission-id=rollout-test",
        "--metadata-json", json.dumps({"trainer_run_id": "run-42"}), "--",
        "python", "jobs/rollout.py", "--config", str(config_path), "--trace", str(trace),
        "--out", str(out), "--summary", str(summary),
    ]
    submit = submit_when_ready(command)
    assert submit.returncode == 0, f"the job must reach SUCCEEDED:\n{submit.stdout[-4000:]}\n{submit.stderr[-4000:]}"
    from ray.job_submission import JobStatus, JobSubmissionClient

    info = JobSubmissionClient(dashboard).get_job_info("rollout-test")
    assert info.status == JobStatus.SUCCEEDED, f"the job's final state is SUCCEEDED, not {info.status}"
    assert info.metadata.get("trainer_run_id") == "run-42", "the trainer's run id is in the job metadata"
    report = json.loads(summary.read_text())
    assert report["metadata"].get("trainer_run_id") == "run-42", "the trainer's run id from the job metadata is kept"
    assert report["failed_trajectories"] == [], "no trajectory failed"
    rows = pq.read_table(out).to_pylist()
    assert {(r["trajectory_id"], r["turn"]) for r in rows} == {(t.trajectory_id, k) for t in trajs for k in range(3)}, (
        "every trajectory and turn is in the results file"
    )
    job_outputs = {(r["trajectory_id"], r["turn"]): tuple(r["output_token_ids"]) for r in rows}

    direct = subprocess.run(
        [sys.executable, "-c", DIRECT_ROLLOUT, address, str(config_path), str(trace), str(direct_store)],
        env=cli_env(), capture_output=True, text=True, timeout=600, cwd=REPO,
    )
    assert direct.returncode == 0, f"direct rollout failed:\n{direct.stderr[-4000:]}"
    direct_outputs = {tuple(k): tuple(v) for k, v in json.loads(direct.stdout.strip().splitlines()[-1])}
    assert job_outputs == direct_outputs, "the job's outputs equal a direct cluster.rollout of the same trace"

    cli_out = tmp_path / "cli" / "results.parquet"
    run = subprocess.run(
        [str(BIN / "dualpath"), "run", "--config", str(config_path), "--trace", str(trace), "--mode", "basic",
         "--out", str(cli_out), "--address", address],
        env=cli_env(), capture_output=True, text=True, timeout=600,
    )
    assert run.returncode == 0, f"`dualpath run` on the same cluster failed:\n{run.stderr[-4000:]}"
    cli_rows = pq.read_table(cli_out).to_pylist()
    assert {(r["trajectory_id"], r["turn"]): tuple(r["output_token_ids"]) for r in cli_rows} == job_outputs, (
        "`dualpath run --mode basic` serves the same tokens as the job in dualpath mode"
    )
    assert {r["path"] for r in cli_rows} == {"pe"}, "basic mode reads only through the prefill node"


def submit_when_ready(command: list[str], timeout_s: float = 120.0) -> subprocess.CompletedProcess:
    """`ray job submit`, retried while the head's job agent is still starting (nothing was
    submitted then: the server answers 'No available agent')."""
    deadline = time.monotonic() + timeout_s
    while True:
        submit = subprocess.run(command, env=cli_env(), capture_output=True, text=True, timeout=600)
        if "No available agent" not in submit.stderr or time.monotonic() > deadline:
            return submit
        time.sleep(3)


DIRECT_ROLLOUT = """
import json, sys
from dualpath_ray.config import load_config
from dualpath_ray.cluster import DualPathCluster
from dualpath_ray.workload.trace import read_trace
address, config, trace, store = sys.argv[1:]
cfg = load_config(config).with_overrides(store={"root": store})
cluster = DualPathCluster.connect(cfg, address)
cluster.deploy()
result = cluster.rollout(read_trace(trace, cfg.model.vocab_size), progress=False)
cluster.teardown()
rows = result.table.to_pylist()
print(json.dumps([[[r["trajectory_id"], r["turn"]], r["output_token_ids"]] for r in rows]))
"""
