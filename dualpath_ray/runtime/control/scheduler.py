"""The singleton Scheduler actor (`scheduler` in the dualpath namespace).

A thin async shell: each call is received, handed to the collaborator that owns it, and
answered. Its collaborators are built in one place (runtime/control/plane.py). Callers submit
turns in batches (`submit`, from a `SchedulerClient`: api/client.py) and collect their results
with one long-poll (`collect`), or await one turn (`generate`, `generate_stream`): the front
desk (runtime/control/front_desk.py) checks and hands them to the serving
(runtime/control/serving.py), which places each attempt through the decision rounds
(runtime/control/decisions.py: the rounds the simulator runs too, event-driven and pushed) and
awaits its end (runtime/control/attempts.py). Engines tell it what a step produced in one report
(an EngineReport: handoffs taken, turns ended, streamed tokens), readers tell it their read
queues when they change (a ReaderReport), both on the report channel (runtime/reporting/channel.py:
a socket its event loop reads, not Ray calls; runtime/control/report_intake.py), and the
heartbeat watchdog (runtime/control/watchdog.py) judges who is alive. The prefix index lives in
the core (rebuilt from the store at start) and learns every persisted block from the turn
result before that result is answered, so the next turn of a trajectory always sees its
predecessor's blocks. An idle scheduler makes no call and wakes for nothing. What it knows is
read through one call, `status(StatusQuery)` (runtime/control/status.py), answered with a typed
view (runtime/telemetry/status_views.py).
"""

from __future__ import annotations

import contextlib
from typing import AsyncIterator, Mapping

import ray

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.aborts import AbortTarget
from dualpath_ray.protocol.messages import Collected, Refusal, RequestSpec, StreamDelta, TurnResult
from dualpath_ray.protocol.names import SCHEDULER
from dualpath_ray.protocol.weights import TensorSpec, WeightSource
from dualpath_ray.runtime.control.plane import COLLECT_WAIT_S, ControlPlane
from dualpath_ray.runtime.control.status import status_view
from dualpath_ray.runtime.reporting.channel import ChannelAddress
from dualpath_ray.runtime.telemetry.status_views import StatusQuery, StatusView


@ray.remote(num_cpus=0, max_concurrency=4096)
class Scheduler:
    """Named, detached singleton. `routes` maps engine names to the actors that answer for them
    (the scale harness's simulated engines); empty in every deployment. Every entry point but
    `status` and `clear_aborts` first awaits the running parts (ControlPlane.started): the
    decisions and the watchdog run, and a restarted incarnation has learnt what the engines hold
    before it serves."""

    def __init__(
        self, cfg: DualPathConfig, store_root: str | None, mode: str, routes: Mapping[str, str] | None = None,
    ) -> None:
        self.plane = ControlPlane(cfg, store_root, mode, routes)

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with it and shows it as the dashboard's repr name.
        return SCHEDULER

    async def ready(self) -> bool:
        await self.plane.started()
        return True

    async def reform_transport(self, requester: str) -> bool:
        """A restarted or broken gloo endpoint (`requester`) asks for a new world over every
        engine and reader (runtime/control/fanout.py). NIXL needs no world: True."""
        plane = self.plane
        if plane.cfg.runtime.transport != "gloo":
            return True
        formed = await plane.control.reform_gloo_world(requester)
        plane.calls.worlds_formed = plane.control.worlds_formed
        return formed

    # --- between rollouts: sleep, wake, weights from a trainer ---------------------------

    async def sleep(self) -> int:
        """Put every engine to sleep (KV memory freed, weights off the accelerator; the store
        and the index are kept). Refused while a request is in flight; while asleep, generate
        is refused with a clear error. Returns the bytes freed."""
        front = (await self.plane.started()).front
        front.require_idle("sleep")
        front.asleep = True
        return await self.plane.control.sleep()

    async def wake_up(self) -> None:
        """Wake every engine (memory allocated again, peers told to fetch its new addressing)."""
        running = await self.plane.started()
        for engine, incarnation in (await self.plane.control.wake_up()).items():
            running.watchdog.woke(engine, incarnation)
        running.front.asleep = False

    async def join_weight_group(self, host: str, port: int, group_name: str = "policy", timeout_s: float = 300.0) -> int:
        """Every engine joins a trainer's weight broadcast group (runtime/weights/sync.py) as
        ranks 1..N; the trainer joins as rank 0 beside this call. Returns the world size."""
        await self.plane.started()
        return await self.plane.control.join_weight_group(host, port, group_name, timeout_s)

    async def update_weights(self, version: int, source: WeightSource) -> int:
        """Every engine loads the weights of `source` as weight version `version`, then they are
        published (runtime/control/weight_updates.py). Refused while a request is in flight."""
        (await self.plane.started()).front.require_idle("update_weights")
        await self.plane.weight_updates.load(version, source)
        return version

    async def update_weights_from_group(self, version: int, manifest: list[TensorSpec]) -> int:
        """Every engine receives the trainer's broadcast of `manifest` (sent beside this call)
        and loads it as weight version `version`, published as update_weights does. Refused
        while a request is in flight."""
        (await self.plane.started()).front.require_idle("update_weights_from_group")
        await self.plane.weight_updates.receive(version, manifest)
        return version

    # --- turns: batched (submit + collect) and one at a time (generate) ------------------

    async def submit(self, client: str, specs: list[RequestSpec]) -> tuple[int, list[Refusal | None]]:
        """Start serving a client's turns; their results wait for its `collect`. Returns this
        incarnation's epoch and, per turn, why it was refused (None: accepted). A turn the same
        client already submitted is accepted again without a second serving (a client resubmits
        what it had in flight when it sees that the scheduler restarted)."""
        return (await self.plane.started()).front.submit(client, specs)

    async def collect(self, client: str, epoch: int | None, wait_s: float = COLLECT_WAIT_S) -> Collected:
        """The client's finished turns, as soon as there is one (or none after wait_s). A client
        that knew another epoch is answered at once: this incarnation restarted and does not
        know what it submitted before (the client submits it again)."""
        return await (await self.plane.started()).front.collect(client, epoch, wait_s)

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn: its result, or a failed result with an ErrorKind once its retries or
        its deadline (runtime.request_timeout_s) are used up. Never waits forever."""
        return await (await self.plane.started()).front.generate(spec)

    async def generate_stream(self, spec: RequestSpec) -> AsyncIterator[StreamDelta | TurnResult]:
        """`generate`, streamed (a Ray streaming generator): the output tokens as the decode
        engine samples them, as StreamDeltas in order with no token twice, then the TurnResult.
        A retried attempt streams from its first token again; sampling is seeded by (seed,
        position), so its tokens equal the ones already sent and only new positions go out. A
        chunk lost on the way is made up from the final result."""
        front = (await self.plane.started()).front
        # Closed with this generator (a reader that stops reading): its queue goes and the
        # serving is cancelled at once, not when the garbage collector finds it.
        async with contextlib.aclosing(self.plane.streams.serve(spec, front.generate)) as stream:
            async for item in stream:
                yield item

    # --- what engines and readers tell -------------------------------------------------------

    async def report_channel(self) -> ChannelAddress:
        """Where this incarnation reads engines' and readers' reports (runtime/reporting/channel.py),
        and the secret a sender proves: handed out only through this (authenticated) Ray call."""
        address = (await self.plane.started()).reports.address
        assert address is not None, "a started report server has its address"
        return address

    # --- aborts -------------------------------------------------------------------------

    async def abort(self, target: AbortTarget) -> int:
        """Stop requests now; returns how many were in flight. Each gets a result with stop
        reason `aborted` (no output), every engine holding its attempt drops it even mid-decode
        (its extents and pages freed, nothing more of it persisted), and it is not retried.
        `AbortTarget.request(id)`: that request (0 when none of that id is in flight);
        `AbortTarget.trajectory(prefix)` (e.g. "traj7/"): every turn of it in flight now, and
        every later one until `clear_aborts([prefix])`; `AbortTarget.everything()`: every
        request in flight (later ones run as usual)."""
        attempts = (await self.plane.started()).attempts
        if target.request_id is not None:
            return int(attempts.abort(target.request_id))
        if target.prefix is not None:
            return sum(attempts.abort(rid) for rid in self.plane.aborts.abort_prefix(target.prefix))
        return sum(attempts.abort(rid) for rid in sorted(self.plane.aborts.running))

    async def clear_aborts(self, prefixes: list[str] | None = None) -> None:
        """Let the requests of these aborted trajectories (all, with None) run again."""
        self.plane.aborts.clear(prefixes)

    # --- what it knows --------------------------------------------------------------------

    async def status(self, query: StatusQuery) -> StatusView:
        """The view `query` asks for (runtime/telemetry/status_views.py STATUS_VIEWS: the
        deployment, the requests in flight, the dispatcher's integrity, who is out of service,
        the call counts, the tracked tables' sizes, the recent turns' latencies)."""
        return status_view(self.plane, query)

    async def reset_prefix_cache(self) -> None:
        self.plane.core.reset_prefix_cache()
