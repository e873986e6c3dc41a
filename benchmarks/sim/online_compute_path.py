"""Online serving with the compute path: the most agents per second (APS) DualPath sustains under
the paper's SLO (mean TTFT <= 4 s, mean TPOT <= 50 ms) with scheduler.compute_path off and auto,
on 2P4D as `online.py` measures it, at the paper's SNIC bandwidth and at 1/8 of it.

    .venv/bin/python benchmarks/sim/online_compute_path.py            # 900 s windows, 6 bisection steps
    .venv/bin/python benchmarks/sim/online_compute_path.py --quick    # 300 s windows, 4 steps, large MLA only

The same bisection and SLO as online.py (its `max_rate`). Writes results/online_compute_path.json.
"""

from __future__ import annotations

from common import LARGE_MLA, SMALL_MLA, cluster, parser, save
from online import PAPER, max_rate

SNIC_SCALES = (1.0, 0.125)


def main() -> None:
    args = parser(__doc__).parse_args()
    window_s, steps = (300.0, 4) if args.quick else (900.0, 6)
    models = (("ds_660b", LARGE_MLA, 0.05, 3.0),) if args.quick else (
        ("ds_660b", LARGE_MLA, 0.05, 3.0), ("small_mla", SMALL_MLA, 0.05, 12.0))
    rows = []
    for name, model, low, high in models:
        for scale in SNIC_SCALES:
            found = {}
            for compute_path in ("off", "auto"):
                cfg = cluster(2, 4, model=model, compute_path=compute_path)
                cfg = cfg.with_overrides(cluster={"snic_gbps": cfg.cluster.snic_gbps * scale})
                print(f"{name} SNIC x{scale} compute_path {compute_path}", flush=True)
                found[compute_path] = max_rate(cfg, "dualpath", low, high, steps, window_s)
            off, auto = found["off"][0], found["auto"][0]
            rows.append({"model": name, "snic_scale": scale, "off_aps": off, "auto_aps": auto,
                         "auto_over_off": auto / off if off else None,
                         "trials": {k: trials for k, (_, trials) in found.items()}})
            print(f"  APS off {off:.3f}, auto {auto:.3f}", flush=True)
    save(args.out, "online_compute_path", {"slo": PAPER["slo"], "topology": "2P4D", "window_s": window_s, "rows": rows})


if __name__ == "__main__":
    main()
