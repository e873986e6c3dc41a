"""`dualpath bench` end to end on a tiny 1P1D config: all three modes in one round, the JSON
contract, outputs identical across modes and equal to a recompute, bytes consistent with the runtime's accounting, the
sampled SNIC series consistent with the counters, and the plot a PNG."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import ray_test_env, recompute_outputs, runtime_config

ray_test_env()

from dualpath_ray.cli import main  # noqa: E402
from dualpath_ray.kv.layout import KVLayout  # noqa: E402

pytestmark = pytest.mark.integration
WORKLOAD = ["--agents", "2", "--turns", "3", "--first", "192", "--appended", "32", "--gen", "4"]


@pytest.fixture(scope="module")
def bench(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict[str, Any], Path, str]:
    folder = tmp_path_factory.mktemp("bench")
    config = folder / "tiny.yaml"
    # One engine per node: three deployments are most of the test's time, and fewer actors start faster.
    cfg = runtime_config(transport="gloo").with_overrides(cluster={"gpus_per_node": 1})
    config.write_text(yaml.safe_dump(cfg.model_dump(mode="json", exclude_defaults=True)))
    out, plot = folder / "bench.json", folder / "bench.png"
    argv = ["bench", "--config", str(config), *WORKLOAD, "--repeat", "1", "--sample-interval", "0.05",
            "--json", "--out", str(out), "--plot", str(plot)]
    assert main(argv) == 0, "the bench runs and its modes serve identical outputs"
    return json.loads(out.read_text()), plot, str(config)


def test_json_contract(bench: tuple[dict[str, Any], Path, str]) -> None:
    report, _, _ = bench
    assert set(report["modes"]) == {"basic", "dualpath", "oracle"}, "all three modes by default"
    assert set(report["bounds"]) == set(report["modes"]), "bounds for every mode"
    for mode, figures in report["modes"].items():
        assert figures["jct_s"] > 0, f"{mode}: a measured JCT"
        assert figures["turns"] == 4, f"{mode}: 2 agents x 2 timed turns (turn 1 is the untimed warm-up)"
        assert figures["ttft_s"]["p50"] > 0 and figures["ttft_s"]["p99"] >= figures["ttft_s"]["p50"], (
            f"{mode}: TTFT percentiles from the timed turns"
        )
        assert figures["tpot_s"]["p50"] > 0, f"{mode}: TPOT from turns with more than one output token"
        assert set(figures["snic_read_bytes"]) == {"p0", "d0"}, f"{mode}: SNIC bytes per node"
        assert set(report["bounds"][mode]) == {"io_s", "compute_s"}, f"{mode}: I/O and compute bound"
        assert report["bounds"][mode]["compute_s"] == report["modes"]["oracle"]["jct_s"], (
            f"{mode}: the compute bound is the Oracle JCT"
        )
    assert report["speedup"] == pytest.approx(report["modes"]["basic"]["jct_s"] / report["modes"]["dualpath"]["jct_s"]), (
        "speedup is basic JCT / dualpath JCT"
    )
    assert [(r["round"], r["mode"]) for r in report["runs"]] == [(1, "basic"), (1, "dualpath"), (1, "oracle")], (
        "one round, the modes in the given order"
    )


def test_outputs_identical_across_modes_and_equal_to_a_recompute(bench: tuple[dict[str, Any], Path, str]) -> None:
    report, _, config = bench
    from dualpath_ray.config import load_config
    from dualpath_ray.demos.demo import demo_trajectories

    assert report["outputs_match"] is True, "the same model serves the same tokens in every mode"
    cfg = load_config(config)
    agents, turns, first, appended, gen = (int(WORKLOAD[i]) for i in (1, 3, 5, 7, 9))
    trajs = demo_trajectories(agents, turns, first, appended, gen, cfg.model.vocab_size, seed=0)
    expected = {t: [list(o) for o in outs] for t, outs in recompute_outputs(cfg, trajs).items()}
    for run in report["runs"]:
        assert run["outputs"] == expected, (
            f"round {run['round']} {run['mode']}: every turn's tokens (warm-up included) equal a single-process "
            "recompute with the same weights"
        )


def test_bytes_agree_with_the_runtime_accounting(bench: tuple[dict[str, Any], Path, str]) -> None:
    report, _, config = bench
    from dualpath_ray.config import load_config

    cfg = load_config(config)
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    runs = {r["mode"]: r for r in report["runs"]}
    hit_bytes = runs["basic"]["hit_bytes"]
    assert hit_bytes > 0 and hit_bytes % layout.full_block_bytes == 0, "timed turns hit whole stored blocks"
    for mode in ("basic", "dualpath"):
        run = runs[mode]
        assert run["hit_bytes"] == hit_bytes, f"{mode}: the same turns hit the same blocks"
        assert sum(run["snic_read_bytes"].values()) == hit_bytes, (
            f"{mode}: every hit byte crossed a SNIC exactly once (counter deltas = hit tokens x bytes per token)"
        )
        assert sum(run["snic_read_bytes_by_path"].values()) == hit_bytes, f"{mode}: the per-path split adds up"
        series = run["snic_series"]["read_bytes"]
        for node, values in series.items():
            assert values == sorted(values), f"{mode}/{node}: the sampled counter never decreases"
            assert values[-1] - values[0] == run["snic_read_bytes"][node], (
                f"{mode}/{node}: the sampled series spans exactly the timed phase's counter delta"
            )
    assert runs["basic"]["snic_read_bytes"]["d0"] == 0, "basic reads only through the prefill node"
    assert runs["basic"]["requests_by_path"]["de"] == 0, "basic never uses the DE path"
    assert sum(runs["dualpath"]["requests_by_path"].values()) == sum(runs["basic"]["requests_by_path"].values()) == 4, (
        "the same timed turns hit the store in both modes"
    )
    assert report["bounds"]["basic"]["io_s"] == pytest.approx(2 * report["bounds"]["dualpath"]["io_s"]), (
        "1P1D: basic reads through one SNIC of two"
    )
    oracle = runs["oracle"]
    assert sum(oracle["snic_read_bytes"].values()) == 0 and report["bounds"]["oracle"]["io_s"] == 0, (
        "oracle reads nothing through any SNIC"
    )
    assert oracle["snic_balance"] is None, "no traffic, no balance"
    assert runs["basic"]["snic_balance"] == pytest.approx(2.0), "basic's idle decode SNIC makes max / mean 2"


def test_attention_balance_from_the_prefill_engines_compute(bench: tuple[dict[str, Any], Path, str]) -> None:
    report, _, _ = bench
    for run in report["runs"]:
        mode, series = run["mode"], run["compute_series"]
        assert list(series["compute_s"]) == ["prefill/p0/g0"], f"{mode}: the one prefill engine's compute is sampled"
        values = series["compute_s"]["prefill/p0/g0"]
        assert values == sorted(values) and values[-1] > values[0], f"{mode}: cumulative, and it computed while timed"
        assert run["attention_span"] == ("timed phase" if mode == "oracle" else "high-load window"), (
            f"{mode}: summed over the SNIC high-load window where there is one, else the timed phase"
        )
        assert run["attention_balance"] == pytest.approx(1.0), f"{mode}: one prefill engine is balanced with itself"


def test_plot_is_a_png(bench: tuple[dict[str, Any], Path, str]) -> None:
    _, plot, _ = bench
    data = plot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000, "the plot file is a non-trivial PNG"
