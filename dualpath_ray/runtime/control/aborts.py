"""What callers aborted: single requests in flight, and whole trajectories (request id prefixes).

Pure bookkeeping for the Scheduler actor. A request is aborted while its `generate` runs (an
attempt in flight or between attempts); a prefix (`"traj7/"`) aborts every request of that
trajectory in flight and refuses later ones until it is cleared, so a turn that finished just
before the abort cannot start the next turn of an aborted trajectory.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class Aborts:
    running: set[str] = field(default_factory=set)  # request ids whose generate runs
    aborted: set[str] = field(default_factory=set)  # of those, the ones their callers aborted
    prefixes: set[str] = field(default_factory=set)  # trajectories aborted for good (until cleared)
    count: int = 0

    def start(self, request_id: str) -> bool:
        """A generate begins; False when its trajectory was aborted (it must not run)."""
        if any(request_id.startswith(prefix) for prefix in self.prefixes):
            return False
        self.running.add(request_id)
        return True

    def end(self, request_id: str) -> None:
        self.running.discard(request_id)
        self.aborted.discard(request_id)

    def is_aborted(self, request_id: str) -> bool:
        return request_id in self.aborted

    def abort(self, request_id: str) -> bool:
        """Mark one running request aborted; False when none runs under that id."""
        if request_id not in self.running or request_id in self.aborted:
            return False
        self.aborted.add(request_id)
        self.count += 1
        return True

    def abort_prefix(self, prefix: str) -> list[str]:
        """Refuse later requests of `prefix`; returns the running ones to abort now."""
        if not prefix:
            raise ValueError("an abort prefix must not be empty (use abort_all to stop everything)")
        self.prefixes.add(prefix)
        return sorted(rid for rid in self.running if rid.startswith(prefix) and rid not in self.aborted)

    def clear(self, prefixes: list[str] | None = None) -> None:
        """Let requests of these prefixes (all, with None) run again."""
        if prefixes is None:
            self.prefixes.clear()
        else:
            self.prefixes.difference_update(prefixes)
