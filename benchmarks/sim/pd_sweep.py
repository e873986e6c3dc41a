"""The P/D ratio sweep with the small MLA model: 1P1D, 2P1D and 1P2D, Basic vs DualPath (paper,
DS 27B: 1.64x on average over the three, at most 2.46x; DualPath on 1P1D about as fast as Basic
on 2P1D).

    .venv/bin/python benchmarks/sim/pd_sweep.py            # 512 agents, MaxLen 64K
    .venv/bin/python benchmarks/sim/pd_sweep.py --quick    # 128 agents, MaxLen 32K

Writes results/pd_sweep.json and .png.
"""

from __future__ import annotations

from common import SMALL_MLA, agents, brief, cluster, figure, parser, run, save

PAPER = {"average_speedup": 1.64, "max_speedup": 2.46,
         "source": "paper-digest.md: DS 27B 1.64x average over 1P1D/2P1D/1P2D, max 2.46x; DualPath 1P1D ~ Basic 2P1D"}
TOPOLOGIES = ((1, 1), (2, 1), (1, 2))


def main() -> None:
    args = parser(__doc__).parse_args()
    count, max_len = (128, 32768) if args.quick else (512, 65536)
    workload = agents(count, max_len)
    print(f"{count} agents, MaxLen {max_len // 1024}K: {workload.turns} turns", flush=True)
    rows = []
    for prefill, decode in TOPOLOGIES:
        cfg = cluster(prefill, decode, model=SMALL_MLA)
        print(f"{prefill}P{decode}D", flush=True)
        runs = {mode: brief(run(cfg, workload, mode)) for mode in ("basic", "dualpath", "oracle")}
        rows.append({"topology": f"{prefill}P{decode}D", "runs": runs,
                     "basic_over_dualpath": runs["basic"]["jct_s"] / runs["dualpath"]["jct_s"]})
    speedups = [r["basic_over_dualpath"] for r in rows]
    save(args.out, "pd_sweep", {
        "paper": PAPER, "model": "small MLA (DeepSeek-V2-Lite shape)", "agents": count, "max_len": max_len,
        "rows": rows, "average_speedup": sum(speedups) / len(speedups), "max_speedup": max(speedups),
        "dualpath_1p1d_over_basic_2p1d": rows[0]["runs"]["dualpath"]["jct_s"] / rows[1]["runs"]["basic"]["jct_s"],
    })
    plt, png = figure(args.out, "pd_sweep")
    fig, ax = plt.subplots(figsize=(6, 3.6))
    width = 0.27
    for i, mode in enumerate(("basic", "dualpath", "oracle")):
        ax.bar([j + (i - 1) * width for j in range(len(rows))], [r["runs"][mode]["jct_s"] for r in rows], width, label=mode)
    for j, r in enumerate(rows):
        ax.text(j, r["runs"]["basic"]["jct_s"], f"{r['basic_over_dualpath']:.2f}x", ha="center", va="bottom", fontsize=8)
    ax.set_xticks(range(len(rows)), [r["topology"] for r in rows])
    ax.set_ylabel("JCT (simulated s)")
    ax.set_title(f"small MLA, {count} agents, MaxLen {max_len // 1024}K (label: Basic / DualPath)")
    ax.legend()
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
