"""Reclaim during read (issue 31 item 2), on a real 1P1D cluster running the real (tiny) model.

Every stored block read is slowed by the fault plan (store_read delay), and a prefill engine is
killed while reads of its attempts are under way: the scheduler's watchdog reclaims the dead
attempts' extents on the readers while those reads still fill them. The reads stop at their next
block and their slots go back only then (kv/pool.py RETIRING), so the retried attempts and every
other request get clean slots: the rollout's outputs equal a single-process recompute, and every
block in the store, read back, is the KV a recompute of its chain gives (within the model's float
noise, as the decode side's own check allows: runtime/decode/verify.py)."""

from __future__ import annotations

import threading
import time
from typing import Any

import numpy as np
import pytest
import torch

from tests.helpers import ray_test_env, recompute_outputs, runtime_config, settled_pools, trajectories

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.kv.index import block_keys  # noqa: E402
from dualpath_ray.kv.layout import KVLayout  # noqa: E402
from dualpath_ray.kv.store import open_store  # noqa: E402
from dualpath_ray.runtime.decode.verify import RTOL, ATOL, TOLERANCES  # noqa: E402
from dualpath_ray.runtime.engine.compute_choice import make_compute  # noqa: E402
from dualpath_ray.workload.trace import Trajectory  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]

READ_DELAY_S = 1.5  # per stored block read: a turn's 3 hit blocks take ~4.5 s, past the heartbeat timeout


def slow_read_config() -> DualPathConfig:
    cfg = runtime_config(heartbeat_s=0.2, heartbeat_timeout_s=2.0)
    return cfg.with_overrides(faults={"seed": 5, "faults": [
        {"site": "store_read", "mode": "delay", "delay_s": READ_DELAY_S, "probability": 1.0, "actors": "reader/*"},
    ]})


def kill_a_prefill_engine_mid_read(cluster: DualPathCluster, timeout_s: float = 180.0) -> str:
    """Once a reader has hit blocks in its read queue, kill the prefill engine of a request in
    flight (whose read it is); returns its name."""
    deployment = cluster.deployment
    assert deployment is not None
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(ray.get(r.read_q.remote()) > 0 for r in deployment.readers.values()):
            engines = sorted({
                e.prefill_engine for e in ray.get(deployment.scheduler.status.remote(StatusQuery.IN_FLIGHT)).requests.values()
                if e.prefill_engine
            })
            if engines:
                ray.kill(deployment.engines[engines[0]], no_restart=True)
                return engines[0]
        time.sleep(0.05)
    raise AssertionError("no hit-block read was ever under way")


def stored_blocks_match_a_recompute(cfg: DualPathConfig, store_root: str, trajs: list[Trajectory],
                                    outputs: dict[str, list[tuple[int, ...]]]) -> int:
    """Read every stored block back and compare it with the KV a single-sequence recompute of its
    chain gives; returns how many were checked. A block no trajectory's chain names fails too."""
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    size = cfg.store.block_size
    namespace = cfg.kv_namespace(cfg.model.weight_version)
    compute = make_compute(cfg, layout, torch.device("cpu"))
    expected: dict[str, torch.Tensor] = {}
    for traj in trajs:
        sequence: list[int] = []
        for turn, generated in zip(traj.turns, outputs[traj.trajectory_id]):
            sequence += list(turn.appended) + list(generated)
        keys = block_keys(sequence[: len(sequence) - 1], size, namespace)  # the last token has no KV
        pages = torch.zeros((len(keys), *layout.full_block_shape), dtype=torch.uint8)
        compute.fill_pages(np.asarray(sequence, dtype=np.int64), 0, len(keys) * size, pages, list(range(len(keys))))
        expected.update(zip(keys, pages))
    store = open_store(cfg.store, layout, root=store_root)
    out = layout.empty_full_block()
    checked = 0
    for key in store.keys():
        assert key in expected, f"stored block {key} belongs to no trajectory's chain"
        store.get_into(key, out)  # its checksum passes, or this raises
        for layer in range(layout.n_layer):
            got, want = layout.bytes_as_kv(out[layer]), layout.bytes_as_kv(expected[key][layer])
            rtol, atol = TOLERANCES.get(got.dtype, (RTOL, ATOL))
            assert torch.allclose(got.float(), want.float(), rtol=rtol, atol=atol), (
                f"stored block {key} (layer {layer}) holds the KV a recompute of its chain gives, not another's"
            )
        checked += 1
    return checked


def test_a_reclaim_during_a_slowed_store_read_leaves_outputs_and_the_store_correct() -> None:
    cfg = slow_read_config()
    trajs = trajectories(count=4, turns=3)
    expected = recompute_outputs(cfg, trajs)
    cluster = DualPathCluster.start(cfg)
    try:
        deployment = cluster.deploy("dualpath")
        box: dict[str, Any] = {}
        worker = threading.Thread(target=lambda: box.setdefault("result", cluster.rollout(trajs, progress=False)))
        worker.start()
        victim = kill_a_prefill_engine_mid_read(cluster)
        worker.join(timeout=600)
        assert not worker.is_alive(), "the rollout finishes"
        result = box["result"]
        retired = sum(ray.get(r.retired_reads.remote()) for r in deployment.readers.values())
        pools = settled_pools(cluster, cfg.runtime.transfer_timeout_s * 2)
        print(f"{victim} killed mid-read; reads stopped by a reclaim: {retired}; pools {pools}")
        assert not result.failures, f"0 lost trajectories: {result.failures}"
        assert result.outputs() == expected, "outputs equal the single-process recompute"
        checked = stored_blocks_match_a_recompute(cfg, deployment.store_root, trajs, result.outputs())
        assert checked > 0, "the rollout stored blocks, each checked"
        assert retired >= 1, "a reclaim landed while a store read still filled the extent (the case this tests)"
        assert all(free == capacity for free, _, _, capacity in pools.values()), (
            f"every reader's buffer is free again once the stopped reads ended: {pools}"
        )
    finally:
        cluster.shutdown()
