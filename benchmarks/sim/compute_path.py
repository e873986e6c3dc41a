"""Beyond the paper: the compute path (scheduler.compute_path: auto) against reading every hit
(DualPath as the paper has it), reading none (all: every prompt computed whole) and Basic, over
the storage NICs' bandwidth (the paper's x 1/8 .. x 2 of the H100-class node's SNIC) and two
model sizes, on two workload seeds.

    .venv/bin/python benchmarks/sim/compute_path.py            # small MLA 1P1D, large MLA 2P4D; 256 agents, MaxLen 32K
    .venv/bin/python benchmarks/sim/compute_path.py --quick    # 96 agents, MaxLen 16K

Reports each point's JCT and the acceptance ratio auto / min(dualpath, all) (<= 1.02: never
worse than the better of reading everything and reading nothing), and the share of hit tokens
auto recomputed. Writes results/compute_path.json and .png.
"""

from __future__ import annotations

from common import LARGE_MLA, SMALL_MLA, brief, cluster, figure, parser, run, save

from dualpath_ray.sim.workload import from_synth
from dualpath_ray.workload.synth import SynthParams

SNIC_SCALES = (1 / 32, 1 / 16, 0.125, 0.25, 0.5, 1.0, 2.0)  # the paper sweeps x 1/8 .. 2; below it the SNIC is the wall
RUNS = (("basic", "basic", "off"), ("dualpath", "dualpath", "off"), ("dualpath+compute", "dualpath", "auto"),
        ("all-recompute", "dualpath", "all"))


def main() -> None:
    args = parser(__doc__).parse_args()
    count, max_len = (96, 16384) if args.quick else (256, 32768)
    rows = []
    # The large model's weights need four decode nodes' GPUs (as the paper's 2P4D).
    for model_name, model, prefill, decode in (("small MLA", SMALL_MLA, 1, 1), ("large MLA", LARGE_MLA, 2, 4)):
        for seed in (0, 1):
            workload = from_synth(SynthParams(agents=count, max_len=max_len, seed=seed))
            for scale in SNIC_SCALES:
                print(f"{model_name}, seed {seed}, SNIC x{scale}", flush=True)
                runs = {}
                for label, mode, compute_path in RUNS:
                    cfg = cluster(prefill, decode, model=model, compute_path=compute_path)
                    cfg = cfg.with_overrides(cluster={"snic_gbps": cfg.cluster.snic_gbps * scale})
                    result = run(cfg, workload, mode)
                    runs[label] = {**brief(result), "recomputed_hit_tokens": result.recomputed_hit_tokens}
                best = min(runs["dualpath"]["jct_s"], runs["all-recompute"]["jct_s"])
                hit_tokens = runs["dualpath"]["hit_rate"]
                rows.append({
                    "model": model_name, "nodes": f"{prefill}P{decode}D", "seed": seed, "snic_scale": scale, "runs": runs,
                    "auto_over_best": runs["dualpath+compute"]["jct_s"] / best,
                    "auto_over_dualpath": runs["dualpath+compute"]["jct_s"] / runs["dualpath"]["jct_s"],
                    "dualpath_hit_rate": hit_tokens,
                })
                print(f"  auto / min(dualpath, all) = {rows[-1]['auto_over_best']:.3f}", flush=True)
    worst = max(r["auto_over_best"] for r in rows)
    save(args.out, "compute_path", {"agents": count, "max_len": max_len, "rows": rows, "worst_auto_over_best": worst})
    print(f"worst auto / min(dualpath, all-recompute): {worst:.3f} (goal <= 1.02)")
    plot(args.out, rows)


def plot(out, rows) -> None:  # type: ignore[no-untyped-def]
    plt, png = figure(out, "compute_path")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.6), sharey=False)
    for ax, model_name in zip(axes, ("small MLA", "large MLA")):
        for label, _, _ in RUNS:
            points = [(r["snic_scale"], r["runs"][label]["jct_s"]) for r in rows if r["model"] == model_name and r["seed"] == 0]
            ax.plot([p[0] for p in points], [p[1] for p in points], marker="o", label=label)
        ax.set_xscale("log", base=2)
        ax.set_xlabel("SNIC bandwidth (x the H100 node's)")
        ax.set_ylabel("JCT (simulated s)")
        ax.set_title(f"{model_name} (seed 0)")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
