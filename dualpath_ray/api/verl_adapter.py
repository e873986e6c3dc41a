"""verl adapter: the `rollout-server` actor as verl's rollout server, and a `RolloutReplica`.

Followed: verl 0.9.1 (PyPI), checked against verl-project/verl main at 1dda039 (2026-08-22):
- the server actor verl's replicas fan control out to and `LLMServerClient` sends `generate` to
  (verl/workers/rollout/vllm_rollout/vllm_async_server.py, `vLLMHttpServer`): `generate(...) ->
  TokenOutput`, `wake_up(tags)`, `sleep()`, `clear_kv_cache()`, `release_kv_cache()`,
  `resume_kv_cache()`, `abort_all_requests(reset_prefix_cache, reject_request)`,
  `resume_engine_generation()`, `open_submission_gate()`, `resume_generation()`,
  `abort_request(request_id, reset_prefix_cache)`, `set_global_steps`, `wait_for_requests_to_drain`,
  `start_profile`, `stop_profile`, `get_server_address`;
- `RolloutReplica` (verl/workers/rollout/replica.py): `init_standalone()` then `launch_servers()`,
  `server_handle` (token-in/token-out actor), `server_address` (OpenAI-compatible HTTP).

DualPath is a disaggregated service deployed on its own (`DualPathCluster.deploy`, or a job on a
`dualpath cluster up` cluster), so its replica is STANDALONE only: `launch_servers` finds the
deployment's `rollout-server` by name instead of starting engines in a verl resource pool.
"""

from __future__ import annotations

import asyncio
import os
from typing import Any

DEFAULT_NAMESPACE = "dualpath"
NAMESPACE_ENV = "DUALPATH_NAMESPACE"  # which deployment a verl replica uses
REGISTRY_NAME = "dualpath"


class SubmissionGate:
    """Whether new requests may start: closed by verl's `abort_all_requests` until its
    `resume_generation`; a closed gate parks arrivals, or rejects them when asked to."""

    def __init__(self) -> None:
        self.opened = asyncio.Event()
        self.opened.set()
        self.rejecting = False

    def close(self, reject: bool) -> None:
        self.opened.clear()
        self.rejecting = reject

    def open(self) -> None:
        self.rejecting = False
        self.opened.set()

    async def admit(self) -> bool:
        """Wait until the gate is open; False when the closed gate rejects arrivals."""
        while not self.opened.is_set():
            if self.rejecting:
                return False
            await self.opened.wait()
        return True


class VerlServerMethods:
    """verl's server-actor control methods, on top of the `rollout-server`'s own (a mixin of
    `RolloutServer`, which provides `scheduler`, `in_flight`, `gate`, `global_steps`,
    `abort`, `abort_all`, `reset_prefix_cache`, `sleep` and `wake_up`)."""

    scheduler: Any
    in_flight: dict[str, str]
    gate: SubmissionGate
    global_steps: int | None
    http_address: tuple[str, int] | None = None

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """verl's partial rollout: close the submission gate (until `resume_generation`), abort
        every request in flight (their callers get stop_reason "aborted"), and with
        `reset_prefix_cache` forget the indexed prefix blocks, as vLLM's pause does. Requests
        arriving behind the closed gate wait for it, or with `reject_request` are answered
        "aborted" at once."""
        self.gate.close(reject_request)
        request_ids = sorted(self.in_flight)
        aborted = int(await self.scheduler.abort_all.remote())
        if reset_prefix_cache:
            await self.scheduler.reset_prefix_cache.remote()
        return {"aborted_count": aborted, "request_ids": request_ids}

    async def resume_engine_generation(self) -> None:
        """verl 0.9.1 resumes the engines before opening the gate; the engines here never
        pause (aborts stop requests, not engines), so only the gate matters."""

    async def open_submission_gate(self) -> None:
        self.gate.open()

    async def resume_generation(self) -> None:
        """Take new requests again after `abort_all_requests`; the ones that waited run now."""
        await self.resume_engine_generation()
        await self.open_submission_gate()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """Abort one request by the id its caller gave; verl's result dict."""
        aborted = await self.abort(request_id)  # type: ignore[attr-defined]
        if not aborted:
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        if reset_prefix_cache:
            await self.scheduler.reset_prefix_cache.remote()
        return {"aborted": True, "request_id": request_id}

    async def clear_kv_cache(self) -> None:
        """verl's name for resetting the prefix cache."""
        await self.reset_prefix_cache()  # type: ignore[attr-defined]

    async def release_kv_cache(self) -> None:
        """Free KV memory for a weight sync. The engines free KV memory and weights together, so
        this is `sleep`; `resume_kv_cache` wakes them."""
        await self.sleep()  # type: ignore[attr-defined]

    async def resume_kv_cache(self) -> None:
        await self.wake_up()  # type: ignore[attr-defined]

    async def wait_for_requests_to_drain(self, poll_s: float = 0.05) -> None:
        """Return once no request of this server is in flight."""
        while self.in_flight:
            await asyncio.sleep(poll_s)

    async def set_global_steps(self, global_steps: int) -> None:
        """verl's training step of the weights now served; returned in every TokenOutput's
        extra_fields["global_steps"]."""
        self.global_steps = global_steps

    async def start_profile(self, **_: Any) -> None:
        """verl's profiler hook: the runtime's own metrics (docs/metrics.md) are always on."""

    async def stop_profile(self) -> None:
        """See `start_profile`."""

    async def set_server_address(self, host: str, port: int) -> None:
        """Where the OpenAI-compatible endpoint (`dualpath serve`) of this deployment listens."""
        self.http_address = (host, int(port))

    async def get_server_address(self) -> tuple[str, int] | None:
        """The OpenAI-compatible endpoint's (host, port); None when none is serving."""
        return self.http_address


def deployment_namespace() -> str:
    return os.environ.get(NAMESPACE_ENV, DEFAULT_NAMESPACE)


def dualpath_replica_class() -> type:
    """verl's `RolloutReplica` for a DualPath deployment (needs verl installed)."""
    try:
        from verl.workers.rollout.replica import RolloutMode, RolloutReplica
    except ImportError as exc:
        raise ImportError(f"the verl adapter's replica needs verl (pip install verl): {exc}") from exc
    from dualpath_ray.api.server import SERVER_NAME

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
            import ray

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
