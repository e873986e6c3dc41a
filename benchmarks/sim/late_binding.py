"""Late binding and in-flight sharing under a trace replayed faster than real time (issue 37).

    .venv/bin/python benchmarks/sim/late_binding.py          # about a minute on the 2-core VM

A synthetic trace in the public Mooncake form (one-turn requests whose leading hash ids name
shared 512-token blocks): `--groups` shared prefixes (a conversation's context, an agent
batch's system prompt and tool schema) of `--prefix` tokens, each request one of them plus
1-4 blocks of its own, `--requests` requests arriving as a Poisson process of `--gap` seconds
mean at 1x; compressed 10x and 100x, the same requests arrive 10 and 100 times closer. Each is
simulated in basic and dualpath modes with the hits bound early (at submit: the behaviour before
issue 37), late (at placement), and late with in-flight sharing (scheduler.share_in_flight),
on the small MLA model's 1P1D cluster. The figure is the hit tokens the run read over the
trace's in-order prefix reuse: what a request could hit if every request before it (in arrival
order) had been stored when it arrived (in stored blocks, one token left to compute: with
partial-block hits, the default, the block holding a prompt's last token counts too).

Grouped sampling (the first turn of GRPO's groups): `--prompts` prompts x `--samples` samples,
a `--prompt-tokens` shared prompt of whole blocks, all arriving together, the same three bindings
and sharing with whole-block hits (scheduler.partial_block_hits: off, the rule before: a waiter
computes the prompt's last block): prompt tokens the prefill engines computed, JCT and TTFT p50.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import SMALL_MLA, cluster, parser, run, save  # noqa: E402

from dualpath_ray.sim.workload import Workload, from_mooncake  # noqa: E402
from dualpath_ray.workload.mooncake import MOONCAKE_BLOCK_TOKENS, MooncakeRequest  # noqa: E402

BINDINGS = {  # name -> scheduler settings
    "early": {"bind_hits": "early", "share_in_flight": False},
    "late": {"bind_hits": "late", "share_in_flight": False},
    "late+share": {"bind_hits": "late", "share_in_flight": True},
}
COMPRESSIONS = (1, 10, 100)
# Grouped sampling also runs sharing with whole-block hits (the rule before partial-block hits).
GROUPED = {**BINDINGS, "late+share, whole blocks": {**BINDINGS["late+share"], "partial_block_hits": "off"}}


def trace(requests: int, groups: int, prefix_blocks: int, gap_s: float, seed: int = 0) -> list[MooncakeRequest]:
    """The synthetic trace at 1x (module doc)."""
    rng = np.random.default_rng(seed)
    arrivals = np.cumsum(rng.exponential(gap_s, requests))
    next_id = groups * prefix_blocks
    out = []
    for i in range(requests):
        group = int(rng.integers(groups))
        own = int(rng.integers(1, 5))
        ids = tuple(range(group * prefix_blocks, (group + 1) * prefix_blocks)) + tuple(range(next_id, next_id + own))
        next_id += own
        length = (prefix_blocks + own - 1) * MOONCAKE_BLOCK_TOKENS + int(rng.integers(1, MOONCAKE_BLOCK_TOKENS))
        out.append(MooncakeRequest(i + 1, float(arrivals[i] * 1000.0), length, int(rng.integers(64, 257)), ids))
    return out


def compressed(requests: list[MooncakeRequest], factor: int) -> list[MooncakeRequest]:
    return [MooncakeRequest(r.line, r.timestamp_ms / factor, r.input_length, r.output_length, r.hash_ids)
            for r in requests]


def grouped(prompts: int, samples: int, prompt_blocks: int, gen: int) -> list[MooncakeRequest]:
    """The first turn of grouped sampling: `samples` requests of each of `prompts` prompts of
    `prompt_blocks` whole 512-token blocks, all arriving at 0."""
    out = []
    for p in range(prompts):
        ids = tuple(range(p * prompt_blocks, (p + 1) * prompt_blocks))
        for _ in range(samples):
            out.append(MooncakeRequest(len(out) + 1, 0.0, prompt_blocks * MOONCAKE_BLOCK_TOKENS, gen, ids))
    return out


def in_order_reuse(workload: Workload, block_size: int) -> int:
    """Hit tokens if every earlier request (arrival order) were stored when each arrives."""
    stored: set[int] = set()
    total = 0
    for t in sorted(workload.trajectories, key=lambda t: t.arrival_s):
        prompt = int(t.appended[0])
        usable = prompt // block_size  # partial-block hits: the block of the last token too
        hit = 0
        while hit < usable and t.keys[hit] in stored:
            hit += 1
        total += min(hit * block_size, prompt - 1)
        stored.update(t.keys)
    return total


def main() -> None:
    p = parser(__doc__)
    p.add_argument("--requests", type=int, default=256)
    p.add_argument("--groups", type=int, default=16)
    p.add_argument("--prefix", type=int, default=16384, help="tokens of each shared prefix (whole 512-token blocks)")
    p.add_argument("--gap", type=float, default=2.0, help="mean seconds between arrivals at 1x")
    p.add_argument("--prompts", type=int, default=64, help="grouped sampling: prompts")
    p.add_argument("--samples", type=int, default=8, help="grouped sampling: samples of each (G)")
    p.add_argument("--prompt-tokens", type=int, default=2048, help="grouped sampling: the shared prompt (whole 512-token blocks)")
    args = p.parse_args()
    base = trace(args.requests, args.groups, args.prefix // MOONCAKE_BLOCK_TOKENS, args.gap)
    rows: list[dict[str, Any]] = []
    for factor in COMPRESSIONS:
        for mode in ("basic", "dualpath"):
            for name, scheduler in BINDINGS.items():
                cfg = cluster(1, 1, SMALL_MLA, max_context=65536, **scheduler)
                workload = from_mooncake(compressed(base, factor), cfg.store.block_size, source=f"synthetic x{factor}")
                reuse = in_order_reuse(workload, cfg.store.block_size)
                prompt = sum(int(t.appended[0]) for t in workload.trajectories)
                print(f"x{factor} {mode} {name}:", flush=True)
                result = run(cfg, workload, mode)
                hit = round(result.hit_rate * prompt)
                rows.append({
                    "compression": factor, "mode": mode, "binding": name, "hit_tokens": hit,
                    "in_order_reuse_tokens": reuse, "of_in_order": hit / reuse if reuse else None,
                    "jct_s": result.jct_s, "ttft_p50_s": result.ttft_s["p50"], "ttft_p99_s": result.ttft_s["p99"],
                    "sharing": result.sharing,
                })
                print(f"  hit {hit} of {reuse} in-order ({rows[-1]['of_in_order']:.3f})", flush=True)
    groups: list[dict[str, Any]] = []
    for mode in ("basic", "dualpath"):
        for name, scheduler in GROUPED.items():
            cfg = cluster(1, 1, SMALL_MLA, max_context=65536, **scheduler)
            workload = from_mooncake(grouped(args.prompts, args.samples, args.prompt_tokens // MOONCAKE_BLOCK_TOKENS, 64),
                                     cfg.store.block_size, source="grouped sampling")
            prompt = sum(int(t.appended[0]) for t in workload.trajectories)
            print(f"grouped {args.prompts} x {args.samples} {mode} {name}:", flush=True)
            result = run(cfg, workload, mode)
            computed = prompt - round(result.hit_rate * prompt)
            groups.append({"mode": mode, "binding": name, "prefill_tokens_computed": computed, "prompt_tokens": prompt,
                           "jct_s": result.jct_s, "ttft_p50_s": result.ttft_s["p50"], "sharing": result.sharing})
    save(args.out, "late_binding", {"args": {**vars(args), "out": str(args.out)}, "runs": rows, "grouped": groups})
    print(f"\n| grouped {args.prompts} x G={args.samples} | binding | prefill tokens computed | of early | JCT s | "
          "TTFT p50 s |\n|---|---|---:|---:|---:|---:|")
    for g in groups:
        early = next(e for e in groups if e["mode"] == g["mode"] and e["binding"] == "early")
        print(f"| {g['mode']} | {g['binding']} | {g['prefill_tokens_computed']} | "
              f"{g['prefill_tokens_computed'] / early['prefill_tokens_computed']:.3f} | {g['jct_s']:.2f} | "
              f"{g['ttft_p50_s']:.3f} |")
    print("\n| compression | mode | early | late | late + share |\n|---:|---|---:|---:|---:|")
    for factor in COMPRESSIONS:
        for mode in ("basic", "dualpath"):
            cells = [next(r for r in rows if r["compression"] == factor and r["mode"] == mode and r["binding"] == b)
                     for b in BINDINGS]
            print(f"| x{factor} | {mode} | " + " | ".join(f"{c['of_in_order']:.3f}" for c in cells) + " |")


if __name__ == "__main__":
    main()
