"""The actor side of a transport: the endpoint mixin every endpoint actor class inherits and its
Ray options (the `transport` concurrency group). Building the transport is factory.py's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import ray

from dualpath_ray.runtime.transport.base import TRANSPORT_GROUP, Transport
from dualpath_ray.runtime.transport.moves import TransportError


class TransportEndpoint:
    """Mixin for endpoint actor classes: lets a peer's transport call into this actor."""

    _endpoint_transport: Transport | None = None

    def attach_transport(self, transport: Transport) -> Transport:
        """Install this actor's transport; its endpoint name must be the actor's Ray name."""
        actor_name = ray.get_runtime_context().get_actor_name()
        if actor_name and actor_name != transport.endpoint_name:
            raise TransportError(
                f"endpoint name {transport.endpoint_name!r} differs from the actor's Ray name "
                f"{actor_name!r}; peers find endpoints by name, so make them equal"
            )
        self._endpoint_transport = transport
        return transport

    @ray.method(concurrency_group=TRANSPORT_GROUP)
    def transport_serve(self, request: object) -> object:
        if self._endpoint_transport is None:
            raise TransportError("this endpoint has no transport; call attach_transport in __init__")
        return self._endpoint_transport.serve(request)


def endpoint_actor_options(
    transport_threads: int = 8, extra_concurrency_groups: Mapping[str, int] | None = None
) -> dict[str, Any]:
    """Options for ``@ray.remote(**...)`` on an endpoint class: the transport group and yours."""
    if transport_threads < 1:
        raise TransportError(f"transport_threads must be >= 1 (got {transport_threads})")
    return {"concurrency_groups": {TRANSPORT_GROUP: transport_threads, **(extra_concurrency_groups or {})}}
