"""Scale: 2P4D with 2K agents against 48P96D (1,152 GPUs) with 48K agents, DualPath, the large
MLA model (paper: JCT 3,167 s vs 3,201 s; the scheduler under 10 CPU cores at 1,152 GPUs).

Also measured: the scheduler core's CPU seconds per simulated second (every SchedulerCore call
timed with process time) and the whole simulation's wall time (goal: under 10 minutes on this
2-core machine). Wall times are only meaningful on a quiet machine, so the script first waits
(at most 30 min) until no Ray cluster runs here and the load average is below 1.0, and records
the load it ran under.

    .venv/bin/python benchmarks/sim/scale.py             # MaxLen 16K
    .venv/bin/python benchmarks/sim/scale.py --quick     # 24P48D with 24K agents, MaxLen 8K
    .venv/bin/python benchmarks/sim/scale.py --no-wait   # measure at once

Writes results/scale.json and .png.
"""

from __future__ import annotations

import time

from common import agents, brief, cluster, figure, load_average, parser, run, save, wait_for_quiet


PAPER = {"small": {"topology": "2P4D", "agents": 2048, "jct_s": 3167}, "large": {"topology": "48P96D", "agents": 49152, "jct_s": 3201},
         "scheduler_cores": "under 10", "source": "paper-digest.md: Scale"}


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine")
    p.add_argument("--max-len", type=int, default=16384, help="MaxLen of the agents (default 16K)")
    args = p.parse_args()
    max_len = 8192 if args.quick else args.max_len
    large = (24, 48, 24576) if args.quick else (48, 96, 49152)
    rows = []
    for prefill, decode, count in ((2, 4, 2048), large):
        workload = agents(count, max_len)
        cfg = cluster(prefill, decode)
        machine = {"load_1min": load_average()} if args.no_wait else wait_for_quiet()
        print(f"{prefill}P{decode}D, {count} agents, MaxLen {max_len // 1024}K: {workload.turns} turns; {machine}", flush=True)
        cpu = time.process_time()
        result = run(cfg, workload, "dualpath")
        rows.append({
            "topology": f"{prefill}P{decode}D", "gpus": 8 * (prefill + decode), "agents": count, "max_len": max_len,
            "turns": workload.turns, **brief(result), "simulation_cpu_s": time.process_time() - cpu,
            "scheduler_cpu_s": result.scheduler_cpu_s, "simulated_s": result.simulated_s, "events": result.events,
            "machine_before": machine, "load_1min_after": load_average(),
        })
    save(args.out, "scale", {"paper": PAPER, "rows": rows, "jct_ratio": rows[1]["jct_s"] / rows[0]["jct_s"]})
    plt, png = figure(args.out, "scale")
    fig, ax = plt.subplots(figsize=(5, 3.4))
    ax.bar([r["topology"] for r in rows], [r["jct_s"] for r in rows], color=["#4c72b0", "#55a868"])
    for j, r in enumerate(rows):
        ax.text(j, r["jct_s"], f"{r['jct_s']:.0f} s\n{r['agents']} agents", ha="center", va="bottom", fontsize=8)
    ax.set_ylabel("JCT (simulated s)")
    ax.set_title(f"DualPath at scale, MaxLen {max_len // 1024}K")
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
