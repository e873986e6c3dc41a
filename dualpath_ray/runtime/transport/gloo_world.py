"""Forming a gloo world: the driver's side (`setup_gloo_world`) and the messages it sends.

The gloo backend (gloo.py) moves bytes inside a world of endpoints; forming one is a separate,
driver-side step: ask every endpoint for its EndpointInfo (so all are sealed gloo endpoints), let
rank 0 host the rendezvous store, then tell every endpoint to join. Only Ray calls happen here, so
a driver forms worlds without importing torch or the backend; the endpoints answer the messages
in GlooTransport.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray

from dualpath_ray.runtime.transport.moves import EndpointInfo, InfoRequest, TransportError

ANSWER_GRACE_S = 5.0  # joins get this long beyond the world's own timeout before the driver gives up


@dataclass(frozen=True)
class GlooWorld:
    """A formed world: endpoint names in rank order."""

    world_id: str
    endpoints: tuple[str, ...]


@dataclass(frozen=True)
class HostStoreRequest:
    """Driver -> rank 0: host the rendezvous TCPStore of world `world_id`."""

    world_id: str
    timeout_s: float


@dataclass(frozen=True)
class StoreAddress:
    """Rank 0 -> driver: where the rendezvous store listens."""

    host: str
    port: int


@dataclass(frozen=True)
class JoinRequest:
    """Driver -> every endpoint: join world `world_id` as `rank` of `endpoints`."""

    world_id: str
    host: str
    port: int
    rank: int
    endpoints: tuple[str, ...]
    timeout_s: float


@dataclass(frozen=True)
class Joined:
    """Endpoint -> driver: it is in the world now."""

    endpoint_name: str
    rank: int


def setup_gloo_world(endpoints: Sequence[Any], *, timeout_s: float = 60.0) -> GlooWorld:
    """Driver side: form one gloo world over these sealed endpoint actor handles; rank = position in
    the list. Forming it again (an endpoint restarted) replaces each endpoint's previous world."""
    if not endpoints:
        raise TransportError("setup_gloo_world: endpoints is empty; pass every endpoint actor handle")
    world_id = uuid.uuid4().hex
    try:
        infos = ray.get([e.transport_serve.remote(InfoRequest()) for e in endpoints], timeout=timeout_s)
        names = _world_names(infos)
        address = ray.get(endpoints[0].transport_serve.remote(HostStoreRequest(world_id, timeout_s)), timeout=timeout_s)
        joins = [
            endpoint.transport_serve.remote(JoinRequest(world_id, address.host, address.port, rank, names, timeout_s))
            for rank, endpoint in enumerate(endpoints)
        ]
        ray.get(joins, timeout=timeout_s + ANSWER_GRACE_S)
    except (ray.exceptions.RayError, AssertionError) as exc:
        raise TransportError(
            "setup_gloo_world: forming the world failed (every endpoint must be a TransportEndpoint with "
            f"a sealed gloo transport): {exc}"
        ) from exc
    return GlooWorld(world_id, names)


def _world_names(infos: Sequence[object]) -> tuple[str, ...]:
    names = []
    for index, info in enumerate(infos):
        if not isinstance(info, EndpointInfo) or info.kind != "gloo":
            raise TransportError(f"setup_gloo_world: endpoints[{index}] is not a gloo endpoint ({info!r})")
        names.append(info.endpoint)
    if len(set(names)) != len(names):
        raise TransportError(f"setup_gloo_world: endpoint names are not unique: {names}")
    return tuple(names)
