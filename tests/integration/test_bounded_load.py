"""Bounded under load, on an embedded oracle-mode 1P1D cluster with a queue limit of 4 and a
2-second session ttl: thousands of short sessions through the rollout-server leave every table
(its sessions, the scheduler's requests and abort marks) at its starting size once idle; a burst
through the OpenAI app is answered 429 with Retry-After beyond the queue; a rollout whose first
turns overflow the queue resubmits them and finishes every trajectory."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.helpers import runtime_config, trajectories, wait_until

pytest.importorskip("starlette")
pytest.importorskip("tokenizers")
httpx = pytest.importorskip("httpx2")

import ray  # noqa: E402

from dualpath_ray.api.openai_app import RETRY_AFTER_S, OpenAIEndpoint, build_app  # noqa: E402
from dualpath_ray.api.tokenizer import HFTokenizer  # noqa: E402
from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402
from tests.tokenizer_factory import train_tokenizer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]
LIMIT = 4
TTL_S = 2.0
SESSIONS = 2000
ABORTED_EVERY = 10  # every 10th session is aborted after its turn: it leaves an abort mark
BURST = 32
LONG_PROMPT = 1000  # two decode engines' 4096-token HBM hold 8 such turns: the rest wait queued


@pytest.fixture(scope="module")
def cluster(shared_cluster):
    cfg = runtime_config(mode="oracle", verify_kv=False, session_ttl_s=TTL_S).with_overrides(
        scheduler={"max_queued_turns": LIMIT}
    )
    with shared_cluster.deployed(cfg) as cluster:
        cluster.server()
        yield cluster


def tables(cluster: DualPathCluster) -> dict[str, int]:
    assert cluster.deployment is not None
    scheduler = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.TRACKED)).to_json()
    server = ray.get(cluster.server().tracked.remote())
    return {**scheduler, **{f"server_{name}": size for name, size in server.items()}}


def prompt(seed: int, tokens: int, vocab: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, vocab, tokens)]


def test_thousands_of_short_sessions_leave_every_table_as_it_started(cluster) -> None:
    server, vocab = cluster.server(), cluster.cfg.model.vocab_size
    before = tables(cluster)

    async def soak() -> list[Any]:
        slots = asyncio.Semaphore(LIMIT)  # never more in flight than the queue admits: none refused

        async def session(i: int) -> Any:
            async with slots:
                out = await server.generate.remote(f"soak-{i}", prompt(i, 8, vocab), {"max_tokens": 1}, f"soak{i}")
                if i % ABORTED_EVERY == 0:
                    await server.abort_session.remote(f"soak{i}")
                return out

        return list(await asyncio.gather(*(session(i) for i in range(SESSIONS))))

    started = time.monotonic()
    outs = asyncio.run(soak())
    took = time.monotonic() - started
    assert len(outs) == SESSIONS and all(len(out.token_ids) == 1 for out in outs), "every session's turn was served"
    during = tables(cluster)
    assert during["server_sessions"] > 0 and during["abort_marks"] > 0, (
        f"the sessions and marks of the last {TTL_S} s are remembered ({during}; the soak took {took:.1f} s)"
    )
    time.sleep(TTL_S)
    # Idle for the ttl, every table goes back to its starting size: waited for rather than read at
    # a set moment after it (a slow machine's sweep may run late); one that never shrinks hangs
    # here until the test's timeout, which fails it.
    wait_until(lambda: tables(cluster) == before, poll_s=0.2)


def test_a_burst_through_the_openai_app_is_429_with_retry_after_beyond_the_queue(cluster, tmp_path: Path) -> None:
    cfg = cluster.cfg
    train_tokenizer(cfg.model.vocab_size).save(str(tmp_path / "tokenizer.json"))  # type: ignore[attr-defined]
    app = build_app(OpenAIEndpoint(cluster.server(), HFTokenizer.from_dir(tmp_path, cfg.model.vocab_size), cfg))
    assert cluster.deployment is not None
    refused_before = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.CALLS)).queue_full

    async def burst() -> list[Any]:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://test", timeout=120) as client:
            return list(await asyncio.gather(*(
                client.post("/v1/completions", json={"model": cfg.model.model_id, "max_tokens": 4,
                                                     "prompt": prompt(i, LONG_PROMPT, cfg.model.vocab_size)})
                for i in range(BURST)
            )))

    responses = asyncio.run(burst())
    statuses = [r.status_code for r in responses]
    refused = [r for r in responses if r.status_code == 429]
    assert set(statuses) <= {200, 429}, f"every request is answered or refused as busy: {statuses}"
    assert refused and statuses.count(200) >= LIMIT, f"the queue's worth is served, the rest refused: {statuses}"
    for response in refused:
        assert response.headers.get("retry-after") == str(RETRY_AFTER_S), "a 429 says when to retry"
        assert response.json()["error"]["code"] == "queue_full", "the error names why: the queue is full"
    refused_after = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.CALLS)).queue_full
    assert refused_after - refused_before == len(refused), "each 429 is one turn the scheduler refused"


def test_a_rollout_overflowing_the_queue_resubmits_and_finishes_every_trajectory(cluster) -> None:
    assert cluster.deployment is not None
    refused_before = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.CALLS)).queue_full
    result = cluster.rollout(trajectories(count=16, turns=2, first=600, appended=20, gen=4), progress=False)
    refused = ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.CALLS)).queue_full - refused_before
    assert result.failures == {}, f"a full queue delays a trajectory, it does not fail it: {result.failures}"
    assert result.table.num_rows == 32, "every turn of every trajectory was served"
    assert refused > 0, "the 16 first turns overflowed the queue of 4, so some were refused and resubmitted"
