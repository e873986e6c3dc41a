"""`dualpath demo --json`: the Ray demo as a user runs it, with its JSON contract, and its outputs
checked against a recompute (not only its own verdict that the modes agree)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import recompute_outputs

pytestmark = pytest.mark.integration
BIN = Path(sys.executable).parent


def test_demo_json_reports_both_modes_with_real_measurements():
    env = dict(os.environ, RAY_AUTH_MODE="disabled", RAY_USAGE_STATS_ENABLED="0")
    out = subprocess.run([str(BIN / "dualpath"), "demo", "--json", "--agents", "3", "--turns", "3"],
                         capture_output=True, text=True, timeout=600, env=env)
    assert out.returncode == 0, f"the demo runs and its modes agree:\n{out.stderr[-3000:]}"
    report = json.loads(out.stdout[out.stdout.index("{"):])
    assert set(report["modes"]) == {"basic", "dualpath"}, "both modes are reported"
    assert report["outputs_match"] is True, "basic and dualpath serve the same tokens"
    from dualpath_ray.demos.demo import demo_config, demo_trajectories

    cfg = demo_config()
    expected = {t: [list(o) for o in outs] for t, outs in recompute_outputs(
        cfg, demo_trajectories(3, 3, first=1536, vocab=cfg.model.vocab_size)).items()}
    for mode, outputs in report["outputs"].items():
        assert outputs == expected, f"{mode}: every turn's tokens equal a single-process recompute with the demo's weights"
    for mode, r in report["modes"].items():
        assert r["jct_s"] > 0, f"{mode}: a measured JCT"
        assert set(r["snic_read_bytes"]) == {"p0", "d0"}, f"{mode}: bytes read per node"
        assert set(r["requests_by_path"]) == {"pe", "de"}, f"{mode}: requests per policy path name"
    assert report["modes"]["basic"]["snic_read_bytes"]["d0"] == 0, "basic reads only through the prefill node"
    hit_requests = sum(report["modes"]["dualpath"]["requests_by_path"].values())
    assert hit_requests == sum(report["modes"]["basic"]["requests_by_path"].values()) > 0, (
        "the same turns hit the store in both modes"
    )
