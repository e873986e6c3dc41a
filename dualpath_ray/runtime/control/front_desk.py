"""Where callers' turns come in: batched (`submit`, answered through `collect`) or one at a
time (`generate`), each checked before it is served (a duplicate of a turn in flight, a turn
while the engines sleep) and handed to the serving (runtime/control/serving.py).

A batched turn's result waits in its client's mailbox (runtime/control/mailboxes.py) until the
client's next `collect`; a client that resubmits what it had in flight (it saw the scheduler
restart) is not served twice.
"""

from __future__ import annotations

import asyncio
import logging

from dualpath_ray.protocol.messages import Collected, ErrorKind, Refusal, RequestSpec, TurnResult, failed_result
from dualpath_ray.protocol.names import SCHEDULER
from dualpath_ray.runtime.control.aborts import Aborts
from dualpath_ray.runtime.control.adoption import Adoptions
from dualpath_ray.runtime.control.mailboxes import Mailboxes
from dualpath_ray.runtime.control.serving import Serving
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.scheduling.scheduler import SchedulerCore

LOG = logging.getLogger("dualpath_ray.scheduler")


class FrontDesk:
    def __init__(
        self, core: SchedulerCore, serving: Serving, aborts: Aborts, adoptions: Adoptions, mailboxes: Mailboxes,
        calls: SchedulerCounts,
    ) -> None:
        self.core = core
        self.serving = serving
        self.aborts = aborts
        self.adoptions = adoptions
        self.mailboxes = mailboxes
        self.calls = calls
        self.asleep = False  # the engines sleep (Scheduler.sleep): turns are refused until they wake
        self.clients: dict[str, str] = {}  # request id -> the client that submitted it (submit/collect)

    def require_idle(self, what: str) -> None:
        """Raise unless no request is in flight (sleep and weight updates run between rollouts)."""
        if self.aborts.running or self.core.requests:
            raise RuntimeError(
                f"{what} with {len(self.aborts.running)} requests in flight; call it between rollouts "
                "(abort_all() first to stop them)"
            )

    def _refusal(self, spec: RequestSpec) -> Refusal | None:
        if spec.request_id in self.aborts.running or spec.request_id in self.adoptions.waiting:
            return Refusal.DUPLICATE
        if self.asleep:
            return Refusal.ASLEEP
        return None

    def submit(self, client: str, specs: list[RequestSpec]) -> tuple[int, list[Refusal | None]]:
        """Start serving a client's turns (see Scheduler.submit)."""
        self.calls.submit += 1
        refusals: list[Refusal | None] = []
        for spec in specs:
            if self.clients.get(spec.request_id) == client:
                refusals.append(None)
                continue
            refusal = self._refusal(spec)
            refusals.append(refusal)
            if refusal is None:
                self.clients[spec.request_id] = client
                asyncio.get_running_loop().create_task(self._serve_for(client, spec))
        return self.core.epoch, refusals

    async def _serve_for(self, client: str, spec: RequestSpec) -> None:
        try:
            result = await self.serving.generate(spec)
        except Exception as exc:  # noqa: BLE001 - a bug must reach the caller, not hang it
            LOG.exception("serving %s failed", spec.request_id)
            result = failed_result(spec, SCHEDULER, exc, ErrorKind.INTERNAL)
        finally:
            self.clients.pop(spec.request_id, None)
        self.mailboxes.deliver(client, result)

    async def collect(self, client: str, epoch: int | None, wait_s: float) -> Collected:
        """The client's finished turns (see Scheduler.collect)."""
        self.calls.collect += 1
        if epoch is not None and epoch != self.core.epoch:
            return Collected(self.core.epoch)
        results = await self.mailboxes.collect(client, wait_s)
        return Collected(self.core.epoch, tuple(results))

    async def generate(self, spec: RequestSpec) -> TurnResult:
        """Serve one turn, refused at once (raising) when it is a duplicate or the engines sleep."""
        refusal = self._refusal(spec)
        if refusal is not None:
            raise refusal.error(spec.request_id)
        return await self.serving.generate(spec)
