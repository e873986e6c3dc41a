"""The actor side of a transport: the endpoint mixin every endpoint actor class inherits, its
Ray options (the `transport` concurrency group), and building this process's transport.
"""

from __future__ import annotations

import os
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import ray

from dualpath_ray.runtime.transport.moves import TransportError

if TYPE_CHECKING:
    from dualpath_ray.runtime.transport.base import Transport

TRANSPORT_GROUP = "transport"
TRANSPORT_KINDS = ("nixl", "gloo", "verbs")


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


def make_transport(
    kind: str,
    endpoint_name: str,
    *,
    namespace: str,
    timeout_s: float = 60.0,
    service_level: int | None = None,
    traffic_class: int | None = None,
    ucx_tls: str | None = None,
    ucx_net_devices: str | None = None,
    verbs_settings: Any = None,
    verbs_device: str | None = None,
) -> Transport:
    """Build this process's transport; UCX knobs are applied to the process environment first.

    `verbs` (transport_verbs.py) takes its port settings from `verbs_settings` (a VerbsConfig)
    and `verbs_device`, and puts service_level / traffic_class into its queue pairs."""
    from dualpath_ray.runtime.transport.nixl import (
        apply_ucx_environment,
        ucx_environment,
    )

    if kind not in TRANSPORT_KINDS:
        raise TransportError(f"runtime.transport: unknown kind {kind!r}; use one of {TRANSPORT_KINDS}")
    if not endpoint_name:
        raise TransportError("endpoint_name must be the actor's Ray name, e.g. 'reader/n1'")
    if timeout_s <= 0:
        raise TransportError(f"timeout_s must be > 0 (got {timeout_s})")
    ucx = ucx_environment(service_level=service_level, traffic_class=traffic_class, tls=ucx_tls, net_devices=ucx_net_devices)
    apply_ucx_environment(ucx)
    if ucx:
        # The KV class knobs act only where UCX runs on an IB/RoCE device; on TCP or shared
        # memory UCX would warn at every agent start that they are unused. A user's own setting wins.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")
    if kind == "nixl":
        from dualpath_ray.runtime.transport.nixl import NixlTransport

        return NixlTransport(endpoint_name, namespace, timeout_s)
    if kind == "verbs":
        from dualpath_ray.runtime.transport.verbs import make_verbs_transport

        return make_verbs_transport(
            endpoint_name, namespace, timeout_s, settings=verbs_settings, device=verbs_device,
            service_level=service_level, traffic_class=traffic_class,
        )
    from dualpath_ray.runtime.transport.gloo import GlooTransport

    return GlooTransport(endpoint_name, namespace, timeout_s)


def setup_gloo_world(endpoints: Sequence[Any], *, timeout_s: float = 60.0) -> Any:
    """Driver side: form one gloo world over these sealed endpoint actor handles (ranks = order)."""
    from dualpath_ray.runtime.transport.gloo import form_gloo_world

    return form_gloo_world(endpoints, timeout_s=timeout_s)
