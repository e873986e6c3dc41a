"""Shared factories for the tests: small configs, trajectories, and a reference recompute."""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import numpy as np

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.workload.trace import Trajectory, Turn


def ray_test_env() -> None:
    """Token auth off and no usage stats: only inside tests (production keeps auth on)."""
    os.environ["RAY_AUTH_MODE"] = "disabled"
    os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
    os.environ.setdefault("RAY_rdt_fetch_fail_timeout_milliseconds", "20000")


@contextmanager
def restored_environ() -> Iterator[None]:
    """The process environment as it was, once the block ends: for code that sets variables for
    its own process only (vLLM's CPU platform does, building a VllmConfig: LD_PRELOAD,
    LOCAL_WORLD_SIZE, ...), which every process a later test starts would inherit
    (tests/unit/conftest.py)."""
    saved = dict(os.environ)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def runtime_config(transport: str = "gloo", mode: str = "dualpath", **runtime: object) -> DualPathConfig:
    """1P1D, 2 GPUs per node, the tiny model, SNICs slow enough that read queues build up."""
    return parse_config(
        {
            "model": {"n_layer": 2, "max_context": 2048},
            "cluster": {
                "prefill_nodes": 1, "decode_nodes": 1, "gpus_per_node": 2,
                "snic_gbps": 0.064, "cnic_gbps": 8.0, "hbm_tokens_per_engine": 4096,
                "buffer_blocks_per_node": 128, "cpus_per_node": 1,
            },
            "store": {"block_size": 64},
            "emulation": {"enabled": True, "compute": "model"},
            "runtime": {"mode": mode, "transport": transport, "verify_kv": True, **runtime},
        },
        source="<tests>",
    )


def trajectories(count: int = 8, turns: int = 4, first: int = 150, appended: int = 40,
                 gen: int = 6, vocab: int = 512, seed: int = 7, tool_s: float = 0.0) -> list[Trajectory]:
    """`count` agents of `turns` turns; each turn after the first waits `tool_s` for its tool (the
    rollout hints it, and the next turn's KV is staged meanwhile: scheduling/staging.py)."""
    rng = np.random.default_rng(seed)
    result = []
    for t in range(count):
        steps = tuple(
            Turn(tuple(int(x) for x in rng.integers(0, vocab, first if k == 0 else appended)), gen, tool_s if k else 0.0)
            for k in range(turns)
        )
        result.append(Trajectory(f"traj{t}", steps))
    return result


def recompute_outputs(cfg: DualPathConfig, trajs: list[Trajectory]) -> dict[str, list[tuple[int, ...]]]:
    """Single-process greedy recompute of every turn from scratch: the reference outputs. On one
    torch thread, as the engines compute (runtime.compute_threads): a test process shares its
    cores with the cluster, where more threads only contend."""
    import torch

    from dualpath_ray.model.llama import DecoderModel

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        model = DecoderModel(cfg.model)
        outputs: dict[str, list[tuple[int, ...]]] = {}
        for traj in trajs:
            context: list[int] = []
            outputs[traj.trajectory_id] = []
            for turn in traj.turns:
                context = context + list(turn.appended)
                generated = tuple(model.greedy_generate(context, turn.gen_len).token_ids)
                outputs[traj.trajectory_id].append(generated)
                context = context + list(generated)
        return outputs
    finally:
        torch.set_num_threads(threads)


def default_timeout(items: list[Any], directory: Path, seconds: float) -> None:
    """Give every collected test under `directory` a timeout (pytest-timeout): its own
    `pytest.mark.timeout` seconds, else `seconds`, ended by the thread method. A per-directory
    conftest calls this from pytest_collection_modifyitems, which sees the whole session's items.

    The thread method, because these tests wait in Ray: the signal method's SIGALRM handler runs
    only when the main thread is back in Python, and a `ray.get` that never returns never is
    (tried: a test stuck in `ray.get` of a task that sleeps forever, marked timeout(20), was still
    there 35 minutes later). The thread method dumps every thread's stack and ends the pytest
    process, so a hang costs the rest of the run, but the run fails in minutes with the stacks
    that show where it hung, instead of at CI's job limit with nothing."""
    import pytest

    for item in items:
        if directory not in item.path.parents:
            continue
        own = item.get_closest_marker("timeout")
        timeout = (own.kwargs.get("timeout", own.args[0] if own.args else None) if own is not None else None)
        # Prepended to the test's own markers, so it is the closest: what pytest-timeout reads.
        item.add_marker(pytest.mark.timeout(timeout if timeout is not None else seconds, method="thread"), append=False)


def wait_until(condition: Callable[[], bool], poll_s: float = 0.005) -> None:
    """Poll until `condition()` holds, however long that takes on this machine: the test's
    timeout (pytest-timeout: tests/conftest.py and the per-directory conftests) ends a wait for
    something that never happens, so no wall-clock bound of its own can fail a slow machine."""
    while not condition():
        time.sleep(poll_s)


def verify_mismatches(cluster: Any) -> int:
    """Attempts whose assembled KV runtime.verify_kv found different from the store and a
    recompute, over every live decode engine. Each is retried, and a clean retry leaves the
    outputs right, so only this count shows that wrong KV got as far as a decode engine."""
    return sum(stats.core.verify_mismatches for name, stats in cluster.engine_stats().items()
               if name.startswith("decode/"))


def settled_pools(cluster: Any, timeout_s: float) -> dict[str, tuple[int, int, int, int]]:
    """Every reader's pool (free, leased, in flight, capacity) once nothing is leased, staged
    extents included, or as it stands after timeout_s: a transfer from a dead peer frees its
    extents only at its timeout, an unclaimed staged extent at its expiry."""
    deadline = time.monotonic() + timeout_s
    while True:
        pools = cluster.pool_integrity()
        if all(free == capacity for free, _, _, capacity in pools.values()) or time.monotonic() > deadline:
            return pools
        time.sleep(0.2)
