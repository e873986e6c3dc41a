"""`dualpath bench --plot FILE.png`: JCT per mode against its bounds, and SNIC traffic per node
over time. Needs matplotlib (the `bench` extra); `require_matplotlib` says so before any run."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from dualpath_ray.analysis.snic_window import SnicSeries, effective_span_s, span_rates
from dualpath_ray.bench.report import BenchReport, ModeRun


class PlotUnavailableError(RuntimeError):
    """--plot was asked for where matplotlib is not installed."""


def require_matplotlib() -> None:
    if importlib.util.find_spec("matplotlib") is None:
        raise PlotUnavailableError(
            "--plot needs matplotlib, which is not installed; install the bench extra "
            "(pip install -e '.[bench]') or drop --plot"
        )


def median_run(report: BenchReport, mode: str) -> ModeRun:
    """The mode's run whose JCT is the median of its rounds (the lower one of two middles)."""
    runs = sorted((r for r in report.runs if r.mode == mode), key=lambda r: r.jct_s)
    return runs[(len(runs) - 1) // 2]


def node_rates(series: SnicSeries, node: str, span_s: float) -> tuple[list[float], list[float]]:
    """(times, MB/s) of one node's SNIC reads, each rate over a span_s stretch, stamped at its middle."""
    rates = span_rates(series.t_s, series.read_bytes[node], span_s)
    times = [(series.t_s[i] + series.t_s[j]) / 2 for i, j, _ in rates]
    return times, [rate / 1e6 for _, _, rate in rates]


def plot_report(report: BenchReport, path: Path) -> Path:
    """Write the two-panel figure as PNG; returns the path."""
    import matplotlib

    matplotlib.use("Agg")  # files only: no display is needed or wanted
    import matplotlib.pyplot as plt

    modes = list(report.modes)
    fig, axes = plt.subplots(1 + len(modes), 1, figsize=(9, 3.2 * (1 + len(modes))), squeeze=False)
    _plot_jct(axes[0][0], report, modes)
    for row, mode in enumerate(modes, start=1):
        _plot_traffic(axes[row][0], report, mode)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, format="png", dpi=110)
    plt.close(fig)
    return path


def _plot_jct(ax: object, report: BenchReport, modes: list[str]) -> None:
    xs = range(len(modes))
    ax.bar(xs, [report.modes[m].jct_s for m in modes], color="#9bb7d4", label="JCT (median)")
    for x, mode in zip(xs, modes):
        rounds = report.modes[mode].jct_rounds_s
        ax.scatter([x] * len(rounds), rounds, color="black", s=12, zorder=3, label="JCT per round" if x == 0 else None)
        bounds = report.bounds[mode]
        ax.hlines(bounds.io_s, x - 0.4, x + 0.4, colors="#c0392b", linestyles="--",
                  label="I/O bound" if x == 0 else None)
        if bounds.compute_s is not None:
            ax.hlines(bounds.compute_s, x - 0.4, x + 0.4, colors="#27ae60", linestyles=":",
                      label="compute bound (Oracle JCT)" if x == 0 else None)
    ax.set_xticks(list(xs), modes)
    ax.set_ylabel("timed JCT (s)")
    title = "JCT per mode against its bounds"
    if report.speedup is not None:
        title += f" (Basic / DualPath = {report.speedup:.2f}x)"
    ax.set_title(title)
    ax.legend(fontsize=8)


def _plot_traffic(ax: object, report: BenchReport, mode: str) -> None:
    run = median_run(report, mode)
    span = effective_span_s(run.series.t_s)
    for node in run.series.read_bytes:
        times, rates = node_rates(run.series, node, span) if span > 0 else ([], [])
        ax.plot(times, rates, label=f"{node} SNIC read")
    if run.high_load_window_s is not None:
        ax.axvspan(*run.high_load_window_s, color="#f1c40f", alpha=0.15, label="high-load window")
    balance = "-" if run.snic_balance is None else f"{run.snic_balance:.2f}"
    ax.set_title(f"{mode}: SNIC read traffic per node (round {run.round}, balance {balance})")
    ax.set_xlabel("seconds into the timed phase")
    ax.set_ylabel(f"MB/s over {span:.2g} s")
    ax.legend(fontsize=8, loc="upper right")
