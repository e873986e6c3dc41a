"""Actor restarts: incarnations, how a silent peer is classified, and rejoining the transport.

Ray restarts a dead engine or reader (`runtime.max_actor_restarts`) by running its `__init__`
again in a new process: same name, same handle, empty state. Each process has an incarnation id;
engines and readers report theirs with every load report and heartbeat answer, and the
scheduler's `IncarnationTracker` notices a new one. That is the proof the old process is gone,
so what its attempts held is failed, retried and reclaimed, and the new incarnation takes work.

Calls queued while Ray restarts an actor reach the new incarnation, so every message that names
per-process state (an extent id of a reader's buffer) also names the incarnation that issued it,
and the new incarnation ignores the old one's.
"""

from __future__ import annotations

import logging
import threading
import time
import uuid
import warnings
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

import ray
import ray.exceptions

from dualpath_ray.protocol.messages import PeerState
from dualpath_ray.protocol.names import SCHEDULER

if TYPE_CHECKING:
    from dualpath_ray.runtime.transport.base import Transport

LOG = logging.getLogger("dualpath_ray.restarts")
_REJOIN_POLL_S = 0.05


def new_incarnation() -> str:
    return uuid.uuid4().hex[:12]


def was_restarted() -> bool:
    """Whether this actor process is a restart (Ray ran __init__ again after a death)."""
    with warnings.catch_warnings():  # Ray's property reads a deprecated attribute inside
        warnings.simplefilter("ignore", DeprecationWarning)
        return bool(ray.get_runtime_context().was_current_actor_reconstructed)


def peer_state_of(exc: BaseException) -> PeerState:
    """What an unanswered call says about its callee. A timeout is silence (slow or hung); Ray's
    ActorUnavailableError is a restart in progress (or a passing network fault): neither is a
    death. Anything else (the actor is gone for good, or its worker loop died and it refuses
    work) is."""
    if isinstance(exc, ray.exceptions.GetTimeoutError | TimeoutError):
        return PeerState.SILENT
    if isinstance(exc, ray.exceptions.ActorUnavailableError):
        return PeerState.RESTARTING
    return PeerState.DEAD


@dataclass
class IncarnationTracker:
    """The last incarnation seen of each engine and reader (pure; the scheduler feeds it)."""

    known: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    def observe(self, name: str, incarnation: str) -> bool:
        """Record `name`'s incarnation; True when it replaced a known one (the actor restarted)."""
        if not incarnation:
            return False
        previous = self.known.get(name)
        self.known[name] = incarnation
        if previous is None or previous == incarnation:
            return False
        self.restarts += 1
        return True


def rejoin_transport(transport: Transport, reform: Callable[[], Any], timeout_s: float) -> bool:
    """A restarted endpoint's transport must be usable before the actor takes work: a gloo
    endpoint asks for the world to be formed again (`reform`: the scheduler's call, which
    returns once it formed one or failed to) until its transport is READY; NIXL needs nothing
    (a peer learns the new agent from its incarnation the first time it addresses it). False if
    the transport is still not ready after timeout_s."""
    from dualpath_ray.runtime.transport.moves import PeerDiedError, TransportState

    deadline = time.monotonic() + timeout_s
    while transport.state is not TransportState.READY:
        if time.monotonic() >= deadline:
            return False
        try:
            reform()
        except (PeerDiedError, ray.exceptions.RayError) as exc:
            LOG.warning("%s: asking for a new gloo world failed, retrying: %s", transport.endpoint_name, exc)
            time.sleep(_REJOIN_POLL_S)
    return True


class TransportKeeper:
    """Keeps an endpoint's transport in a usable world: after a restart, and whenever its gloo
    world was aborted (a transfer timed out with bytes possibly still landing: BROKEN), it asks
    the scheduler for a new world, on a thread of its own, one request at a time."""

    def __init__(self, transport: Transport, namespace: str, timeout_s: float) -> None:
        self.transport = transport
        self.namespace = namespace
        self.timeout_s = timeout_s
        self.heals = 0
        self._lock = threading.Lock()
        self._healing = False
        # Cleared while a restarted endpoint rejoins (rejoin_then); set otherwise.
        self.joined = threading.Event()
        self.joined.set()
        transport.on_broken = self.heal

    def rejoin_then(self, then: Callable[[], Any]) -> None:
        """A restarted endpoint: rejoin the transport in the background, and only then run
        `then` (what makes the new incarnation known and given work). Until then `joined` is
        clear, so the endpoint can refuse what would reveal it early (`require_joined`)."""
        self.joined.clear()

        def rejoined() -> None:
            self.joined.set()
            then()

        self.heal(then=rejoined)

    def require_joined(self) -> None:
        """Refuse (TransportError) while a restarted endpoint has not rejoined the transport:
        a caller must treat it as not there yet, not as its new incarnation."""
        from dualpath_ray.runtime.transport.moves import TransportError

        if not self.joined.is_set():
            raise TransportError(f"{self.transport.endpoint_name} restarted and is rejoining the transport")

    def heal(self, then: Callable[[], Any] | None = None) -> None:
        """Rejoin in the background, then run `then` (even if the rejoin gave up: the actor must
        not sit idle for good; its transfers fail and are retried until a world forms)."""
        with self._lock:
            if self._healing:
                return
            self._healing = True
            self.heals += 1
        thread = threading.Thread(target=self._heal, args=(then,), name=f"rejoin-{self.transport.endpoint_name}", daemon=True)
        thread.start()

    def _heal(self, then: Callable[[], Any] | None) -> None:
        try:
            if not rejoin_transport(self.transport, self._reform, self.timeout_s):
                LOG.error("%s: still not in a transport world after %.0f s", self.transport.endpoint_name, self.timeout_s)
        finally:
            with self._lock:
                self._healing = False
        if then is not None:
            then()

    def _reform(self) -> Any:
        scheduler = ray.get_actor(SCHEDULER, namespace=self.namespace)
        return ray.get(scheduler.reform_transport.remote(self.transport.endpoint_name), timeout=self.timeout_s)
