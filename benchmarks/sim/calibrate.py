"""Calibration: the simulator's JCT per mode against the runtime's measured JCT (goal: within
+-15%), on the committed bench configs.

For each config the script (1) waits for a quiet machine (no Ray cluster here, load average
below 1.0, at most 30 min); (2) fits this machine's engine-time profile for the config's model
with `dualpath profile` (the runtime computes with the real model; the simulator needs its
times); (3) measures the runtime with `dualpath bench`'s harness (dualpath_ray.bench.run.run_bench:
an embedded Ray cluster, every mode on a fresh store, the first turn of every trajectory untimed,
JCT = wall time of the remaining turns); (4) simulates the same trajectories on the same config
with that profile, first turns untimed too, twice: with the engine-time model alone, and with
the runtime's fixed costs this machine adds to every turn, measured on the first config's Oracle
run (no I/O: what is left is compute and the control plane): a decode step takes its TPOT, the
placement RPCs its TTFT less the simulated compute, and a turn's result reaches the next turn
after what is left of its per-turn time. Those three numbers come from one mode of one config;
every other JCT (Basic and DualPath, and every mode of the second config) is a prediction.
Differences are reported per mode, and the model, never the tolerance, is what gets fixed
(benchmarks/README.md records what was found).

    .venv/bin/python benchmarks/sim/calibrate.py                  # bench-1p1d and local-1p1d, 3 modes
    .venv/bin/python benchmarks/sim/calibrate.py --quick          # bench-1p1d only
    .venv/bin/python benchmarks/sim/calibrate.py --simulate-only  # reuse the runtime figures in the JSON

Writes results/calibrate.json and .png.
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import ROOT, figure, load_average, parser, save, wait_for_quiet

from dualpath_ray.config import load_config
from dualpath_ray.model.cost import DecodeModel
from dualpath_ray.demos.demo import demo_trajectories
from dualpath_ray.sim.settings import SimOptions
from dualpath_ray.sim.simulator import simulate
from dualpath_ray.sim.workload import from_trajectories

TOLERANCE = 0.15
MODES = ("basic", "dualpath", "oracle")
# dualpath bench's default workload: 8 agents x 9 turns, a 2,048-token first prompt, then 16
# appended and 8 generated tokens per turn.
WORKLOAD = {"agents": 8, "turns": 9, "first": 2048, "appended": 16, "gen": 8}
CONFIGS = ("bench-1p1d", "local-1p1d")


def config_path(config: str):
    return ROOT / "cluster_configs" / f"{config}.yaml"


def fit_profile(config: str, out) -> str:
    path = out / f"cpu-profile-{config}.json"
    if not path.exists():
        subprocess.run([str(ROOT / ".venv/bin/dualpath"), "profile", "--config", str(config_path(config)),
                        "--out", str(path)], check=True)
    return str(path)


def measure_runtime(config: str, trajectories: list) -> dict:
    """JCT, TTFT p50 and TPOT p50 per mode, from `dualpath bench`'s harness."""
    from dualpath_ray.bench.run import BenchWorkload, run_bench

    report = run_bench(load_config(config_path(config)), BenchWorkload(trajectories, 1), MODES, 1, config_source=config,
                       progress=lambda line: print(f"  runtime {line}", flush=True))
    data = report.to_json()
    return {m: {"jct_s": data["modes"][m]["jct_s"], "ttft_p50_s": data["modes"][m]["ttft_s"]["p50"],
                "tpot_p50_s": data["modes"][m]["tpot_s"]["p50"]} for m in MODES}


def simulate_modes(config: str, trajectories: list, profile: str, options: SimOptions) -> dict:
    cfg = load_config(config_path(config)).with_overrides(emulation={"profile_path": profile})
    workload = from_trajectories(trajectories)
    results = {}
    for mode in MODES:
        result = simulate(cfg, workload, mode, options)
        print(f"  simulated {result.headline()}", flush=True)
        results[mode] = {"jct_s": result.jct_s, "ttft_p50_s": result.ttft_s["p50"], "tpot_p50_s": result.tpot_s["p50"],
                         "snic_read_bytes": result.snic_read_bytes, "requests_by_path": result.requests_by_path}
    return results


def runtime_overheads(measured_oracle: dict, simulated_oracle: dict) -> dict:
    """What the runtime adds per turn on this machine, from its Oracle run (see the docstring)."""
    turns = WORKLOAD["turns"] - 1  # timed turns per agent
    gen = WORKLOAD["gen"]
    control = max(0.0, measured_oracle["ttft_p50_s"] - simulated_oracle["ttft_p50_s"])
    per_turn = measured_oracle["jct_s"] / turns
    result = max(0.0, per_turn - measured_oracle["ttft_p50_s"] - (gen - 1) * measured_oracle["tpot_p50_s"])
    return {"decode_step_ms": 1000 * measured_oracle["tpot_p50_s"], "pull_delay_s": control / 2, "result_delay_s": result}


def options_with(overheads: dict | None) -> SimOptions:
    # Calibration models the runtime's 1P1D, whose engines pack each batch with the quota bounding
    # one layer's time: "layer", not the paper-scale figures' "forward".
    if overheads is None:
        return SimOptions(warmup_turns=1, quota_scope="layer")
    return SimOptions(warmup_turns=1, quota_scope="layer", pull_delay_s=overheads["pull_delay_s"], result_delay_s=overheads["result_delay_s"],
                      decode_model=DecodeModel(overheads["decode_step_ms"], 0.0, 0.0))


def errors(runtime: dict, simulated: dict) -> dict:
    return {m: simulated[m]["jct_s"] / runtime[m]["jct_s"] - 1 for m in MODES}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--simulate-only", action="store_true", help="reuse the runtime figures of the last results/calibrate.json")
    args = p.parse_args()
    configs = CONFIGS[:1] if args.quick else CONFIGS
    previous = json.loads((args.out / "calibrate.json").read_text()) if args.simulate_only else {}
    rows, overheads = [], None
    for config in configs:
        trajectories = demo_trajectories(WORKLOAD["agents"], WORKLOAD["turns"], WORKLOAD["first"], WORKLOAD["appended"],
                                         WORKLOAD["gen"], load_config(config_path(config)).model.vocab_size)
        if args.simulate_only:
            old = next(r for r in previous["rows"] if r["config"] == config)
            runtime, machine, profile = old["runtime"], old["machine"], old["profile"]
        else:
            machine = wait_for_quiet()
            print(f"{config}: machine {machine}", flush=True)
            profile = fit_profile(config, args.out)
            runtime = measure_runtime(config, trajectories)
            machine = {**machine, "load_1min_after": load_average()}
        model_only = simulate_modes(config, trajectories, profile, options_with(None))
        if overheads is None:
            overheads = runtime_overheads(runtime["oracle"], model_only["oracle"])
            print(f"runtime overheads of this machine (from {config}'s Oracle run): {overheads}", flush=True)
        calibrated = simulate_modes(config, trajectories, profile, options_with(overheads))
        error = errors(runtime, calibrated)
        rows.append({"config": config, "profile": profile, "machine": machine, "runtime": runtime,
                     "simulated_model_only": model_only, "relative_error_model_only": errors(runtime, model_only),
                     "simulated": calibrated, "relative_error": error,
                     "within_tolerance": {m: abs(e) <= TOLERANCE for m, e in error.items()}})
        print(f"{config}: " + ", ".join(
            f"{m} runtime {runtime[m]['jct_s']:.2f} s sim {calibrated[m]['jct_s']:.2f} s ({error[m]:+.1%})" for m in MODES),
            flush=True)
    save(args.out, "calibrate", {"tolerance": TOLERANCE, "workload": WORKLOAD, "overheads": overheads,
                                 "overheads_from": f"{configs[0]} oracle", "rows": rows})
    plt, png = figure(args.out, "calibrate")
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        width = 0.27
        for i, (label, values) in enumerate((("runtime", {m: row["runtime"][m]["jct_s"] for m in MODES}),
                                             ("sim, engine model only", {m: row["simulated_model_only"][m]["jct_s"] for m in MODES}),
                                             ("sim, with runtime overheads", {m: row["simulated"][m]["jct_s"] for m in MODES}))):
            ax.bar([j + (i - 1) * width for j in range(len(MODES))], [values[m] for m in MODES], width, label=label)
        for j, m in enumerate(MODES):
            ax.text(j + width, row["simulated"][m]["jct_s"], f"{row['relative_error'][m]:+.0%}", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_title(row["config"])
        ax.set_ylabel("JCT (s)")
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
    sys.exit(0 if all(all(r["within_tolerance"].values()) for r in rows) else 1)


if __name__ == "__main__":
    main()
