"""The front ends killed mid-rollout on an embedded 1P1D cluster: Ray restarts the
`rollout-server` and the `openai-server` (runtime.front_end_max_restarts), and their callers'
requests complete with the outputs of a fault-free run, which are what a single-process recompute
with the model's weights gives (tests.helpers.recompute_outputs). The rollout-server's callers are Ray
callers (verl's agent loop, the OpenRLHF adapter): their `generate` calls in flight are sent again
to the new incarnation (runtime.max_call_resends), which finds its weight version and verl state
again. The openai-server's callers are HTTP clients: the new incarnation listens on the same
port, and the `openai` client retries the requests whose connection died."""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest

from tests.helpers import ray_test_env, recompute_outputs, runtime_config

ray_test_env()

openai = pytest.importorskip("openai")
pytest.importorskip("uvicorn")
pytest.importorskip("tokenizers")

import numpy as np  # noqa: E402
import ray  # noqa: E402

from dualpath_ray.api.openai_server import start_openai_server  # noqa: E402
from dualpath_ray.api.tokenizer import HFTokenizer  # noqa: E402
from dualpath_ray.cluster import DualPathCluster  # noqa: E402
from dualpath_ray.protocol.names import OPENAI_SERVER  # noqa: E402
from dualpath_ray.workload.trace import Trajectory, Turn  # noqa: E402
from dualpath_ray.runtime.telemetry.status_views import StatusQuery  # noqa: E402
from tests.tokenizer_factory import SENTENCES, model_dir_with_tokenizer  # noqa: E402

pytestmark = [pytest.mark.integration, pytest.mark.chaos]
MODEL = "dualpath-tiny"
GREEDY = {"max_tokens": 24, "temperature": 0}
# A restart starts a new worker process that imports the API stack; on a loaded 2-core host that
# took tens of seconds (engines: over 60 s), so the callers' bound is generous.
RESTART_BOUND_S = 180.0


@pytest.fixture(scope="module")
def front_ends(tmp_path_factory):
    base = runtime_config(transport="gloo", verify_kv=False)
    model_dir = model_dir_with_tokenizer(base, tmp_path_factory.mktemp("model"))
    cfg = base.with_overrides(model={"weights_dir": str(model_dir)})
    cluster = DualPathCluster.start(cfg)
    cluster.deploy("dualpath")
    cluster.server()
    actor, url = start_openai_server(cfg, "127.0.0.1", 0)
    yield cluster, url
    ray.kill(actor, no_restart=True)
    cluster.shutdown()


def recomputed(cfg, prompts: list[list[int]], stop_token_ids: tuple[int, ...] = ()) -> list[list[int]]:
    """Each prompt's greedy GREEDY["max_tokens"] tokens by a single-process recompute with the
    served weights, cut after the first stop token (the decode engine ends a turn there)."""
    trajs = [Trajectory(f"p{i}", (Turn(tuple(p), GREEDY["max_tokens"]),)) for i, p in enumerate(prompts)]
    outputs = recompute_outputs(cfg, trajs)
    cut = []
    for i in range(len(prompts)):
        tokens = list(outputs[f"p{i}"][0])
        stops = [k for k, t in enumerate(tokens) if t in stop_token_ids]
        cut.append(tokens[: stops[0] + 1] if stops else tokens)
    return cut


def wait_in_flight(cluster: DualPathCluster, count: int, timeout_s: float = 60.0) -> None:
    """Until the scheduler serves at least `count` turns: the front end handed them on, so a
    death now leaves them in flight behind it."""
    deadline = time.monotonic() + timeout_s
    while len(ray.get(cluster.deployment.scheduler.status.remote(StatusQuery.IN_FLIGHT)).requests) < count:
        assert time.monotonic() < deadline, f"{count} turns reached the scheduler within {timeout_s} s"
        time.sleep(0.05)


def test_a_killed_rollout_server_is_restarted_and_its_callers_turns_complete(front_ends) -> None:
    cluster, _ = front_ends
    server = cluster.server()
    # Version 3 of the same tensors, read from the checkpoint directory the cluster was built from.
    ray.get(server.update_weights.remote(3, str(cluster.cfg.model.weights_dir)))
    ray.get(server.set_global_steps.remote(7))
    rng = np.random.default_rng(5)
    prompts = [[int(x) for x in rng.integers(0, 512, 150)] for _ in range(4)]
    reference = ray.get([server.generate.remote(f"ref-{i}", p, GREEDY) for i, p in enumerate(prompts)])
    assert [r.token_ids for r in reference] == recomputed(cluster.cfg, prompts), (
        "the fault-free outputs are what a single-process recompute with the served weights gives"
    )
    calls = [server.generate.remote(f"kill-{i}", p, GREEDY) for i, p in enumerate(prompts[:3])]
    calls.append(server.generate.remote("kill-3", prompts[3], GREEDY, session_id="agent-3"))
    wait_in_flight(cluster, len(calls))
    ray.kill(server, no_restart=False)
    outputs = ray.get(calls, timeout=RESTART_BOUND_S)
    assert [o.token_ids for o in outputs] == [r.token_ids for r in reference], (
        "every turn in flight at the death completes, with the fault-free output"
    )
    assert {(o.extra_fields["weight_version"], o.extra_fields["global_steps"]) for o in outputs} == {(3, 7)}, (
        "the new incarnation serves the weight version and verl step the dead one had learnt"
    )
    after = ray.get(server.generate.remote("after-0", prompts[0], GREEDY, session_id="agent-3"))
    assert after.token_ids == reference[0].token_ids, "a session's turn after the restart is served as before"
    assert ray.get(server.get_weight_version.remote()) == 3, "the weight version survived the restart"


def complete(url: str, prompt: str) -> str:
    """One completion through the real `openai` client, retrying connection errors (its backoff
    grows to 8 s a try: 12 tries outlast a restart of the server on a loaded host)."""
    client = openai.OpenAI(base_url=url, api_key="not-checked", max_retries=12, timeout=RESTART_BOUND_S)
    return str(client.completions.create(model=MODEL, prompt=prompt, **GREEDY).choices[0].text)


def test_a_killed_openai_server_listens_again_on_its_port_and_http_requests_complete(front_ends) -> None:
    cluster, url = front_ends
    prompts = [" ".join(SENTENCES[i:] + SENTENCES[:i]) for i in range(4)]
    reference = [complete(url, p) for p in prompts]
    tokenizer = HFTokenizer.from_dir(cluster.cfg.model.weights_dir, cluster.cfg.model.vocab_size)
    expected = recomputed(cluster.cfg, [tokenizer.encode(p) for p in prompts], tokenizer.stop_token_ids)
    assert reference == [tokenizer.decode(tokens) for tokens in expected], (
        "the fault-free texts are the decoding of what a single-process recompute with the served weights gives"
    )
    actor: Any = ray.get_actor(OPENAI_SERVER, namespace=cluster.cfg.runtime.namespace)
    with ThreadPoolExecutor(len(prompts)) as pool:
        requests = [pool.submit(complete, url, p) for p in prompts]
        wait_in_flight(cluster, 1)
        ray.kill(actor, no_restart=False)
        texts = [request.result(timeout=2 * RESTART_BOUND_S) for request in requests]
    assert texts == reference, "every HTTP request in flight at the death completes with the fault-free text"
    models = openai.OpenAI(base_url=url, api_key="not-checked", max_retries=0).models.list()
    assert [m.id for m in models.data] == [MODEL], "the new incarnation listens at the same URL"
