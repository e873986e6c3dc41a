"""Which engines are alive and which attempts were lost, judged from heartbeats: pure, clock injected.

The Scheduler actor asks every engine that holds requests what it holds (`holds`, every
runtime.heartbeat_s) and feeds the answers here; this class owns every deadline of that watch
and returns verdicts the actor acts on. No Ray, no wall clock: tests drive it with a fake clock.

- An engine (or reader) that reports or answers is alive. Each beat asks only those not heard
  from since the last beat; every `sweep_s` a sweep asks all of them, since judging attempts
  needs what every engine holds (`plan`). One that does not answer is *silent*; silent for
  `grace_s` in a row, it is presumed dead (Ray reporting it dead or restarting is a death at
  once, decided by the actor, which sees Ray's error).
- An attempt is *held* while an engine names it: its prefill engine from its task's delivery
  to its handoff (the prefill engine keeps naming it while the handoff call is on its way), its
  decode engine from the handoff to the result (kept named while the result is on its way). An
  attempt queued at the scheduler (for a decode or a prefill engine) is held by the scheduler.
- An attempt no live engine names for `grace_s` is *lost* (its task or handoff died in transit,
  an engine dropped it): the actor fails it with PEER_DIED and the caller's retry runs. It is
  not judged while its task is still being delivered (the push has not been answered) or while
  an engine it depends on is silent (nothing is known either way).
- The clock of an unheld attempt is keyed by its owner (request id, attempt and epoch), so a
  retry under the same request id starts a clock of its own, and an owner that is no longer in
  flight is forgotten at the next check (nothing here grows with the requests served).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Iterable

from dualpath_ray.protocol.messages import Holding, RequestSpec
from dualpath_ray.scheduling.requests import Request, RequestState


def is_attempt(holding: Holding | None, spec: RequestSpec | None) -> bool:
    """Whether an engine's holding is the attempt `spec` now in flight."""
    return holding is not None and spec is not None and (holding.attempt, holding.epoch) == (spec.attempt, spec.epoch)


@dataclass
class Verdicts:
    """What one heartbeat round found."""

    lost: list[RequestSpec] = field(default_factory=list)  # no live engine holds them: fail and retry
    handed_off: list[str] = field(default_factory=list)  # request ids a decode engine holds: decoding


@dataclass(frozen=True)
class BeatPlan:
    """Whom one heartbeat round asks, and whether it is a sweep (attempts are judged)."""

    ask: frozenset[str]
    sweep: bool


class Liveness:
    def __init__(self, grace_s: float, clock: Callable[[], float], sweep_s: float | None = None) -> None:
        self.grace_s = grace_s
        self.clock = clock
        self.sweep_s = grace_s / 3 if sweep_s is None else sweep_s
        self._silent_since: dict[str, float] = {}  # engine -> since when it has not answered
        self._heard: dict[str, float] = {}  # engine or reader -> when it last reported or answered
        self._last_beat = float("-inf")
        self._next_sweep = float("-inf")
        self._unheld_since: dict[str, float] = {}  # attempt owner -> since when no engine names it
        self._delivering: dict[str, int] = {}  # attempt owner -> task pushes of it not answered yet

    # --- engines --------------------------------------------------------------------------

    def answered(self, name: str) -> None:
        """`name` reported or answered: alive, and heard from now."""
        self._heard[name] = self.clock()
        self._silent_since.pop(name, None)

    def plan(self, watched: set[str], always: set[str] = frozenset()) -> BeatPlan:
        """This beat: on a sweep every name `watched`, otherwise only those not heard from since
        the last beat; and `always` (engines presumed dead, asked until they answer)."""
        now = self.clock()
        sweep = now >= self._next_sweep
        if sweep:
            self._next_sweep = now + self.sweep_s
            for name in set(self._heard) - watched - always:
                del self._heard[name]  # nothing grows with names no longer watched
        since, self._last_beat = self._last_beat, now
        ask = watched if sweep else {name for name in watched if self._heard.get(name, float("-inf")) < since}
        return BeatPlan(frozenset(ask | always), sweep)

    def missed(self, engine: str) -> bool:
        """`engine` did not answer this round; True once it has been silent for grace_s (it is
        then presumed dead and its clock starts again should it stay silent after that)."""
        now = self.clock()
        since = self._silent_since.setdefault(engine, now)
        if now - since < self.grace_s:
            return False
        del self._silent_since[engine]
        return True

    def forget_engine(self, engine: str) -> None:
        """Its death or restart was dealt with: its silence counts afresh."""
        self._silent_since.pop(engine, None)

    def silent(self) -> set[str]:
        return set(self._silent_since)

    # --- deliveries -----------------------------------------------------------------------

    def sending(self, owners: Iterable[str]) -> None:
        """Tasks of these attempts are being pushed to their prefill engine."""
        for owner in owners:
            self._delivering[owner] = self._delivering.get(owner, 0) + 1

    def sent(self, owners: Iterable[str]) -> None:
        """Their push was answered (or failed): whoever holds them names them from now on."""
        for owner in owners:
            left = self._delivering.get(owner, 0) - 1
            if left > 0:
                self._delivering[owner] = left
            else:
                self._delivering.pop(owner, None)

    def in_delivery(self, owner: str) -> bool:
        return owner in self._delivering

    # --- attempts -------------------------------------------------------------------------

    def check(self, requests: Iterable[Request], held: dict[str, dict[str, Holding]], silent: set[str]) -> Verdicts:
        """One heartbeat round: `held` is what each engine that answered holds, `silent` the
        engines that did not answer (their attempts are not judged this round)."""
        now = self.clock()
        verdicts = Verdicts()
        live = set()
        for request in requests:
            spec = request.spec
            owner = spec.owner
            live.add(owner)
            if request.state.queued:
                continue  # held by the scheduler itself
            if self.in_delivery(owner) or request.decode_engine in silent or request.prefill_engine in silent:
                continue  # not known either way this round
            at_decode = held.get(request.decode_engine, {}).get(request.request_id)
            at_prefill = held.get(request.prefill_engine, {}).get(request.request_id) if request.prefill_engine else None
            if is_attempt(at_decode, spec) and at_decode.handed_off and request.state is RequestState.PREFILLING:
                verdicts.handed_off.append(request.request_id)
            if is_attempt(at_decode, spec) or is_attempt(at_prefill, spec):
                self._unheld_since.pop(owner, None)
            elif now - self._unheld_since.setdefault(owner, now) >= self.grace_s:
                verdicts.lost.append(spec)
        for owner in list(self._unheld_since):
            if owner not in live:
                del self._unheld_since[owner]
        for spec in verdicts.lost:
            self._unheld_since.pop(spec.owner, None)
        return verdicts

    def forget(self, owner: str) -> None:
        """The attempt is no longer in flight (finished, failed, aborted, timed out)."""
        self._unheld_since.pop(owner, None)

    def tracked(self) -> tuple[int, int, int]:
        """(silent engines, unheld attempts, attempts in delivery): what this object holds, for
        tests that check it returns to empty."""
        return len(self._silent_since), len(self._unheld_since), len(self._delivering)

    def heard_of(self) -> int:
        """Engines and readers whose last report or answer is remembered."""
        return len(self._heard)
