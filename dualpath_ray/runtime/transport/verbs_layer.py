"""The verbs layer: the few ibverbs operations the pyverbs transport uses, behind one interface.

transport_verbs.py talks to RDMA hardware only through `VerbsLayer`, so its logic (memory
registration, connection set-up, doorbell batching, completion handling) runs unchanged against
the real implementation on pyverbs (verbs_pyverbs.py) and against a fake in the tests that
checks every posted work request and queue-pair attribute and moves the bytes itself.

Handles (context, PD, MR, CQ, QP) are opaque objects owned by the layer. Queue pairs are RC
(reliable connected) and move RESET -> INIT -> RTR -> RTS through `modify_to_*`; the path of
RTR (the address vector) carries the service level and, with a GRH, the traffic class, which is
how the KV class of runtime/placement/qos.py reaches the wire. `post_send` posts a whole chain of work
requests with one ibv_post_send call: the NIC's doorbell is rung once for the chain.
"""

from __future__ import annotations

import enum
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass

from dualpath_ray.runtime.transport.moves import TransportError

LINK_INFINIBAND = "InfiniBand"
LINK_ETHERNET = "Ethernet"  # RoCE: every path needs a GRH (is_global)


class VerbsError(TransportError):
    """An ibverbs call failed, or no RDMA device is usable here."""


class WorkOp(str, enum.Enum):
    RDMA_READ = "rdma_read"  # remote bytes -> local
    RDMA_WRITE = "rdma_write"  # local bytes -> remote


@dataclass(frozen=True)
class PortAttributes:
    lid: int  # InfiniBand local identifier (0 on RoCE)
    link_layer: str  # LINK_INFINIBAND or LINK_ETHERNET
    active: bool


@dataclass(frozen=True)
class MemoryKeys:
    """A registered memory region: where it is and the keys that address it."""

    address: int
    length: int
    lkey: int
    rkey: int


@dataclass(frozen=True)
class QpAddress:
    """What the other side of an RC connection needs: queue pair number, port LID, GID and the
    first packet sequence number this queue pair sends."""

    qp_num: int
    lid: int
    gid: str
    psn: int


@dataclass(frozen=True)
class PathAttributes:
    """INIT -> RTR: the remote queue pair and the path to it (the address vector)."""

    remote: QpAddress
    port: int
    gid_index: int
    is_global: bool  # a GRH on every packet: always on RoCE
    service_level: int  # IB SL (VL by the SL2VL table) / Ethernet priority on RoCE
    traffic_class: int  # GRH traffic class byte (DSCP << 2 on RoCE); only sent with a GRH
    path_mtu: int  # bytes
    max_dest_rd_atomic: int  # RDMA reads the remote side may have outstanding at this one
    min_rnr_timer: int = 12


@dataclass(frozen=True)
class SendAttributes:
    """RTR -> RTS: this queue pair's send side."""

    psn: int
    max_rd_atomic: int
    timeout: int = 14  # 4.096 us * 2**timeout before a retry
    retry_count: int = 7
    rnr_retry: int = 7


@dataclass(frozen=True)
class WorkRequest:
    """One RDMA READ or WRITE between a local and a remote registered range."""

    wr_id: int
    op: WorkOp
    local_address: int
    length: int
    lkey: int
    remote_address: int
    rkey: int
    signaled: bool  # only the last request of a batch asks for a completion


@dataclass(frozen=True)
class Completion:
    wr_id: int
    ok: bool
    status: str  # "success" or the ibverbs status name


class VerbsLayer(ABC):
    """The ibverbs operations of one process. Callers serialise calls on one CQ or QP."""

    @abstractmethod
    def device_names(self) -> list[str]:
        """Names of the RDMA devices here (ibv_get_device_list); VerbsError if none is usable."""

    @abstractmethod
    def open_context(self, device: str) -> object: ...

    @abstractmethod
    def query_port(self, context: object, port: int) -> PortAttributes: ...

    @abstractmethod
    def query_gid(self, context: object, port: int, index: int) -> str: ...

    @abstractmethod
    def alloc_pd(self, context: object) -> object: ...

    @abstractmethod
    def register_mr(self, pd: object, address: int, length: int) -> tuple[object, MemoryKeys]:
        """Register [address, address + length) for local write and remote read and write."""

    @abstractmethod
    def create_cq(self, context: object, depth: int) -> object: ...

    @abstractmethod
    def create_qp(self, pd: object, cq: object, send_depth: int) -> tuple[object, int]:
        """An RC queue pair in RESET whose send completions go to `cq`, with room for
        `send_depth` outstanding work requests and a completion only for signaled ones; returns
        (queue pair, its number)."""

    @abstractmethod
    def modify_to_init(self, qp: object, port: int) -> None:
        """RESET -> INIT on `port`, allowing remote reads and writes of this PD's regions."""

    @abstractmethod
    def modify_to_rtr(self, qp: object, path: PathAttributes) -> None: ...

    @abstractmethod
    def modify_to_rts(self, qp: object, send: SendAttributes) -> None: ...

    @abstractmethod
    def modify_to_error(self, qp: object) -> None:
        """Any state -> ERR: nothing more is sent or accepted; outstanding requests are flushed."""

    @abstractmethod
    def post_send(self, qp: object, chain: Sequence[WorkRequest]) -> None:
        """Post the chain as linked work requests with one ibv_post_send: one doorbell."""

    @abstractmethod
    def poll_cq(self, cq: object, max_entries: int) -> list[Completion]: ...

    @abstractmethod
    def close(self, handle: object) -> None:
        """Destroy a QP, MR, CQ, PD or context."""


_NO_DEVICE = (
    "runtime.transport: verbs needs an RDMA device (an InfiniBand or RoCE NIC), and {detail}; "
    "use runtime.transport: nixl (UCX picks RDMA where there is some, TCP elsewhere) or gloo"
)


def choose_device(layer: VerbsLayer, wanted: str | None) -> str:
    """The device to open: `wanted` (from verbs.devices) or the first one found."""
    try:
        names = layer.device_names()
    except VerbsError as exc:
        raise VerbsError(_NO_DEVICE.format(detail=f"none is usable here ({exc})")) from exc
    if not names:
        raise VerbsError(_NO_DEVICE.format(detail="ibv_get_device_list found none"))
    if wanted is None:
        return names[0]
    if wanted not in names:
        raise VerbsError(f"verbs.devices names {wanted!r}, which is not an RDMA device here ({', '.join(names)})")
    return wanted
