"""The store's disk failing under a real cluster: hit blocks it cannot read (EIO) are named and
read again through the other side's reader, or unindexed and recomputed where that fails too, and a file system that fills up mid-rollout (ENOSPC) fails no turn:
its refused writes are counted, the blocks simply not indexed. Outputs equal the recompute and
nothing is left leased in either case."""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pytest
import ray

from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from tests.helpers import recompute_outputs, runtime_config, trajectories, verify_mismatches
from tests.shared_cluster import SharedCluster

pytestmark = [pytest.mark.integration, pytest.mark.chaos]


def store_faults(deployment) -> tuple[set[tuple[str, str]], int]:  # type: ignore[no-untyped-def]
    """((reader, key) of each block a reader could not read, block writes the store refused), over
    every reader. By reader: a block both readers failed (its read elsewhere failed too) is named
    by each of them."""
    unreadable, refused = set(), 0
    for name, reader in deployment.readers.items():
        keys, count = ray.get(reader.store_faults.remote())
        unreadable.update((name, key) for key in keys)
        refused += count
    return unreadable, refused


@contextmanager
def eio_rollout(shared_cluster: SharedCluster, actors: str) -> Iterator[tuple[Any, Any, dict[str, int], int]]:
    """A dualpath rollout (4 trajectories x 2 turns) whose readers matching `actors` each fail
    their second hit-block read with OSError(EIO) inside the store's read of that block (the
    fault plan's store_read fail). Yields (cluster, deployment, the scheduler's call counts,
    reads injected), after checking what every such run must show: every trajectory served,
    outputs equal to the fault-free recompute, no unreadable bytes at a decode engine, every
    buffer pool free."""
    cfg = runtime_config().with_overrides(
        faults={"seed": 5, "faults": [{"site": "store_read", "mode": "fail", "nth": 2, "actors": actors}]}
    )
    trajs = trajectories(count=4, turns=2, first=300)
    with shared_cluster.deployed(cfg, "dualpath") as cluster:
        deployment = cluster.deployment
        result = cluster.rollout(trajs, progress=False)
        calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
        injected = cluster.fault_counts()["store_read:fail"].injected
        print(f"EIO on {injected} hit-block reads ({actors}): retries {calls['retries']}, read elsewhere "
              f"{calls.get('reread_elsewhere_kv_unreadable', 0)}, unindexed {calls['unindexed_blocks']}")
        assert injected >= 1, "the plan hit at least one read"
        assert not result.failures, f"every trajectory completes: {result.failures}"
        assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
        assert verify_mismatches(cluster) == 0, "no unreadable block's bytes reached a decode engine (runtime.verify_kv)"
        yield cluster, deployment, calls, injected
        assert all(free == capacity for free, _, _, capacity in cluster.pool_integrity().values()), (
            "every buffer pool is fully free after the run"
        )


def test_hit_blocks_the_disk_cannot_read_are_named_read_elsewhere_or_recomputed(shared_cluster: SharedCluster):
    # Both readers fail (a bad sector, or a node's failing storage client). The retry reads
    # through the other side's reader; where that one fails too, the block is repaired
    # (unindexed, deleted) and the next retry recomputes it.
    with eio_rollout(shared_cluster, "reader/*") as (_, deployment, calls, injected):
        elsewhere = calls.get("reread_elsewhere_kv_unreadable", 0)
        assert elsewhere >= 1, "a failed read is retried through the other side's reader first"
        assert elsewhere == injected or calls["unindexed_blocks"] >= 1, (
            "a block that failed on both sides left the index (with its successors) and was recomputed"
        )
        unreadable, _ = store_faults(deployment)
        assert len(unreadable) == injected, (
            f"each unreadable block is named by the reader that read it, once per reader: {unreadable}"
        )
        assert calls["retries"] == injected, "each costs its turn one retry, not one per later read"


def test_an_io_error_on_the_prefill_nodes_reader_is_read_again_through_the_decode_nodes(
    shared_cluster: SharedCluster,
):
    # Only the prefill node's reader fails: that node's storage client, not the block (the
    # decode node's reader reads it fine). The retry reads the turn's hits through the decode
    # node's reader (DE path): nothing is unindexed or recomputed.
    with eio_rollout(shared_cluster, "reader/p0") as (_, _, calls, injected):
        assert calls.get("reread_elsewhere_kv_unreadable", 0) == injected == calls["retries"], (
            "each failed read is retried once, through the other side's reader"
        )
        assert calls["unindexed_blocks"] == 0, "no block left the index: the decode node's reader read it"


@contextmanager
def small_file_system(size_bytes: int) -> Iterator[str | None]:
    """A tmpfs of size_bytes mounted at a fresh directory, or None where mounting is not allowed."""
    where = tempfile.mkdtemp(prefix="dualpath-full-")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_bytes}", "tmpfs", where], capture_output=True
    ).returncode == 0 if shutil.which("mount") else False
    try:
        yield where if mounted else None
    finally:
        if mounted:
            subprocess.run(["umount", "-l", where], check=False)
        shutil.rmtree(where, ignore_errors=True)


def fill(root: str, room_bytes: int) -> None:
    """Write a filler file that leaves room_bytes free on root's file system."""
    stats = os.statvfs(root)
    with open(os.path.join(root, "filler"), "wb") as filler:
        filler.write(b"\0" * max(0, stats.f_bavail * stats.f_frsize - room_bytes))


def test_a_store_whose_file_system_fills_up_fails_no_turn(shared_cluster: SharedCluster):
    cfg = runtime_config()
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    block_file = -(-(HEADER_SIZE + layout.full_block_bytes) // 4096) * 4096
    trajs = trajectories(count=3, turns=2, first=300)
    with small_file_system(64 * block_file) as root:
        if root is None:
            # Without the right to mount, the fault plan refuses writes the way the disk would:
            # OSError(EIO) from the store's write of the block (store_publish fail).
            cfg = cfg.with_overrides(faults={"seed": 5, "faults": [
                {"site": "store_publish", "mode": "fail", "probability": 0.5, "min_count": 1, "actors": "reader/*"}]})
        with shared_cluster.deployed(cfg, "dualpath", store_root=root) as cluster:
            deployment = cluster.deployment
            if root is not None:
                fill(root, 4 * block_file)  # filled by someone else after the scheduler sized the store
            result = cluster.rollout(trajs, progress=False)
            calls = ray.get(deployment.scheduler.status.remote(StatusQuery.CALLS)).to_json()
            print(f"{'a full tmpfs' if root else 'store_publish fail 50%'}: failed {sorted(result.failures)}, "
                  f"retries {calls['retries']}, indexed {calls['indexed_blocks']}")
            assert not result.failures, f"a refused write fails no trajectory: {result.failures}"
            assert calls["retries"] == 0, "nor costs any turn a retry: only the blocks go unindexed"
            _, refused = store_faults(deployment)
            print(f"{refused} block writes refused")
            assert refused >= 1, "the store refused writes, and the readers counted them"
            assert result.outputs() == recompute_outputs(cfg, trajs), "outputs equal the fault-free recompute"
            assert verify_mismatches(cluster) == 0, "no refused write's block reached a decode engine (runtime.verify_kv)"
            assert all(free == capacity for free, _, _, capacity in cluster.pool_integrity().values()), (
                "nothing is left leased in any buffer pool"
            )
            assert cluster.health() == {}, "no engine thread failed"
