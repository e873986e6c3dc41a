"""The verbs transport's bookkeeping: its connections, the batches in flight on them, the queue
pairs it made for peers, and the pieces a move is cut into (one work request each)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

from dualpath_ray.runtime.transport.verbs_layer import WorkOp


@dataclass
class Connection:
    """This endpoint's queue pair to one incarnation of a peer; `broken` once it went to ERR."""

    peer: str
    incarnation: str
    qp: object
    qp_num: int
    remote_qp_num: int
    depth: int
    outstanding: int = 0  # work requests posted and not yet known complete
    broken: bool = False


@dataclass
class Batch:
    """One posted chain (one doorbell): done at its signaled completion, or failed."""

    connection: Connection
    size: int
    done: bool = False
    error: str | None = None


@dataclass(frozen=True)
class AcceptedQp:
    """A queue pair this endpoint made for a peer's connection (the responder side)."""

    qp: object
    initiator: str
    incarnation: str


class WorkPiece(NamedTuple):
    """One work request's worth of a move: at most MAX_WR_BYTES of one region."""

    op: WorkOp
    local_address: int
    length: int
    lkey: int
    remote_address: int
    rkey: int
