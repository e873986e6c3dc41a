"""Sleep and wake on the NIXL transport: an engine's memory is deregistered and freed, then
registered again at new addresses, and every peer fetches the new addressing before its next
transfer (a decode engine reads the reader's buffer, the reader pulls the decode engine's pages)."""

from __future__ import annotations

import numpy as np
import pytest
import ray

from dualpath_ray.api.validation import make_spec
from dualpath_ray.protocol.messages import SamplingParams
from tests.helpers import runtime_config

pytestmark = [pytest.mark.integration, pytest.mark.nixl]


def test_nixl_engines_sleep_and_wake_with_new_addresses(cluster_for) -> None:
    pytest.importorskip("nixl", reason="the nixl extra is not installed")
    cluster = cluster_for(runtime_config(transport="nixl", verify_kv=True), "dualpath")
    scheduler = cluster.deployment.scheduler

    def turn(rid: str, tokens: int):
        prompt = np.random.default_rng(5).integers(0, 512, tokens)
        namespace = cluster.cfg.model.kv_namespace(block_size=cluster.cfg.store.block_size)
        spec = make_spec(rid, prompt, SamplingParams(max_new_tokens=70), namespace)
        return ray.get(scheduler.generate.remote(spec))

    first = turn("n-1", 200)
    assert first.error is None, f"served before sleeping: {first.error}"
    engines = list(cluster.deployment.engines.values())
    before = ray.get([e.engine_stats.remote() for e in engines])
    assert cluster.sleep() > 0, "the engines' registered KV memory is freed"
    cluster.wake_up()
    after = ray.get([e.engine_stats.remote() for e in engines])
    assert all(a.incarnation != b.incarnation for a, b in zip(after, before)), (
        "every engine's memory is addressed under a new incarnation after waking"
    )
    again = turn("n-2", 200)
    assert again.error is None and again.output_tokens == first.output_tokens, (
        "served after waking, with KV verified byte for byte (runtime.verify_kv) through the new registrations"
    )
    assert again.hit_tokens == 192 and len(again.persisted) >= 1, (
        "hits read into the decode engine's new pages, and blocks decoded there persisted by the reader"
    )
