"""`dualpath run` under a config's fault plan: every trajectory finishes, its written outputs are
what a single-process recompute gives (the tiny model computes for real, every assembled KV byte
verified), and the summary shows what was injected next to what the checks caught."""

from __future__ import annotations

from pathlib import Path

import pyarrow.parquet as pq
import pytest

from tests.helpers import ray_test_env, recompute_outputs, trajectories

ray_test_env()

from dualpath_ray.commands.run import run_trace  # noqa: E402
from dualpath_ray.config import parse_config  # noqa: E402
from dualpath_ray.workload.trace import write_trace  # noqa: E402

pytestmark = pytest.mark.integration


def test_a_run_under_a_fault_plan_finishes_and_reports_its_faults(tmp_path: Path) -> None:
    cfg = parse_config({
        "model": {"n_layer": 2, "max_context": 2048},
        "cluster": {"prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 1, "cpus_per_node": 1},
        "store": {"block_size": 64},
        "emulation": {"enabled": False, "compute": "model"},
        "runtime": {"transport": "gloo", "max_attempts": 6, "heartbeat_s": 0.2, "heartbeat_timeout_s": 3.0,
                    "verify_kv": True},
        "faults": {"seed": 3, "faults": [
            {"site": "store_read", "mode": "corrupt", "probability": 0.1, "min_count": 1},
            {"site": "layer_transfer", "mode": "fail", "probability": 0.05, "min_count": 1},
        ]},
    }, source="<test>")
    trajs = trajectories(count=6, turns=3)
    trace = write_trace(trajs, tmp_path / "trace.parquet")
    summary = run_trace(cfg, trace, None, tmp_path / "out.parquet", tmp_path / "summary.json", None)
    assert summary["failed_trajectories"] == [], "every trajectory finishes despite the faults"
    rows = pq.read_table(tmp_path / "out.parquet").sort_by([("trajectory_id", "ascending"), ("turn", "ascending")])
    written: dict[str, list[tuple[int, ...]]] = {}
    for row in rows.to_pylist():
        written.setdefault(row["trajectory_id"], []).append(tuple(row["output_token_ids"]))
    assert written == recompute_outputs(cfg, trajs), "the written outputs are what a single-process recompute gives"
    injected, detected = summary["faults"]["injected"], summary["faults"]["detected"]
    assert injected["store_read:corrupt"][0] >= 1 and injected["layer_transfer:fail"][0] >= 1, (
        f"both planned faults were injected: {injected}"
    )
    assert detected["corrupt_keys"] == detected["damaged_keys"] >= 1, "every damaged stored block was caught"
    assert detected["verify_mismatches"] == 0, "no assembled KV differed from the store and a recompute (verify_kv)"
    assert (tmp_path / "summary.json").read_text().count('"faults"') == 1, "the written summary carries them too"
