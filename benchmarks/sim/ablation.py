"""The ablation on 2P4D with the large MLA model, JCT reduction against Basic without layerwise
prefill (paper, DS 660B: + layerwise prefill 17.21%; + dual path 38.19%; + the scheduler 45.62%).

Steps: Basic with every layer's hit KV loaded before the first layer computes; + layerwise
prefill (the paper's Basic); + the DE path with the read path chosen round-robin; + the
scheduler's read-queue path choice (DualPath).

    .venv/bin/python benchmarks/sim/ablation.py            # 1024 agents, MaxLen 64K
    .venv/bin/python benchmarks/sim/ablation.py --quick    # 256 agents, MaxLen 32K

Writes results/ablation.json and .png.
"""

from __future__ import annotations

from common import agents, brief, cluster, figure, parser, run, save, with_options

PAPER = {"layerwise": 17.21, "dual_path": 38.19, "scheduler": 45.62,
         "source": "paper-digest.md: ablation (DS 660B, JCT reduction vs Basic)"}
STEPS = (
    ("basic, no layerwise", "basic", with_options(layerwise=False)),
    ("+ layerwise prefill", "basic", with_options()),
    ("+ dual path, round-robin", "dualpath", with_options(path_choice="round_robin")),
    ("+ scheduler", "dualpath", with_options()),
)


def main() -> None:
    args = parser(__doc__).parse_args()
    count, max_len = (256, 32768) if args.quick else (1024, 65536)
    workload = agents(count, max_len)
    print(f"{count} agents, MaxLen {max_len // 1024}K: {workload.turns} turns", flush=True)
    cfg = cluster(2, 4)
    rows = [{"step": name, **brief(run(cfg, workload, mode, options))} for name, mode, options in STEPS]
    base = rows[0]["jct_s"]
    for row in rows:
        row["reduction_percent"] = 100.0 * (1 - row["jct_s"] / base)
    save(args.out, "ablation", {"paper": PAPER, "agents": count, "max_len": max_len, "rows": rows})
    plt, png = figure(args.out, "ablation")
    fig, ax = plt.subplots(figsize=(7, 3.6))
    ax.bar(range(len(rows)), [r["jct_s"] for r in rows], color=["#999", "#4c72b0", "#dd8452", "#55a868"])
    for j, r in enumerate(rows):
        ax.text(j, r["jct_s"], f"-{r['reduction_percent']:.1f}%", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["step"] for r in rows], fontsize=8)
    ax.set_ylabel("JCT (simulated s)")
    ax.set_title(f"Ablation, 2P4D DS-660B profile, {count} agents, MaxLen {max_len // 1024}K")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
