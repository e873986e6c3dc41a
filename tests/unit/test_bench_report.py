"""`dualpath bench`'s report from measured runs: medians over rounds, bounds, speedup, JSON keys,
text and the plot (no Ray: runs are built by hand)."""

from __future__ import annotations

from pathlib import Path

import pytest

from dualpath_ray.analysis.snic_window import SnicSeries
from dualpath_ray.bench.compute_balance import ComputeSeries, attention_balance
from dualpath_ray.bench.figures import Percentiles
from dualpath_ray.bench.plot import median_run, plot_report
from dualpath_ray.bench.report import BenchReport, ModeRun, Topology, format_text, summarise

SNIC_BYTES_S = 2e6
HIT_BYTES = 40_000_000


def mode_run(round_index: int, mode: str, jct_s: float) -> ModeRun:
    share = {"basic": (1.0, 0.0), "dualpath": (0.5, 0.5), "oracle": (0.0, 0.0)}[mode]
    t = [0.25 * i for i in range(int(jct_s * 4) + 1)]
    read = {node: [int(HIT_BYTES * f * s / t[-1]) for s in t] for node, f in zip(("p0", "d0"), share)}
    totals = {node: values[-1] for node, values in read.items()}
    return ModeRun(
        round=round_index, mode=mode, jct_s=jct_s, turns=64, hit_bytes=HIT_BYTES,
        ttft_s=Percentiles(0.1 * jct_s, 0.2 * jct_s), tpot_s=Percentiles(0.01, 0.02),
        snic_read_bytes=totals, snic_read_bytes_by_path={"pe": totals["p0"], "de": totals["d0"]},
        snic_write_bytes={"p0": 0, "d0": 1000},
        store_read_gbps={node: (0.5 + round_index if v else None) for node, v in totals.items()},
        requests_by_path={"pe": 64, "de": 0},
        snic_balance=None if mode == "oracle" else 2.0 / (1 + share[1] / share[0]),
        high_load_window_s=None if mode == "oracle" else (0.0, t[-1]), series=SnicSeries(t, read),
        **attention(round_index, t),
    )


def attention(round_index: int, t: list[float]) -> dict[str, object]:
    """Two prefill engines; the second computes at 0.6, 0.8, 1.0 of the first's rate in rounds 1-3."""
    rate = {1: 0.6, 2: 0.8, 3: 1.0}[round_index]
    series = ComputeSeries(t, {"prefill/p0/g0": [0.5 * s for s in t], "prefill/p0/g1": [0.5 * rate * s for s in t]})
    figure = attention_balance(series, None)
    return {"attention_balance": figure.balance, "prefill_compute_s": figure.engine_compute_s,
            "attention_span": figure.over, "compute_series": series}


def report() -> BenchReport:
    jcts = {"basic": (40.0, 42.0, 41.0), "dualpath": (21.0, 20.0, 22.0), "oracle": (3.0, 2.0, 4.0)}
    runs = [mode_run(r + 1, mode, jcts[mode][r]) for r in range(3) for mode in ("basic", "dualpath", "oracle")]
    raw = BenchReport(config="c.yaml", workload="w", timed="t", transport="gloo", repeat=3, runs=runs, outputs_match=True)
    return summarise(raw, Topology(prefill_nodes=1, decode_nodes=1, snic_bytes_s=SNIC_BYTES_S))


def test_medians_bounds_and_speedup() -> None:
    r = report()
    assert r.modes["basic"].jct_s == 41.0 and r.modes["dualpath"].jct_s == 21.0, "JCT is the median over rounds"
    assert r.speedup == pytest.approx(41.0 / 21.0), "speedup is median basic JCT / median dualpath JCT"
    assert r.bounds["basic"].io_s == pytest.approx(20.0), "basic: 40 MB through one 2 MB/s SNIC"
    assert r.bounds["dualpath"].io_s == pytest.approx(10.0), "dualpath: 40 MB through two"
    assert r.bounds["oracle"].io_s == 0.0, "oracle does no I/O"
    assert all(b.compute_s == 3.0 for b in r.bounds.values()), "the compute bound is the median Oracle JCT"
    assert r.modes["dualpath"].jct_over_io_bound == pytest.approx(2.1), "JCT over the mode's own I/O bound"
    assert r.modes["oracle"].jct_over_io_bound is None, "no ratio to a zero bound"
    assert r.modes["basic"].ttft_s.p50 == pytest.approx(4.1), "each percentile is the median of the rounds' values"
    assert [run.attention_balance for run in r.runs[::3]] == pytest.approx([1 / 0.8, 1 / 0.9, 1.0]), (
        "each round's attention balance is max / mean of its engines' compute seconds"
    )
    assert r.modes["basic"].attention_balance == pytest.approx(1 / 0.9), "the attention balance is the median round's"


def test_json_keys_are_the_documented_contract() -> None:
    data = report().to_json()
    assert {"modes", "bounds", "speedup", "runs", "outputs_match", "machine"} <= set(data), "top-level keys"
    assert set(data["modes"]) == {"basic", "dualpath", "oracle"}, "every mode run is summarised"
    for mode, figures in data["modes"].items():
        assert {"jct_s", "ttft_s", "tpot_s", "snic_read_bytes", "snic_balance", "attention_balance",
                "requests_by_path"} <= set(figures), (
            f"{mode}: the per-mode figures"
        )
        assert set(figures["ttft_s"]) == {"p50", "p99"}, f"{mode}: TTFT p50 and p99"
        assert set(data["bounds"][mode]) == {"io_s", "compute_s"}, f"{mode}: both bounds"
    assert [(r["round"], r["mode"]) for r in data["runs"][:3]] == [(1, "basic"), (1, "dualpath"), (1, "oracle")], (
        "each round's runs are kept, in run order"
    )
    assert set(data["runs"][0]["snic_series"]) == {"t_s", "read_bytes"}, "each run keeps its sampled SNIC series"
    first = data["runs"][0]
    assert set(first["compute_series"]) == {"t_s", "compute_s"}, "each run keeps its sampled compute series"
    assert set(first["prefill_compute_s"]) == {"prefill/p0/g0", "prefill/p0/g1"}, "the seconds the balance compares"
    assert first["attention_span"] == "timed phase", "which span the compute seconds were summed over"


def test_text_names_every_mode_and_the_ratios() -> None:
    text = format_text(report())
    for needle in ("basic: JCT", "dualpath: JCT", "oracle: JCT", "Basic JCT / DualPath JCT = 1.95x",
                   "DualPath JCT / its I/O bound = 2.100", "attention balance 1.111",
                   "attention balance: max / mean over the prefill engines"):
        assert needle in text, f"the text report shows {needle!r}"


def test_plot_is_a_png_of_the_median_runs(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    r = report()
    assert median_run(r, "basic").jct_s == 41.0, "the traffic panel shows the median round's run"
    path = plot_report(r, tmp_path / "sub" / "bench.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", "the plot file is a PNG"


def test_store_read_rate_is_the_median_over_rounds_that_read() -> None:
    r = report()
    assert r.modes["dualpath"].store_read_gbps == {"p0": 2.5, "d0": 2.5}, "median of 1.5, 2.5, 3.5 per node"
    assert r.modes["basic"].store_read_gbps == {"p0": 2.5, "d0": None}, "a node that never read has no rate"
    assert r.modes["oracle"].store_read_gbps == {"p0": None, "d0": None}, "oracle reads nothing"
