"""verl's server-actor control methods, as an object the `rollout-server` holds.

verl's replicas call these on the server actor by name (verl 0.9.1, `vLLMHttpServer` in
verl/workers/rollout/vllm_rollout/vllm_async_server.py); `RolloutServer` (api/server.py) keeps the
names as thin methods that delegate here. The state only verl's protocol needs (the submission
gate of a partial rollout, verl's training step, the OpenAI endpoint's address) lives here; what
it needs of the server (abort, sleep, wake, the prefix cache, the requests in flight) comes
through `ServerCore`, so this module never imports the server (no import circle) and runs without
Ray (tests/unit/test_rl_api.py drives it with a fake server).
"""

from __future__ import annotations

import asyncio
from typing import Any, Mapping, Protocol


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


class ServerCore(Protocol):
    """What verl's control methods use of the `rollout-server`: its own abort, sleep, wake and
    prefix-cache reset, and its requests in flight (caller's id -> the scheduler's)."""

    @property
    def in_flight(self) -> Mapping[str, str]: ...

    async def abort(self, request_id: str) -> bool: ...

    async def abort_all(self) -> int: ...

    async def reset_prefix_cache(self) -> None: ...

    async def sleep(self, level: int = 1) -> int: ...

    async def wake_up(self, tags: list[str] | None = None) -> None: ...


class VerlServerControl:
    """verl's control methods of one `rollout-server`, and the state they keep.

    The server asks `admit` before starting a request (the gate `abort_all_requests` closes) and
    reads `global_steps` into every TokenOutput; everything else is verl calling in."""

    def __init__(self, server: ServerCore) -> None:
        self.server = server
        self.gate = SubmissionGate()
        self.global_steps: int | None = None  # verl's training step of the weights now served
        self.http_address: tuple[str, int] | None = None

    async def admit(self) -> bool:
        """Whether a new request may start now (it waits while the gate is closed); False when
        verl asked closed-gate arrivals to be rejected."""
        return await self.gate.admit()

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """verl's partial rollout: close the submission gate (until `resume_generation`), abort
        every request in flight (their callers get stop_reason "aborted"), and with
        `reset_prefix_cache` forget the indexed prefix blocks, as vLLM's pause does. Requests
        arriving behind the closed gate wait for it, or with `reject_request` are answered
        "aborted" at once."""
        self.gate.close(reject_request)
        request_ids = sorted(self.server.in_flight)
        aborted = await self.server.abort_all()
        if reset_prefix_cache:
            await self.server.reset_prefix_cache()
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
        if not await self.server.abort(request_id):
            return {"aborted": False, "request_id": request_id, "error": f"Request {request_id} not found"}
        if reset_prefix_cache:
            await self.server.reset_prefix_cache()
        return {"aborted": True, "request_id": request_id}

    async def clear_kv_cache(self) -> None:
        """verl's name for resetting the prefix cache."""
        await self.server.reset_prefix_cache()

    async def release_kv_cache(self) -> None:
        """Free KV memory for a weight sync. The engines free KV memory and weights together, so
        this is `sleep`; `resume_kv_cache` wakes them."""
        await self.server.sleep()

    async def resume_kv_cache(self) -> None:
        await self.server.wake_up()

    async def wait_for_requests_to_drain(self, poll_s: float = 0.05) -> None:
        """Return once no request of this server is in flight."""
        while self.server.in_flight:
            await asyncio.sleep(poll_s)

    def set_global_steps(self, global_steps: int) -> None:
        """verl's training step of the weights now served; returned in every TokenOutput's
        extra_fields["global_steps"]."""
        self.global_steps = global_steps

    def set_server_address(self, host: str, port: int) -> None:
        """Where the OpenAI-compatible endpoint (`dualpath serve`) of this deployment listens."""
        self.http_address = (host, int(port))

    def server_address(self) -> tuple[str, int] | None:
        """The OpenAI-compatible endpoint's (host, port); None when none is serving."""
        return self.http_address

    async def start_profile(self, **_: Any) -> None:
        """verl's profiler hook: the runtime's own metrics (docs/metrics.md) are always on."""

    async def stop_profile(self) -> None:
        """See `start_profile`."""
