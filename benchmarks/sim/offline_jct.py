"""Offline JCT of Basic / DualPath / Oracle on 2P4D with the large MLA model (paper: up to 1.87x
over Basic at 1024 agents and 64K MaxLen; DualPath close to Oracle).

    .venv/bin/python benchmarks/sim/offline_jct.py            # 256/512/1024 agents x 16K/32K/64K
    .venv/bin/python benchmarks/sim/offline_jct.py --quick    # 256 agents x 16K/64K

Writes results/offline_jct.json and .png: JCT per mode, Basic/DualPath and DualPath/Oracle.
"""

from __future__ import annotations

from common import MODES, agents, brief, cluster, figure, parser, run, save

PAPER = {"speedup_1024_64k": 1.87, "source": "paper-digest.md: offline JCT up to 1.87x better than Basic (DS 660B, 2P4D, 1024 agents, 64K MaxLen)"}


def main() -> None:
    args = parser(__doc__).parse_args()
    agent_counts = (256,) if args.quick else (256, 512, 1024)
    max_lens = (16384, 65536) if args.quick else (16384, 32768, 65536)
    cfg = cluster(2, 4)
    rows = []
    for max_len in max_lens:
        for count in agent_counts:
            workload = agents(count, max_len)
            print(f"{count} agents, MaxLen {max_len // 1024}K: {workload.turns} turns", flush=True)
            runs = {mode: brief(run(cfg, workload, mode)) for mode in MODES}
            rows.append({
                "agents": count, "max_len": max_len, "turns": workload.turns, "runs": runs,
                "basic_over_dualpath": runs["basic"]["jct_s"] / runs["dualpath"]["jct_s"],
                "dualpath_over_oracle": runs["dualpath"]["jct_s"] / runs["oracle"]["jct_s"],
            })
    save(args.out, "offline_jct", {"paper": PAPER, "cluster": "2P4D, H100-class nodes, DeepSeek-V3.2 660B profile",
                                   "rows": rows})
    plt, png = figure(args.out, "offline_jct")
    fig, axes = plt.subplots(1, len(max_lens), figsize=(4.5 * len(max_lens), 3.6), squeeze=False)
    for ax, max_len in zip(axes[0], max_lens):
        subset = [r for r in rows if r["max_len"] == max_len]
        width = 0.27
        for i, mode in enumerate(MODES):
            ax.bar([j + (i - 1) * width for j in range(len(subset))], [r["runs"][mode]["jct_s"] for r in subset],
                   width, label=mode)
        for j, r in enumerate(subset):
            ax.text(j, r["runs"]["basic"]["jct_s"], f"{r['basic_over_dualpath']:.2f}x", ha="center", va="bottom", fontsize=8)
        ax.set_xticks(range(len(subset)), [str(r["agents"]) for r in subset])
        ax.set_xlabel("agents")
        ax.set_title(f"MaxLen {max_len // 1024}K")
    axes[0][0].set_ylabel("JCT (simulated s)")
    axes[0][0].legend()
    fig.suptitle("2P4D, DeepSeek-V3.2 660B: offline JCT (label: Basic / DualPath)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
