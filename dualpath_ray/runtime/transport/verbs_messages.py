"""What verbs endpoints tell each other: the addressing a sealed endpoint publishes, and the
three requests of a connection's life that travel through the Ray actors (`transport_serve`)."""

from __future__ import annotations

from dataclasses import dataclass

from dualpath_ray.runtime.transport.verbs_layer import QpAddress


@dataclass(frozen=True)
class VerbsPool:
    name: str
    address: int
    length: int
    rkey: int


@dataclass(frozen=True)
class VerbsEndpoint:
    """`EndpointInfo.backend` of a verbs endpoint."""

    device: str
    port: int
    lid: int
    gid: str
    link_layer: str
    pools: tuple[VerbsPool, ...]


@dataclass(frozen=True)
class ConnectRequest:
    """Initiator -> peer: make a queue pair connected to mine and tell me its address."""

    initiator: str
    incarnation: str
    address: QpAddress


@dataclass(frozen=True)
class ConnectReply:
    incarnation: str
    address: QpAddress


@dataclass(frozen=True)
class DisconnectRequest:
    """Initiator -> peer: my side of this connection failed; drop yours (qp_num is yours)."""

    initiator: str
    qp_num: int
