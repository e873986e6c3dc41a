"""The front end trainers talk to (`rollout-server`, a named async actor): token-in/token-out
generation, streaming, abort, sleep and wake, weight updates and the prefix cache.

Every adapter goes through this one actor: verl's agent loop uses it as its server handle (the
verl method names delegate to its `VerlServerControl`, api/verl_server.py), OpenRLHF's engine
actor and the OpenAI endpoint call it. It owns the weight version that names the KV namespace of
new requests, so a version moved here (by a weight update through any adapter, or by
`DualPathCluster.update_weights`) holds for all of them, and KV of an old policy is never served.
Cluster-wide control fans out through the Scheduler, the one actor every process can reach.

Ray restarts it when its process dies (runtime.front_end_max_restarts) and sends the calls that
were in flight again (runtime.max_call_resends), so a caller's `generate` completes on the new
incarnation. What the dead one learnt (weight version, verl's step and gate, the HTTP address)
comes back from its kept record (runtime/restarts/kept_state.py); session turn numbers start
again from t0, as after an idle expiry (api/sessions.py). A resent turn the dead incarnation had
submitted is still in flight at the scheduler under its id: the new incarnation waits for that
serving to end and submits it again, so the caller gets its own turn's result.
"""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, AsyncIterator, Mapping, Sequence

import ray
from pydantic import BaseModel

from dualpath_ray.api.client import SchedulerClient
from dualpath_ray.api.server_record import ServerRecord
from dualpath_ray.api.sessions import SessionIds, check_session_id, session_prefix
from dualpath_ray.api.validation import (
    RequestError, check_verl_kwargs, make_spec, parse_sampling_request, salt_namespace, validate_prompt,
    with_request_seed,
)
from dualpath_ray.api.verl_server import VerlServerControl
from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.aborts import AbortTarget
from dualpath_ray.protocol.messages import RequestSpec, StreamDelta, TurnResult, aborted_result
from dualpath_ray.protocol.names import ROLLOUT_SERVER, SCHEDULER
from dualpath_ray.protocol.weights import WeightSource
from dualpath_ray.runtime.restarts.kept_state import KeptState
from dualpath_ray.runtime.weights.ledger import WeightLedger
from dualpath_ray.runtime.restarts.incarnations import was_restarted
from dualpath_ray.runtime.telemetry.status_views import StatusQuery
from dualpath_ray.protocol.types import StopReason

SERVER_NAME = ROLLOUT_SERVER
# How often a restarted server asks again to submit a turn its dead incarnation left in flight.
INHERITED_TURN_POLL_S = 0.2


class TokenOutput(BaseModel):
    """verl's TokenOutput (verl/workers/rollout/replica.py, verl 0.9.1): the generated ids,
    their log-probs (None unless asked for), and why generation stopped ("completed",
    "aborted"). `extra_fields` adds how the turn was served; `finish_reason` there is OpenAI's
    ("stop", "length", "abort")."""

    token_ids: list[int]
    log_probs: list[float] | None = None
    routed_experts: Any = None
    stop_reason: str | None = None
    num_preempted: int | None = None
    extra_fields: dict[str, Any] = {}


class GenerationError(RuntimeError):
    """A turn the cluster could not serve after its retries; `kind` is its ErrorKind value
    ("queue_full": the scheduler's queue was full and nothing of it ran; submit it again later)."""

    def __init__(self, request_id: str, result: TurnResult) -> None:
        self.kind = result.error_kind.value if result.error_kind is not None else "error"
        super().__init__(f"request {request_id} failed ({self.kind}): {result.error}")

    def __reduce__(self) -> tuple[Any, ...]:
        # Ray pickles it to the caller, who reads `kind` (the OpenAI endpoint's 429): rebuilt
        # from its message and kind, as the constructor's TurnResult is not kept.
        return (_generation_error, (str(self), self.kind))


def _generation_error(message: str, kind: str) -> GenerationError:
    """A GenerationError unpickled (see GenerationError.__reduce__)."""
    error = GenerationError.__new__(GenerationError)
    RuntimeError.__init__(error, message)
    error.kind = kind
    return error


def finish_reason(stop: StopReason) -> str:
    """OpenAI's finish_reason of a stop reason."""
    if stop is StopReason.ABORTED:
        return "abort"
    return "stop" if stop is StopReason.STOP else "length"


def check_version(version: object) -> int:
    if isinstance(version, bool) or not isinstance(version, int) or version < 0:
        raise RequestError(f"weight version must be an int >= 0 (got {version!r})", "version")
    return version


@ray.remote(num_cpus=0, max_concurrency=4096)
class RolloutServer:
    """Token-in/token-out server in front of the scheduler; see the module docstring."""

    def __init__(self, cfg: DualPathConfig) -> None:
        self.cfg = cfg
        self.weight_version = cfg.model.weight_version
        self.scheduler = ray.get_actor(SCHEDULER, namespace=cfg.runtime.namespace)
        # Turns go to the scheduler batched (api/client.py); made on first use, on this actor's loop.
        self.client: SchedulerClient | None = None
        self.sessions = SessionIds(cfg.runtime.session_ttl_s, time.monotonic)  # idle ones expire
        self.in_flight: dict[str, str] = {}  # caller's request id -> the scheduler's
        # verl's control methods and their state (the submission gate, verl's global steps).
        self.verl = VerlServerControl(self)
        self.record = ServerRecord(KeptState(cfg.runtime.namespace, SERVER_NAME))
        self.ledger = WeightLedger(cfg.runtime.namespace)
        self.restarted = was_restarted()
        if self.restarted:
            self.weight_version = self.record.restore(self.weight_version, self.verl)
            # What the engines hold wins over the kept record (its predecessor may have died first).
            published = self.ledger.current()
            if published is not None:
                self.weight_version = published.weights.version
        else:
            self._keep()  # replaces any record a crashed deployment left in this namespace

    def _keep(self) -> None:
        """Save what a restarted incarnation must find again (after every change of it)."""
        self.record.save(self.weight_version, self.verl)

    # --- generation ---------------------------------------------------------------------

    def _prepare(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | None,
        session_id: str | None, expect_next_turn_s: float | None = None, cache_salt: str | None = None,
    ) -> tuple[RequestSpec, bool]:
        """The scheduler's spec of one turn, and whether log-probs were asked for."""
        if not isinstance(request_id, str) or not request_id:
            raise RequestError(f"request_id must be a non-empty string (got {request_id!r})", "request_id")
        parsed = parse_sampling_request(request_id, with_request_seed(sampling_params), self.cfg.runtime.max_new_tokens)
        prompt = validate_prompt(request_id, prompt_ids, parsed.params.max_new_tokens, self.cfg.model)
        namespace = salt_namespace(self.cfg.kv_namespace(self.weight_version), cache_salt)  # a bad salt counts no turn
        if request_id in self.in_flight:
            raise RequestError(f"request {request_id} is already in flight; request ids must be unique", "request_id")
        scheduler_id = self.sessions.next_turn(check_session_id(session_id)) if session_id is not None else request_id
        try:
            spec = make_spec(scheduler_id, prompt, parsed.params, namespace, expect_next_turn_s=expect_next_turn_s)
        except ValueError as exc:
            raise RequestError(f"request {request_id}: {exc}", "expect_next_turn_s") from None
        return spec, parsed.want_log_probs

    def _token_output(self, result: TurnResult, want_log_probs: bool) -> TokenOutput:
        aborted = result.stop_reason is StopReason.ABORTED
        return TokenOutput(
            token_ids=list(result.output_tokens),
            log_probs=list(result.log_probs) if want_log_probs else None,
            stop_reason="aborted" if aborted else "completed",
            num_preempted=0,
            extra_fields={
                "request_id": result.request_id, "finish_reason": finish_reason(result.stop_reason),
                "prompt_tokens": result.prompt_tokens, "hit_tokens": result.hit_tokens, "path": str(result.path),
                "prefill_engine": result.prefill_engine, "decode_engine": result.decode_engine,
                "ttft_s": result.ttft_s, "tpot_s": result.tpot_s, "weight_version": self.weight_version,
                "global_steps": self.verl.global_steps,
            },
        )

    async def generate(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None, expect_next_turn_s: float | None = None, cache_salt: str | None = None,
        **kwargs: Any,
    ) -> TokenOutput:
        """One turn. `session_id` puts it on its conversation's request ids ("<session>/t<k>"), so
        `abort_session` stops the conversation; `expect_next_turn_s` hints that the session's next
        turn comes about that many seconds after this one ends (an agent's tool call), and its KV is
        staged meanwhile (scheduling/staging.py); `cache_salt` shares cached prefixes only with turns of
        the same salt; verl's keyword arguments (`image_data`, ..., `priority`) are accepted when empty."""
        check_verl_kwargs(request_id, kwargs)
        spec, want_log_probs = self._prepare(request_id, prompt_ids, sampling_params, session_id, expect_next_turn_s,
                                             cache_salt)
        try:
            if not await self.verl.admit():
                return self._token_output(aborted_result(spec), want_log_probs)
            self.in_flight[request_id] = spec.request_id
            result = await self._serve(spec)
        finally:
            self.in_flight.pop(request_id, None)
            self._turn_ended(session_id)
        if result.error:
            raise GenerationError(request_id, result)
        return self._token_output(result, want_log_probs)

    async def _serve(self, spec: RequestSpec) -> TurnResult:
        """The scheduler's result of one turn. A restarted server's client has a new name, so the
        scheduler refuses (ValueError) a turn the dead incarnation submitted while it still runs:
        wait for that serving to end, then submit again (up to runtime.request_timeout_s)."""
        if self.client is None:
            self.client = SchedulerClient(self.scheduler, name=f"rollout-server-{uuid.uuid4().hex[:8]}")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.cfg.runtime.request_timeout_s
        while True:
            try:
                return await self.client.generate(spec)
            except ValueError:
                if not self.restarted or loop.time() > deadline:
                    raise
            await asyncio.sleep(INHERITED_TURN_POLL_S)

    async def generate_stream(
        self, request_id: str, prompt_ids: Sequence[int], sampling_params: Mapping[str, Any] | None = None,
        session_id: str | None = None, expect_next_turn_s: float | None = None, cache_salt: str | None = None,
    ) -> AsyncIterator[StreamDelta | TokenOutput]:
        """`generate`, streamed (a Ray streaming generator): StreamDeltas in order, no token
        twice, then the TokenOutput of the whole turn."""
        spec, want_log_probs = self._prepare(request_id, prompt_ids, sampling_params, session_id, expect_next_turn_s,
                                             cache_salt)
        try:
            if not await self.verl.admit():
                yield self._token_output(aborted_result(spec), want_log_probs)
                return
            self.in_flight[request_id] = spec.request_id
            async for ref in self.scheduler.generate_stream.remote(spec):
                item = await ref
                if isinstance(item, StreamDelta):
                    yield item
                    continue
                if item.error:
                    raise GenerationError(request_id, item)
                yield self._token_output(item, want_log_probs)
        finally:
            self.in_flight.pop(request_id, None)
            self._turn_ended(session_id)

    def _turn_ended(self, session_id: str | None) -> None:
        """A session's turn is no longer in flight: its idle time (runtime.session_ttl_s) runs."""
        if session_id is not None:
            self.sessions.turn_ended(session_id)

    async def tracked(self) -> dict[str, int]:
        """Sizes of the tables this actor keeps per caller: conversations remembered (idle ones
        forgotten after runtime.session_ttl_s) and requests in flight (a soak test checks both
        return to their starting size)."""
        return {"sessions": len(self.sessions), "in_flight": len(self.in_flight)}

    # --- abort ----------------------------------------------------------------------------

    async def abort(self, request_id: str) -> bool:
        """Abort one request in flight (by the id its caller gave); its caller gets stop reason
        "aborted", its extents and pages are freed. False when it is not in flight."""
        return bool(await self.scheduler.abort.remote(AbortTarget.request(self.in_flight.get(request_id, request_id))))

    async def abort_session(self, session_id: str) -> int:
        """Abort a conversation: its turn in flight and every later one, until
        `resume_session`. Returns how many turns were in flight."""
        return int(await self.scheduler.abort.remote(AbortTarget.trajectory(session_prefix(check_session_id(session_id)))))

    async def resume_session(self, session_id: str) -> None:
        """Let an aborted conversation take turns again."""
        await self.scheduler.clear_aborts.remote([session_prefix(check_session_id(session_id))])

    async def abort_all(self) -> int:
        """Abort every request in flight in the cluster; returns how many."""
        return int(await self.scheduler.abort.remote(AbortTarget.everything()))

    # --- sleep and weights ---------------------------------------------------------------

    async def sleep(self, level: int = 1) -> int:
        """Every engine releases its KV memory and weights (the store and index are kept);
        refused while requests run. Returns the bytes freed. `level` (vLLM's) is accepted as
        1 or 2: both release everything; the weights come back from host memory on wake."""
        if level not in (1, 2):
            raise RequestError(f"sleep level must be 1 or 2 (got {level!r})", "level")
        return int(await self.scheduler.sleep.remote())

    async def wake_up(self, tags: list[str] | None = None) -> None:
        """Every engine restores its weights and KV memory. vLLM's `tags` are accepted as None,
        ["weights"] or ["kv_cache"] or both: the engines restore both at once."""
        unknown = set(tags or ()) - {"weights", "kv_cache"}
        if unknown:
            raise RequestError(f"wake_up tags {sorted(unknown)} are unknown; use 'weights' and/or 'kv_cache'", "tags")
        await self.scheduler.wake_up.remote()

    async def update_weights(self, version: int, source: Any) -> int:
        """New weights on every engine from a safetensors directory or a state dict (put once in
        the object store), then later requests use `version`'s KV namespace."""
        check_version(version)
        if isinstance(source, (str, os.PathLike)):
            weights = WeightSource(checkpoint=os.fspath(source))
        else:
            weights = WeightSource(state=source if isinstance(source, ray.ObjectRef) else ray.put(dict(source)))
        await self.scheduler.update_weights.remote(version, weights)
        self.weight_version = version
        self._keep()
        return version

    async def weight_group_world_size(self) -> int:
        """The world size of a trainer's weight group: the trainer (rank 0) plus every engine."""
        return len((await self.scheduler.status.remote(StatusQuery.DEPLOYMENT)).engines) + 1

    async def join_weight_group(self, host: str, port: int, group_name: str = "policy", timeout_s: float = 300.0) -> int:
        """Every engine joins the trainer's broadcast group as ranks 1..N (the trainer joins as
        rank 0 beside this call: runtime/weights/sync.py). Returns the world size."""
        return int(await self.scheduler.join_weight_group.remote(host, port, group_name, timeout_s))

    async def update_weights_from_group(self, version: int, manifest: list[Any]) -> int:
        """Every engine receives the trainer's broadcast of `manifest` (sent beside this call) and
        loads it; then later requests use `version`'s KV namespace."""
        check_version(version)
        await self.scheduler.update_weights_from_group.remote(version, list(manifest))
        self.weight_version = version
        self._keep()
        return version

    async def update_weight_version(self, version: int) -> int:
        """Move later requests to `version`'s KV namespace once the engines hold it (loaded through
        the scheduler, e.g. by `DualPathCluster.update_weights`); refused for any other version,
        which every engine would refuse (runtime/engine/held_weights.py)."""
        check_version(version)
        published = self.ledger.current()
        if published is not None and published.weights.version != version:
            raise RequestError(
                f"weight version {version} is not the one the engines hold ({published.weights.version}); load it "
                "with update_weights or update_weights_from_group, which move the version too", "version",
            )
        self.weight_version = version
        self._keep()
        return version

    async def get_weight_version(self) -> int:
        return self.weight_version

    async def reset_prefix_cache(self) -> None:
        """Forget every indexed block: no later request hits KV stored before."""
        await self.scheduler.reset_prefix_cache.remote()

    # --- verl's control methods (called by name on this actor; api/verl_server.py) ----------

    async def abort_all_requests(self, reset_prefix_cache: bool = True, reject_request: bool = False) -> dict[str, Any]:
        """verl's partial rollout: abort everything in flight and hold new requests until
        `resume_generation` (see `VerlServerControl.abort_all_requests`)."""
        try:
            return await self.verl.abort_all_requests(reset_prefix_cache, reject_request)
        finally:
            self._keep()  # the gate closed

    async def resume_engine_generation(self) -> None:
        await self.verl.resume_engine_generation()

    async def open_submission_gate(self) -> None:
        await self.verl.open_submission_gate()
        self._keep()

    async def resume_generation(self) -> None:
        """Take new requests again after `abort_all_requests`."""
        await self.verl.resume_generation()
        self._keep()

    async def abort_request(self, request_id: str, reset_prefix_cache: bool = True) -> dict[str, Any]:
        """`abort`, with verl's result dict."""
        return await self.verl.abort_request(request_id, reset_prefix_cache)

    async def clear_kv_cache(self) -> None:
        await self.verl.clear_kv_cache()

    async def release_kv_cache(self) -> None:
        await self.verl.release_kv_cache()

    async def resume_kv_cache(self) -> None:
        await self.verl.resume_kv_cache()

    async def wait_for_requests_to_drain(self, poll_s: float = 0.05) -> None:
        await self.verl.wait_for_requests_to_drain(poll_s)

    async def set_global_steps(self, global_steps: int) -> None:
        self.verl.set_global_steps(global_steps)
        self._keep()

    async def start_profile(self, **_: Any) -> None:
        await self.verl.start_profile(**_)

    async def stop_profile(self) -> None:
        await self.verl.stop_profile()

    async def set_server_address(self, host: str, port: int) -> None:
        """Called by the OpenAI endpoint (api/openai_server.py) once it listens."""
        self.verl.set_server_address(host, port)
        self._keep()

    async def get_server_address(self) -> tuple[str, int] | None:
        return self.verl.server_address()
