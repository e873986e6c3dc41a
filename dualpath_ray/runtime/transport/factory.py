"""Building this process's transport: `make_transport` picks the backend of a kind and applies
the process-wide knobs (UCX's environment) before any backend starts.

The factory sits above the backends: it imports them (inside the function, so a process loads
only the backend it uses, and nixl/pyverbs only where they are wanted), and no backend or the
base contract imports it back.
"""

from __future__ import annotations

import os

from dualpath_ray.config.verbs import VerbsConfig
from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import TransportError

TRANSPORT_KINDS = ("nixl", "gloo", "verbs")


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
    verbs_settings: VerbsConfig | None = None,
    verbs_device: str | None = None,
) -> Transport:
    """Build this process's transport; UCX knobs are applied to the process environment first.

    `verbs` (verbs.py) takes its port settings from `verbs_settings` (the `verbs` config section)
    and `verbs_device`, and puts service_level / traffic_class into its queue pairs."""
    _check_arguments(kind, endpoint_name, timeout_s)
    _apply_ucx_knobs(service_level, traffic_class, ucx_tls, ucx_net_devices)
    if kind == "nixl":
        from dualpath_ray.runtime.transport.nixl import NixlTransport

        return NixlTransport(endpoint_name, namespace, timeout_s)
    if kind == "verbs":
        return make_verbs_transport(
            endpoint_name, namespace, timeout_s, settings=verbs_settings, device=verbs_device,
            service_level=service_level, traffic_class=traffic_class,
        )
    from dualpath_ray.runtime.transport.gloo import GlooTransport

    return GlooTransport(endpoint_name, namespace, timeout_s)


def _check_arguments(kind: str, endpoint_name: str, timeout_s: float) -> None:
    if kind not in TRANSPORT_KINDS:
        raise TransportError(f"runtime.transport: unknown kind {kind!r}; use one of {TRANSPORT_KINDS}")
    if not endpoint_name:
        raise TransportError("endpoint_name must be the actor's Ray name, e.g. 'reader/n1'")
    if timeout_s <= 0:
        raise TransportError(f"timeout_s must be > 0 (got {timeout_s})")


def _apply_ucx_knobs(
    service_level: int | None, traffic_class: int | None, tls: str | None, net_devices: str | None
) -> None:
    """UCX reads its environment when an agent starts, so the KV class goes there before any
    backend is built (whatever the kind: a nixl agent may start later in this process)."""
    from dualpath_ray.runtime.transport.nixl import apply_ucx_environment, ucx_environment

    ucx = ucx_environment(service_level=service_level, traffic_class=traffic_class, tls=tls, net_devices=net_devices)
    apply_ucx_environment(ucx)
    if ucx:
        # The KV class knobs act only where UCX runs on an IB/RoCE device; on TCP or shared
        # memory UCX would warn at every agent start that they are unused. A user's own setting wins.
        os.environ.setdefault("UCX_WARN_UNUSED_ENV_VARS", "n")


def make_verbs_transport(
    endpoint_name: str,
    namespace: str,
    timeout_s: float,
    *,
    settings: VerbsConfig | None,
    device: str | None,
    service_level: int | None,
    traffic_class: int | None,
) -> Transport:
    """The verbs transport on pyverbs (make_transport's `verbs` kind). Without a service level
    or traffic class (qos.enabled false) queue pairs use 0, the fabric's default class."""
    from dualpath_ray.runtime.transport.verbs import VerbsTransport
    from dualpath_ray.runtime.transport.verbs_pyverbs import PyverbsLayer

    return VerbsTransport(
        endpoint_name, namespace, timeout_s, layer=PyverbsLayer(), settings=settings or VerbsConfig(),
        device=device, service_level=service_level or 0, traffic_class=traffic_class or 0,
    )
