"""Storage NIC balance: max / mean bytes read across every node's SNIC per 10 s window, read
paths chosen round-robin vs by the scheduler's read queues (paper: 1.53 vs 1.18).

    .venv/bin/python benchmarks/sim/snic_balance.py            # 2P4D, 1024 agents, MaxLen 64K
    .venv/bin/python benchmarks/sim/snic_balance.py --quick    # 256 agents, MaxLen 32K

Writes results/snic_balance.json and .png (bytes read per SNIC over time for both).
"""

from __future__ import annotations

from common import agents, cluster, figure, parser, save, with_options

from dualpath_ray.sim.simulator import Simulation

PAPER = {"round_robin": 1.53, "scheduler": 1.18, "source": "paper-digest.md: Storage NIC balance"}


def main() -> None:
    args = parser(__doc__).parse_args()
    count, max_len = (256, 32768) if args.quick else (1024, 65536)
    workload = agents(count, max_len)
    cfg = cluster(2, 4)
    runs, series = {}, {}
    for name, choice in (("round_robin", "round_robin"), ("scheduler", "read_queue")):
        sim = Simulation(cfg, workload, "dualpath", with_options(path_choice=choice))
        result = sim.run()
        print(f"  {name}: {result.headline()}", flush=True)
        runs[name] = {"snic_balance": result.snic_balance, "jct_s": result.jct_s, "snic_read_bytes": result.snic_read_bytes,
                      "requests_by_path": result.requests_by_path}
        nodes = sim.prefill_nodes + sim.decode_nodes
        windows = max((max(n.snic_windows.bytes_by_window, default=0) for n in nodes), default=0) + 1
        series[name] = {n.node_id: [n.snic_windows.bytes_by_window.get(w, 0) for w in range(windows)] for n in nodes}
    save(args.out, "snic_balance", {"paper": PAPER, "agents": count, "max_len": max_len, "window_s": 10.0, "runs": runs})
    plt, png = figure(args.out, "snic_balance")
    fig, axes = plt.subplots(1, 2, figsize=(10, 3.4), sharey=True)
    for ax, (name, per_node) in zip(axes, series.items()):
        for node, values in per_node.items():
            ax.plot([10 * w for w in range(len(values))], [v / 10 / 1e9 for v in values], label=node, linewidth=0.8)
        ax.set_title(f"{name}: balance {runs[name]['snic_balance']:.2f}")
        ax.set_xlabel("simulated s")
    axes[0].set_ylabel("SNIC read GB/s (10 s windows)")
    axes[1].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
