"""Request ids of conversations (trajectories): every turn of session S is "S/t<k>", k = 0, 1, ...

The ids share the prefix "S/", the same one `rollout` gives a trajectory's turns, so the
scheduler can abort a whole conversation (`abort_prefix`) and `RolloutResult`-style tooling reads
them alike. Prefix reuse does not depend on the ids: a later turn's prompt extends the earlier
one, and the store is content-addressed, so its stored blocks are hit whichever engine serves it.
"""

from __future__ import annotations

import re
import time
import uuid
from typing import Callable

from dualpath_ray.api.validation import RequestError
from dualpath_ray.config.sections import IDLE_TTL_DEFAULT_S
from dualpath_ray.scheduling.expiry import IdleExpiry

MAX_SESSION_ID_CHARS = 128
# Ids travel in request ids, metric tags and log lines: keep them to a plain, printable set.
_SESSION_ID = re.compile(r"^[A-Za-z0-9._:@-]+$")


def check_session_id(session_id: object, field_name: str = "session_id") -> str:
    if not isinstance(session_id, str) or not session_id:
        raise RequestError(f"{field_name} must be a non-empty string (got {session_id!r})", field_name)
    if len(session_id) > MAX_SESSION_ID_CHARS or not _SESSION_ID.match(session_id):
        raise RequestError(
            f"{field_name} {session_id[:40]!r} must be at most {MAX_SESSION_ID_CHARS} characters of "
            "letters, digits and . _ : @ -", field_name,
        )
    return session_id


def session_prefix(session_id: str) -> str:
    """The request id prefix of every turn of a session (as `trajectory_prefix` for rollouts)."""
    return f"{session_id}/"


class SessionIds:
    """Per-session turn numbering; ids of requests outside any session are fresh uuids.

    A session idle for `ttl_s` (runtime.session_ttl_s: no turn in flight and none begun for
    that long) is forgotten, so the table holds only the conversations of the last `ttl_s`; one
    that comes back numbers its turns from t0 again. That is safe: none of its turns is in
    flight, and a request id served again never meets an earlier serving's state (each serving
    has its own epoch, RequestSpec.epoch). Sweeps run on every turn begun, and on `__len__`."""

    def __init__(self, ttl_s: float = IDLE_TTL_DEFAULT_S, clock: Callable[[], float] = time.monotonic) -> None:
        self.turns: dict[str, int] = {}  # session -> its next turn number
        self.active: dict[str, int] = {}  # session -> its turns in flight (a session in use never expires)
        self.idle = IdleExpiry(ttl_s, clock)

    def next_turn(self, session_id: str) -> str:
        """The request id of the session's next turn (turn numbers are never reused while the
        session is remembered, so a retried or concurrent turn never collides with one in
        flight). The turn is in flight until `turn_ended`."""
        check_session_id(session_id)
        self._sweep()
        turn = self.turns.get(session_id, 0)
        self.turns[session_id] = turn + 1
        self.active[session_id] = self.active.get(session_id, 0) + 1
        self.idle.touch(session_id)
        return f"{session_prefix(session_id)}t{turn}"

    def turn_ended(self, session_id: str) -> None:
        """A turn `next_turn` numbered ended (answered, failed or refused): the session's idle
        time runs from now once no other turn of it is in flight."""
        left = self.active.get(session_id, 0) - 1
        if left > 0:
            self.active[session_id] = left
        else:
            self.active.pop(session_id, None)
        if session_id in self.turns:
            self.idle.touch(session_id)

    def _sweep(self) -> None:
        for session_id in self.idle.sweep():
            if session_id in self.active:
                self.idle.touch(session_id)  # a turn of it is still in flight: in use now
            else:
                self.turns.pop(session_id, None)

    def __len__(self) -> int:
        """Sessions remembered (after forgetting the idle ones)."""
        self._sweep()
        return len(self.turns)

    @staticmethod
    def fresh(kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex}"

    def forget(self, session_id: str) -> None:
        self.turns.pop(session_id, None)
        self.active.pop(session_id, None)
        self.idle.discard(session_id)
