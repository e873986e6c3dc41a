"""Online serving with tool time: tool-time staging (scheduler.stage_tool_time) on vs off, side by side.

The online experiment of online.py (2P4D, large MLA model, MaxLen 64K, agents arriving as a
Poisson process, SLO mean TTFT <= 4 s and mean TPOT <= 50 ms over the turns submitted in the
window's second half) with a tool call before every turn after the first (exponential, mean 2 s
and mean 10 s: SynthParams.mean_tool_latency_s), in DualPath mode with staging off and on. For
each: the most agents per second (APS) under the SLO (doubling from `--start` until a rate
fails, then bisection), the mean and p99 TTFT at that rate, and both settings' TTFT at one
common rate (the highest that staging off sustains), where the gain shows as latency, with
Oracle (no I/O at all) at that rate as the ceiling of anything a read can save.

One experiment at the common rate, with staging on, asks what limits it: `whole_buffer`,
scheduler.stage_buffer_fraction 1.0 instead of 0.5.

To keep it affordable the clock stops `DRAIN_S` after the window (SimOptions.until_s) instead of
running every trajectory to its end: only the measured turns matter, and a rate at which any
turn submitted in the measured half has not finished by then counts as over the SLO (its TTFT
is at least that long, so the mean would be hidden, not good).

    .venv/bin/python benchmarks/sim/online_staging.py            # 360 s windows, 4 bisection steps
    .venv/bin/python benchmarks/sim/online_staging.py --quick    # 120 s windows, 3 steps

Writes results/online_staging.json.
"""

from __future__ import annotations

import time
from typing import Any

from common import LARGE_MLA, agents, bisect_rate, cluster, parser, save, with_options

from dualpath_ray.sim.simulator import Simulation

TTFT_SLO_S, TPOT_SLO_S = 4.0, 0.050
MAX_LEN = 65536
DRAIN_S = 60.0
TOOL_MEANS_S = (2.0, 10.0)


def serve(tool_s: float, staging: bool, rate: float, window_s: float, mode: str = "dualpath",
          **scheduler: Any) -> dict[str, Any]:
    cfg = cluster(2, 4, model=LARGE_MLA, stage_tool_time=staging, **scheduler)
    count = max(1, int(rate * window_s))
    workload = agents(count, MAX_LEN, arrival_rate=rate, mean_tool_latency_s=tool_s)
    options = with_options(measure_from_s=window_s / 2, measure_until_s=window_s, until_s=window_s + DRAIN_S)
    started = time.process_time()
    sim = Simulation(cfg, workload, mode, options)
    result = sim.run()
    unfinished = sum(1 for r in sim.core.requests.values()
                     if r.spec is not None and window_s / 2 <= r.spec.submitted_at < window_s)
    ok = (result.ttft_s["mean"] <= TTFT_SLO_S and result.tpot_s["mean"] <= TPOT_SLO_S and result.turns > 0
          and unfinished == 0)
    label = f"staging {'on ' if staging else 'off'}" if mode == "dualpath" else mode
    print(f"  tool {tool_s:g} s, {label} {rate:.3f} APS: TTFT mean {result.ttft_s['mean']:.2f} s p99 "
          f"{result.ttft_s['p99']:.2f} s (staging part {result.ttft_parts_s['staging']:.3f} s), TPOT mean {result.tpot_s['mean'] * 1000:.1f} ms, "
          f"{result.turns} turns, {unfinished} unfinished -> {'ok' if ok else 'over'} "
          f"[{time.process_time() - started:.0f} CPU s]", flush=True)
    return {"rate": rate, "agents": count, "ok": ok, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
            "ttft_parts_s": result.ttft_parts_s, "turns_measured": result.turns, "unfinished_measured": unfinished,
            "requests_by_path": result.requests_by_path, "snic_read_bytes_by_path": result.snic_read_bytes_by_path,
            "snic_balance": result.snic_balance, "staging": result.staging}


def max_rate(tool_s: float, staging: bool, start: float, steps: int, window_s: float) -> tuple[float, list[dict]]:
    """The highest rate meeting the SLO: double from `start` until one fails, then bisect."""
    trials = [serve(tool_s, staging, start, window_s)]
    if not trials[0]["ok"]:
        return 0.0, trials
    low = high = start
    while trials[-1]["ok"] and high < 64 * start:
        low, high = high, high * 2
        trials.append(serve(tool_s, staging, high, window_s))
    if trials[-1]["ok"]:
        return high, trials
    return bisect_rate(lambda rate: serve(tool_s, staging, rate, window_s), low, high, steps, trials), trials


def at_rate(trials: list[dict], rate: float) -> dict | None:
    return next((t for t in trials if abs(t["rate"] - rate) < 1e-9), None)


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--start", type=float, default=2.0, help="first rate tried, agents per second (default 2)")
    args = p.parse_args()
    window_s, steps = (120.0, 3) if args.quick else (360.0, 4)
    rows = []
    for tool_s in TOOL_MEANS_S:
        print(f"tool latency mean {tool_s:g} s", flush=True)
        found = {label: max_rate(tool_s, label == "on", args.start, steps, window_s) for label in ("off", "on")}
        common = found["off"][0]
        same = at_rate(found["on"][1], common) or serve(tool_s, True, common, window_s)
        row: dict[str, Any] = {"mean_tool_latency_s": tool_s, "common_rate": common}
        for label, (aps, trials) in found.items():
            best = at_rate(trials, aps)
            row[label] = {"aps": aps, "ttft_s": best["ttft_s"] if best else None,
                          "ttft_parts_s": best["ttft_parts_s"] if best else None, "trials": trials}
        row["on"]["at_common_rate"] = same
        row["off"]["at_common_rate"] = at_rate(found["off"][1], common)
        row["oracle_at_common_rate"] = serve(tool_s, False, common, window_s, "oracle") if common else None
        if common:
            print("  experiment whole_buffer:", flush=True)
            row["experiments"] = {"whole_buffer": serve(tool_s, True, common, window_s, stage_buffer_fraction=1.0)}
        row["aps_gain"] = found["on"][0] / common if common else None
        rows.append(row)
        off, on = row["off"], row["on"]
        print(f"tool {tool_s:g} s: APS off {off['aps']:.3f} on {on['aps']:.3f}; at {common:.3f} APS TTFT mean/p99 "
              f"off {off['at_common_rate']['ttft_s']['mean']:.2f}/{off['at_common_rate']['ttft_s']['p99']:.2f} s, "
              f"on {same['ttft_s']['mean']:.2f}/{same['ttft_s']['p99']:.2f} s", flush=True)
    save(args.out, "online_staging", {
        "topology": "2P4D", "model_profile": LARGE_MLA.name, "max_len": MAX_LEN, "window_s": window_s,
        "drain_s": DRAIN_S, "slo": "mean TTFT <= 4 s, mean TPOT <= 50 ms", "bisection_steps": steps, "rows": rows,
    })


if __name__ == "__main__":
    main()
