"""Calibration: the simulator's JCT per mode against the runtime's measured JCT (goal: within
+-15%), on the committed bench configs.

For each config the script (1) waits for a quiet machine (no Ray cluster here, load average
below 1.0, at most 30 min); (2) fits this machine's engine-time profile for the config's model
with `dualpath profile` (the runtime computes with the real model; the simulator needs its
times); (3) measures the runtime with `dualpath bench`'s harness (dualpath_ray.bench.run_bench:
an embedded Ray cluster, every mode on a fresh store, the first turn of every trajectory untimed,
JCT = wall time of the remaining turns); (4) simulates the same trajectories on the same config
with that profile, first turns untimed too. Differences are reported per mode, and the model,
never the tolerance, is what gets fixed (benchmarks/README.md records what was found).

    .venv/bin/python benchmarks/sim/calibrate.py                  # bench-1p1d and local-1p1d, 3 modes
    .venv/bin/python benchmarks/sim/calibrate.py --quick          # bench-1p1d only
    .venv/bin/python benchmarks/sim/calibrate.py --simulate-only  # reuse the runtime figures in the JSON

Writes results/calibrate.json and .png.
"""

from __future__ import annotations

import json
import subprocess
import sys

from common import OUT, ROOT, figure, load_average, parser, save, wait_for_quiet

from dualpath_ray.config import load_config
from dualpath_ray.demo import demo_trajectories
from dualpath_ray.sim.settings import SimOptions
from dualpath_ray.sim.simulator import simulate
from dualpath_ray.sim.workload import from_trajectories

TOLERANCE = 0.15
MODES = ("basic", "dualpath", "oracle")
# dualpath bench's default workload: 8 agents x 9 turns, a 2,048-token first prompt, then 16
# appended and 8 generated tokens per turn.
WORKLOAD = {"agents": 8, "turns": 9, "first": 2048, "appended": 16, "gen": 8}
CONFIGS = ("bench-1p1d", "local-1p1d")


def fit_profile(config: str) -> str:
    path = OUT / f"cpu-profile-{config}.json"
    if not path.exists():
        subprocess.run([str(ROOT / ".venv/bin/dualpath"), "profile", "--config", str(ROOT / "cluster_configs" / f"{config}.yaml"),
                        "--out", str(path)], check=True)
    return str(path)


def measure_runtime(config: str, trajectories: list) -> dict:
    from dualpath_ray.bench import BenchWorkload, run_bench

    cfg = load_config(ROOT / "cluster_configs" / f"{config}.yaml")
    report = run_bench(cfg, BenchWorkload(trajectories, 1), MODES, 1, config_source=config,
                       progress=lambda line: print(f"  runtime {line}", flush=True))
    data = report.to_json()
    return {"modes": {m: data["modes"][m] for m in MODES}, "machine": data.get("machine")}


def simulate_modes(config: str, trajectories: list, profile: str) -> dict:
    cfg = load_config(ROOT / "cluster_configs" / f"{config}.yaml").with_overrides(emulation={"profile_path": profile})
    workload = from_trajectories(trajectories)
    results = {}
    for mode in MODES:
        result = simulate(cfg, workload, mode, SimOptions(warmup_turns=1))
        print(f"  simulated {result.headline()}", flush=True)
        results[mode] = {"jct_s": result.jct_s, "ttft_s": result.ttft_s, "tpot_s": result.tpot_s,
                         "snic_read_bytes": result.snic_read_bytes, "requests_by_path": result.requests_by_path}
    return results


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--simulate-only", action="store_true", help="reuse the runtime figures of the last results/calibrate.json")
    args = p.parse_args()
    configs = CONFIGS[:1] if args.quick else CONFIGS
    previous = json.loads((args.out / "calibrate.json").read_text()) if args.simulate_only else {}
    rows = []
    for config in configs:
        cfg = load_config(ROOT / "cluster_configs" / f"{config}.yaml")
        trajectories = demo_trajectories(WORKLOAD["agents"], WORKLOAD["turns"], WORKLOAD["first"], WORKLOAD["appended"],
                                         WORKLOAD["gen"], cfg.model.vocab_size)
        if args.simulate_only:
            old = next(r for r in previous["rows"] if r["config"] == config)
            runtime, machine, profile = old["runtime"], old["machine"], old["profile"]
        else:
            machine = wait_for_quiet()
            print(f"{config}: machine {machine}", flush=True)
            profile = fit_profile(config)
            measured = measure_runtime(config, trajectories)
            runtime = {m: measured["modes"][m]["jct_s"] for m in MODES}
            machine = {**machine, "bench": measured["machine"], "load_1min_after": load_average()}
        simulated = simulate_modes(config, trajectories, profile)
        errors = {m: simulated[m]["jct_s"] / runtime[m] - 1 for m in MODES}
        rows.append({"config": config, "profile": profile, "machine": machine, "runtime": runtime,
                     "simulated": simulated, "relative_error": errors,
                     "within_tolerance": {m: abs(e) <= TOLERANCE for m, e in errors.items()}})
        print(f"{config}: " + ", ".join(f"{m} runtime {runtime[m]:.2f} s sim {simulated[m]['jct_s']:.2f} s ({errors[m]:+.1%})"
                                        for m in MODES), flush=True)
    save(args.out, "calibrate", {"tolerance": TOLERANCE, "workload": WORKLOAD, "rows": rows})
    plt, png = figure(args.out, "calibrate")
    fig, axes = plt.subplots(1, len(rows), figsize=(5 * len(rows), 3.4), squeeze=False)
    for ax, row in zip(axes[0], rows):
        width = 0.35
        ax.bar([j - width / 2 for j in range(len(MODES))], [row["runtime"][m] for m in MODES], width, label="runtime")
        ax.bar([j + width / 2 for j in range(len(MODES))], [row["simulated"][m]["jct_s"] for m in MODES], width, label="simulator")
        for j, m in enumerate(MODES):
            ax.text(j, max(row["runtime"][m], row["simulated"][m]["jct_s"]), f"{row['relative_error'][m]:+.0%}",
                    ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(MODES)), MODES)
        ax.set_title(row["config"])
        ax.set_ylabel("JCT (s)")
    axes[0][0].legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")
    sys.exit(0 if all(all(r["within_tolerance"].values()) for r in rows) else 1)


if __name__ == "__main__":
    main()
