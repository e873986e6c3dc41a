"""Request ids of conversations (trajectories): every turn of session S is "S/t<k>", k = 0, 1, ...

The ids share the prefix "S/", the same one `rollout` gives a trajectory's turns, so the
scheduler can abort a whole conversation (`abort_prefix`) and `RolloutResult`-style tooling reads
them alike. Prefix reuse does not depend on the ids: a later turn's prompt extends the earlier
one, and the store is content-addressed, so its stored blocks are hit whichever engine serves it.
"""

from __future__ import annotations

import re
import uuid
from dataclasses import dataclass, field

from dualpath_ray.api.validation import RequestError

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


@dataclass
class SessionIds:
    """Per-session turn numbering; ids of requests outside any session are fresh uuids."""

    turns: dict[str, int] = field(default_factory=dict)

    def next_turn(self, session_id: str) -> str:
        """The request id of the session's next turn (turn numbers are never reused, so a
        retried or concurrent turn never collides with one in flight)."""
        check_session_id(session_id)
        turn = self.turns.get(session_id, 0)
        self.turns[session_id] = turn + 1
        return f"{session_prefix(session_id)}t{turn}"

    @staticmethod
    def fresh(kind: str) -> str:
        return f"{kind}-{uuid.uuid4().hex}"

    def forget(self, session_id: str) -> None:
        self.turns.pop(session_id, None)
