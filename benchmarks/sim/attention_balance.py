"""Attention-time balance across a prefill node's data-parallel engines (paper: Max/Avg 1.06).

With DeepSeek's data-parallel attention and expert-parallel MoE, the 8 engines of a prefill node
step their layers together, so a round lasts as long as its slowest engine. The compute quota
(300 ms per forward) and the scheduler's min-tok placement are what balance them. Three measures
over the rounds of the SNIC high-load window, for DualPath and Oracle, with requests bound to an
engine at placement (the paper's) and at the round (`SimOptions.lockstep_binding="round"`:
`pack_lockstep_round` gives ready work to the peer with less):
- per round: Max/Avg of the engines' layer times in each round (an idle engine counts 0),
  weighted by round length (SimResult.attention_balance);
- full rounds: the same over rounds whose engines' summed work is >= 90% of a round of full
  quotas (attention_balance_full_rounds), and how full the rounds were (attention_fill);
- per engine: Max/Avg of each engine's attention time summed over the window, the worst node's
  (attention_engine_totals).

    .venv/bin/python benchmarks/sim/attention_balance.py            # 1024 agents, 32K and 64K
    .venv/bin/python benchmarks/sim/attention_balance.py --quick    # 256 agents, 64K

Writes results/attention_balance.json and .png.
"""

from __future__ import annotations

from common import agents, cluster, figure, parser, save, with_options

from dualpath_ray.sim.simulator import Simulation

PAPER = {"attention_max_over_avg": 1.06, "source": "paper-digest.md: intra-engine batching, balanced attention time"}
MEASURES = ("attention_balance", "attention_balance_full_rounds", "attention_engine_totals")


def main() -> None:
    args = parser(__doc__).parse_args()
    count, max_lens = (256, (65536,)) if args.quick else (1024, (32768, 65536))
    cfg = cluster(2, 4)
    rows, rounds = [], {}
    for max_len in max_lens:
        workload = agents(count, max_len)
        for mode in ("dualpath", "oracle"):
            for binding in ("placement", "round"):
                sim = Simulation(cfg, workload, mode, with_options(lockstep_binding=binding))
                result = sim.run()
                row = {"max_len": max_len, "mode": mode, "binding": binding, "jct_s": result.jct_s,
                       "ttft_s": result.ttft_s, "attention_fill": result.attention_fill,
                       **{measure: getattr(result, measure) for measure in MEASURES}}
                rows.append(row)
                print(f"  {max_len // 1024}K {mode} bound at {binding}: JCT {result.jct_s:.1f} s, per round "
                      f"{result.attention_balance:.3f}, full rounds {result.attention_balance_full_rounds:.3f}, "
                      f"per engine {result.attention_engine_totals:.3f}, fill {result.attention_fill:.2f}", flush=True)
                if (mode, binding, max_len) == ("dualpath", "placement", max_lens[-1]):
                    start, end = result.snic_window_s
                    rounds = [r for r in sim.prefill_stats.balance if start <= r[0] <= end]
    save(args.out, "attention_balance", {"paper": PAPER, "agents": count, "cluster": "2P4D, DeepSeek-V3.2 660B profile",
                                         "rows": rows})
    plt, png = figure(args.out, "attention_balance")
    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 3.6))
    left.scatter([r[3] for r in rounds], [r[2] for r in rounds], s=3, alpha=0.3)
    left.set_xlabel("round fill (summed work / full quotas)")
    left.set_ylabel("round Max/Avg")
    left.set_title(f"DualPath, {max_lens[-1] // 1024}K, bound at placement: each round")
    labels = [f"{r['max_len'] // 1024}K {r['mode']}\n{r['binding']}" for r in rows]
    width = 0.27
    for i, measure in enumerate(MEASURES):
        right.bar([j + (i - 1) * width for j in range(len(rows))], [r[measure] for r in rows], width,
                  label=measure.replace("attention_", ""))
    right.axhline(PAPER["attention_max_over_avg"], color="grey", linestyle="--", linewidth=0.8, label="paper 1.06")
    right.set_xticks(range(len(rows)), labels, fontsize=6, rotation=30)
    right.set_ylim(0.9, 1.1 * max(r[m] for r in rows for m in MEASURES))
    right.set_ylabel("Max/Avg")
    right.legend(fontsize=6, loc="upper left", ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=120)
    print(f"wrote {png}")


if __name__ == "__main__":
    main()
