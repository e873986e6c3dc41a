"""Named actors of one namespace, looked up once (a lookup is a blocking GCS call)."""

from __future__ import annotations

from typing import Any

import ray

from dualpath_ray.runtime.transport.moves import PeerDiedError


class ActorDirectory:
    """Named actors of one namespace, looked up once and cached. A handle outlives restarts of
    its actor; calls on one gone for good fail with Ray's ActorDiedError."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        """The handle of `name`; PeerDiedError when no such actor lives (any more)."""
        if name not in self._handles:
            try:
                self._handles[name] = ray.get_actor(name, namespace=self.namespace)
            except ValueError as exc:
                raise PeerDiedError(f"{name}: no live actor of that name in {self.namespace!r} ({exc})") from None
        return self._handles[name]
