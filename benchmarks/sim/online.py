"""Online serving: the most agents per second (APS) each system sustains with mean TTFT <= 4 s and
mean TPOT <= 50 ms (paper: DualPath 1.96x Basic on average; 1.67x DS 27B, 2.25x DS 660B).

Agents arrive as a Poisson process at `rate` per second for `window` seconds and run their whole
trajectory (MaxLen 64K, as the offline headline; no tool latency: the simulated time is all serving). TTFT and TPOT are
averaged over the turns submitted in the second half of the window, so the ramp-up and the
drain after the last arrival are left out. The rate is found by bisection for Basic and
DualPath, and for Oracle (no I/O at all: the ceiling any read path can reach), on 2P4D with the
large MLA model and with the small one. Each probe records where its mean TTFT went
(SimResult.ttft_parts_s: waiting for decode HBM, for a prefill engine, for staging, in prefill).
The paper gives neither its online MaxLen nor whether its SLO is a mean or a percentile; the
p99s are recorded too.

    .venv/bin/python benchmarks/sim/online.py            # 900 s windows, 6 bisection steps
    .venv/bin/python benchmarks/sim/online.py --quick    # 300 s windows, 4 steps, large MLA only

Writes results/online.json and .png.
"""

from __future__ import annotations

from common import LARGE_MLA, MODES, SMALL_MLA, agents, bisect_rate, cluster, figure, parser, save, with_options

from dualpath_ray.sim.simulator import simulate

PAPER = {"average": 1.96, "ds_27b": 1.67, "ds_660b": 2.25, "slo": "TTFT <= 4 s, TPOT <= 50 ms",
         "source": "paper-digest.md: online APS"}
TTFT_SLO_S, TPOT_SLO_S = 4.0, 0.050
MAX_LEN = 65536


def serve(cfg, mode: str, rate: float, window_s: float) -> dict:
    count = max(1, int(rate * window_s))
    workload = agents(count, MAX_LEN, arrival_rate=rate)
    options = with_options(measure_from_s=window_s / 2, measure_until_s=window_s)
    result = simulate(cfg, workload, mode, options)
    ok = result.ttft_s["mean"] <= TTFT_SLO_S and result.tpot_s["mean"] <= TPOT_SLO_S and result.turns > 0
    print(f"  {mode} {rate:.3f} APS ({count} agents): TTFT mean {result.ttft_s['mean']:.2f} s p99 "
          f"{result.ttft_s['p99']:.2f} s, TPOT mean {result.tpot_s['mean'] * 1000:.1f} ms -> {'ok' if ok else 'over'}",
          flush=True)
    return {"rate": rate, "agents": count, "ok": ok, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
            "ttft_parts_s": result.ttft_parts_s, "turns_measured": result.turns, "snic_balance": result.snic_balance}


def max_rate(cfg, mode: str, low: float, high: float, steps: int, window_s: float) -> tuple[float, list[dict]]:
    """Bisection for the highest rate meeting the SLO; `low` must meet it and `high` must not."""
    trials = []
    for rate in (low, high):
        trials.append(serve(cfg, mode, rate, window_s))
    if not trials[0]["ok"]:
        return 0.0, trials
    if trials[1]["ok"]:
        return high, trials
    return bisect_rate(lambda rate: serve(cfg, mode, rate, window_s), low, high, steps, trials), trials


def main() -> None:
    args = parser(__doc__).parse_args()
    window_s, steps = (300.0, 4) if args.quick else (900.0, 6)
    models = (("ds_660b", LARGE_MLA, 0.05, 3.0),) if args.quick else (
        ("ds_660b", LARGE_MLA, 0.05, 3.0), ("small_mla", SMALL_MLA, 0.05, 12.0))
    rows = []
    for name, model, low, high in models:
        cfg = cluster(2, 4, model=model)
        found = {}
        for mode in MODES:
            print(f"{name} {mode}", flush=True)
            found[mode] = max_rate(cfg, mode, low, high, steps, window_s)
        rows.append({"model": name, **{f"{mode}_aps": found[mode][0] for mode in MODES},
                     "ratio": found["dualpath"][0] / found["basic"][0] if found["basic"][0] else None,
                     "dualpath_over_oracle": found["dualpath"][0] / found["oracle"][0] if found["oracle"][0] else None,
                     "trials": {mode: trials for mode, (_, trials) in found.items()}})
    save(args.out, "online", {"paper": PAPER, "topology": "2P4D", "max_len": MAX_LEN, "window_s": window_s, "rows": rows})
    plt, png = figure(args.out, "online")
    fig, ax = plt.subplots(figsize=(5.5, 3.4))
    width = 0.27
    for i, mode in enumerate(MODES):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r[f"{mode}_aps"] for r in rows], width, label=mode)
    for j, r in enumerate(rows):
        if r["ratio"]:
            ax.text(j, r["dualpath_aps"], f"{r['ratio']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["model"] for r in rows])
    ax.set_ylabel("agents / s under the SLO")
    ax.set_title("Online APS, 2P4D (TTFT <= 4 s, TPOT <= 50 ms)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
