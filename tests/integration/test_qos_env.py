"""Every engine and reader of a local cluster runs with its role's traffic-class environment (the
`qos` section through each actor's Ray runtime_env): on InfiniBand, on RoCE after a redeploy with
that fabric, and with nothing when qos is disabled."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest

from tests.helpers import ray_test_env, runtime_config

ray_test_env()

import ray

from dualpath_ray.cluster import DualPathCluster

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

KEYS = ["UCX_IB_SL", "UCX_IB_TRAFFIC_CLASS", "NCCL_IB_SL", "NCCL_IB_TC"]
UNSET = dict.fromkeys(KEYS)


@pytest.fixture(scope="module")
def cluster() -> Iterator[DualPathCluster]:
    cfg = runtime_config(transport="gloo").with_overrides(cluster={"gpus_per_node": 1})
    started = DualPathCluster.start(cfg)
    try:
        yield started
    finally:
        started.shutdown()


def environments(cluster: DualPathCluster, **qos: Any) -> dict[str, dict[str, str | None]]:
    """Deploy with these qos fields and ask every engine and reader for its variables."""
    cfg = cluster.cfg.with_overrides(qos=qos)
    deployment = cluster.deploy("dualpath", cfg=cfg)
    actors = {**deployment.engines, **deployment.readers}
    return dict(zip(actors, ray.get([actor.env.remote(KEYS) for actor in actors.values()])))


def test_each_role_runs_with_exactly_its_variables(cluster: DualPathCluster) -> None:
    ib = environments(cluster, fabric="ib")
    assert sorted(ib) == ["decode/d0/g0", "prefill/p0/g0", "reader/d0", "reader/p0"], "every endpoint answered"
    for name, env in ib.items():
        expected = {"UCX_IB_SL": "2"} if name.startswith("reader/") else {"UCX_IB_SL": "2", "NCCL_IB_SL": "3"}
        assert env == {**UNSET, **expected}, f"{name} (InfiniBand): KV SL 2 everywhere, NCCL SL 3 in engines: {env}"

    roce = environments(cluster, fabric="roce")
    for name, env in roce.items():
        kv = {"UCX_IB_SL": "2", "UCX_IB_TRAFFIC_CLASS": "64"}
        expected = kv if name.startswith("reader/") else {**kv, "NCCL_IB_SL": "3", "NCCL_IB_TC": "104"}
        assert env == {**UNSET, **expected}, f"{name} (RoCE): DSCP << 2 in the traffic classes, priorities as SLs: {env}"

    off = environments(cluster, enabled=False)
    assert all(env == UNSET for env in off.values()), f"qos.enabled false injects nothing: {off}"
