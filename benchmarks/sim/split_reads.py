"""Beyond the paper: split reads (scheduler.read_split: proportional) against the paper's
whole-request read-path choice: one request's hit blocks are read by both the prefill-side and
the decode-side reader in proportion to their read-queue headroom below alpha.

    .venv/bin/python benchmarks/sim/split_reads.py            # 2P4D large MLA (1024 agents, 64K); 1P1D small MLA (512, 64K)
    .venv/bin/python benchmarks/sim/split_reads.py --quick    # 256 agents, MaxLen 32K, 2P4D only

Writes results/split_reads.json and .png.
"""

from __future__ import annotations

from common import LARGE_MLA, SMALL_MLA, agents, brief, cluster, figure, parser, run, save


def main() -> None:
    args = parser(__doc__).parse_args()
    settings = (("2P4D large MLA", 2, 4, LARGE_MLA, 256, 32768),) if args.quick else (
        ("2P4D large MLA", 2, 4, LARGE_MLA, 1024, 65536), ("1P1D small MLA", 1, 1, SMALL_MLA, 512, 65536))
    rows = []
    for name, prefill, decode, model, count, max_len in settings:
        workload = agents(count, max_len)
        print(f"{name}, {count} agents, MaxLen {max_len // 1024}K", flush=True)
        runs = {split: brief(run(cluster(prefill, decode, model=model, read_split=split), workload, "dualpath"))
                for split in ("whole", "proportional")}
        rows.append({"setting": name, "agents": count, "max_len": max_len, "runs": runs,
                     "whole_over_split_jct": runs["whole"]["jct_s"] / runs["proportional"]["jct_s"]})
    save(args.out, "split_reads", {"rows": rows})
    plt, png = figure(args.out, "split_reads")
    fig, axes = plt.subplots(1, 2, figsize=(9, 3.4))
    width = 0.35
    for i, split in enumerate(("whole", "proportional")):
        xs = [j + (i - 0.5) * width for j in range(len(rows))]
        axes[0].bar(xs, [r["runs"][split]["jct_s"] for r in rows], width, label=split)
        axes[1].bar(xs, [r["runs"][split]["snic_balance"] or 0 for r in rows], width, label=split)
    for ax, label in zip(axes, ("JCT (simulated s)", "SNIC balance (max/mean)")):
        ax.set_xticks(range(len(rows)), [r["setting"] for r in rows], fontsize=8)
        ax.set_ylabel(label)
    axes[0].legend()
    fig.suptitle("Split reads vs whole-request path choice (DualPath)")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
