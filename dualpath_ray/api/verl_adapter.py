"""verl adapter: a `RolloutReplica` whose server is the deployment's `rollout-server` actor.

Followed: verl 0.9.1 (PyPI), checked against verl-project/verl main at 1dda039 (2026-08-22):
- the server actor verl's replicas fan control out to and `LLMServerClient` sends `generate` to
  (verl/workers/rollout/vllm_rollout/vllm_async_server.py, `vLLMHttpServer`): `generate(...) ->
  TokenOutput`, `wake_up(tags)`, `sleep()`, `clear_kv_cache()`, `release_kv_cache()`,
  `resume_kv_cache()`, `abort_all_requests(reset_prefix_cache, reject_request)`,
  `resume_engine_generation()`, `open_submission_gate()`, `resume_generation()`,
  `abort_request(request_id, reset_prefix_cache)`, `set_global_steps`, `wait_for_requests_to_drain`,
  `start_profile`, `stop_profile`, `get_server_address` (the actor's methods of these names
  delegate to its `VerlServerControl`, api/verl_server.py);
- `RolloutReplica` (verl/workers/rollout/replica.py): `init_standalone()` then `launch_servers()`,
  `server_handle` (token-in/token-out actor), `server_address` (OpenAI-compatible HTTP).

DualPath is a disaggregated service deployed on its own (`DualPathCluster.deploy`, or a job on a
`dualpath cluster up` cluster), so its replica is STANDALONE only: `launch_servers` finds the
deployment's `rollout-server` by name instead of starting engines in a verl resource pool.
"""

from __future__ import annotations

import os
from typing import Any

import ray

from dualpath_ray.api.server import SERVER_NAME

DEFAULT_NAMESPACE = "dualpath"
NAMESPACE_ENV = "DUALPATH_NAMESPACE"  # which deployment a verl replica uses
REGISTRY_NAME = "dualpath"


def deployment_namespace() -> str:
    return os.environ.get(NAMESPACE_ENV, DEFAULT_NAMESPACE)


def dualpath_replica_class() -> type:
    """verl's `RolloutReplica` for a DualPath deployment (needs verl installed)."""
    try:
        from verl.workers.rollout.replica import RolloutMode, RolloutReplica
    except ImportError as exc:
        raise ImportError(f"the verl adapter's replica needs verl (pip install verl): {exc}") from exc

    class DualPathReplica(RolloutReplica):  # type: ignore[misc, valid-type]
        """A STANDALONE replica whose server is the deployment's `rollout-server`; the
        namespace comes from $DUALPATH_NAMESPACE (default "dualpath")."""

        async def init_hybrid(self, worker_group: Any) -> None:
            raise NotImplementedError(_STANDALONE_ONLY)

        async def init_hybrid_colocated(self, worker_group: Any, resource_pool: Any) -> None:
            raise NotImplementedError(_STANDALONE_ONLY)

        async def init_colocated(self, resource_pool: Any) -> None:
            raise NotImplementedError(_STANDALONE_ONLY)

        async def init_standalone(self) -> None:
            self.rollout_mode = RolloutMode.STANDALONE
            await self.launch_servers()

        async def launch_servers(self) -> None:
            namespace = deployment_namespace()
            try:
                server = ray.get_actor(SERVER_NAME, namespace=namespace)
            except ValueError:
                raise RuntimeError(
                    f"no {SERVER_NAME!r} actor in namespace {namespace!r}: deploy DualPath first "
                    "(DualPathCluster.deploy() then .server()) or set $DUALPATH_NAMESPACE"
                ) from None
            self.servers = [server]
            self._server_handle = server
            address = await server.get_server_address.remote()
            self._server_address = f"{address[0]}:{address[1]}" if address else None

    return DualPathReplica


_STANDALONE_ONLY = (
    "a DualPath replica is a disaggregated service deployed on its own: use verl's standalone "
    "rollout mode (init_standalone)"
)


def register_with_verl(name: str = REGISTRY_NAME) -> None:
    """Make `actor_rollout_ref.rollout.name=<name>` resolve to `DualPathReplica` in this process
    (verl's `RolloutReplicaRegistry`)."""
    from verl.workers.rollout.replica import RolloutReplicaRegistry

    RolloutReplicaRegistry.register(name, dualpath_replica_class)
