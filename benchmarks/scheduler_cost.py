"""Scheduler cost per request at the paper's largest scale (48P96D, 1,152 GPUs).

384 prefill engines on 48 nodes, 768 decode engines in 96 groups of 8, a waiting queue of 48K
requests. Each policy step is timed over the whole queue and divided by the requests it
scheduled; the median over repeats is printed in microseconds per scheduled request.

Run: .venv/bin/python benchmarks/scheduler_cost.py [--repeats 5] [--queue 49152]
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass

from dualpath_ray.scheduling import (
    EngineLoad,
    QueuedRequest,
    assign_decode_groups,
    assign_decode_in_group,
    assign_prefill,
    choose_read_path,
)

GPUS_PER_NODE = 8
PREFILL_NODES = 48
DECODE_NODES = 96
GOAL_US = 20.0


@dataclass(frozen=True)
class Scenario:
    queue: list[QueuedRequest]
    prefill_engines: list[EngineLoad]
    read_q: dict[str, int]
    alpha: int
    beta: int
    decode_groups: dict[str, list[EngineLoad]]
    path_queues: list[tuple[int, int]]


def _engines(prefix: str, nodes: int, rng: random.Random, free_hbm: int) -> list[EngineLoad]:
    return [
        EngineLoad(
            f"{prefix}/n{n}/g{g}", f"{prefix}/n{n}", seq=rng.randint(0, 8),
            tok=rng.randint(0, 200_000), free_hbm_tokens=free_hbm,
        )
        for n in range(nodes)
        for g in range(GPUS_PER_NODE)
    ]


def build_scenario(queue_length: int, seed: int) -> Scenario:
    """Agentic prompts of 1K-64K tokens; half the prefill nodes have a read queue above alpha."""
    rng = random.Random(seed)
    queue = [QueuedRequest(f"req{i}", rng.randint(1_024, 65_536)) for i in range(queue_length)]
    total = sum(r.tokens for r in queue)
    prefill = _engines("prefill", PREFILL_NODES, rng, free_hbm=0)
    alpha = 3 * 6_000_000
    read_q = {f"prefill/n{n}": rng.randint(0, 2 * alpha) for n in range(PREFILL_NODES)}
    # beta sized so the queue just about fills every engine: C2 engines fill first, then C3.
    beta = total // len(prefill) + 200_000
    per_group_hbm = 2 * total // DECODE_NODES // GPUS_PER_NODE
    decode = _engines("decode", DECODE_NODES, rng, free_hbm=per_group_hbm)
    groups = {
        f"decode/n{n}": decode[n * GPUS_PER_NODE : (n + 1) * GPUS_PER_NODE] for n in range(DECODE_NODES)
    }
    paths = [(rng.randint(0, 10**7), rng.randint(0, 10**7)) for _ in range(queue_length)]
    return Scenario(queue, prefill, read_q, alpha, beta, groups, paths)


def _timed(step: Callable[[], int]) -> tuple[float, int]:
    """(microseconds per scheduled request, requests scheduled) of one run of `step`."""
    start = time.perf_counter_ns()
    scheduled = step()
    elapsed = time.perf_counter_ns() - start
    if scheduled == 0:
        raise RuntimeError("the benchmark step scheduled nothing; the scenario is mis-sized")
    return elapsed / 1_000 / scheduled, scheduled


def _private_queues(scenario: Scenario) -> dict[str, list[QueuedRequest]]:
    by_id = {r.request_id: r for r in scenario.queue}
    private: dict[str, list[QueuedRequest]] = {g: [] for g in scenario.decode_groups}
    for assignment in assign_decode_groups(scenario.queue, scenario.decode_groups):
        private[assignment.target].append(by_id[assignment.request_id])
    return private


def steps(scenario: Scenario) -> dict[str, Callable[[], int]]:
    private = _private_queues(scenario)

    def pe_assignment() -> int:
        return len(assign_prefill(scenario.queue, scenario.prefill_engines, scenario.read_q,
                                  scenario.alpha, scenario.beta))

    def de_phase1() -> int:
        return len(assign_decode_groups(scenario.queue, scenario.decode_groups))

    def de_phase2() -> int:
        return sum(
            len(assign_decode_in_group(private[g], members))
            for g, members in scenario.decode_groups.items()
        )

    def path_choice() -> int:
        for pe_q, de_q in scenario.path_queues:
            choose_read_path(pe_q, de_q)
        return len(scenario.path_queues)

    return {
        "PE assignment": pe_assignment,
        "DE phase 1 (groups)": de_phase1,
        "DE phase 2 (in group)": de_phase2,
        "read path choice": path_choice,
    }


def call_overheads(scenario: Scenario) -> dict[str, Callable[[], int]]:
    """Calls with a one-request queue: the per-call set-up over all engines or groups."""
    head = scenario.queue[:1]

    def pe_call() -> int:
        return len(assign_prefill(head, scenario.prefill_engines, scenario.read_q,
                                  scenario.alpha, scenario.beta))

    def de_phase1_call() -> int:
        return len(assign_decode_groups(head, scenario.decode_groups))

    return {"PE assignment call": pe_call, "DE phase 1 call": de_phase1_call}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per step (median)")
    parser.add_argument("--queue", type=int, default=48 * 1024, help="waiting requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.queue < 1:
        parser.error("--repeats and --queue must be >= 1")

    scenario = build_scenario(args.queue, args.seed)
    print(
        f"scale: {len(scenario.prefill_engines)} PEs on {PREFILL_NODES} nodes, "
        f"{sum(len(m) for m in scenario.decode_groups.values())} DEs in {len(scenario.decode_groups)} "
        f"groups, queue {len(scenario.queue)} requests, median of {args.repeats} runs"
    )
    total = 0.0
    for name, step in steps(scenario).items():
        step()
        runs = [_timed(step) for _ in range(args.repeats)]
        median = statistics.median(us for us, _ in runs)
        total += median
        print(f"{name:<24} {median:8.2f} us/request  ({runs[0][1]} requests scheduled per run)")
    verdict = "within" if total <= GOAL_US else "OVER"
    print(f"{'all steps of a request':<24} {total:8.2f} us/request ({verdict} the {GOAL_US:.0f} us goal)")
    for name, step in call_overheads(scenario).items():
        step()
        median = statistics.median(_timed(step)[0] for _ in range(args.repeats))
        print(f"{name:<24} {median:8.2f} us/call (fixed cost of a fetch that places one request)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
