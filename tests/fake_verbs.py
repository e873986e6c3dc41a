"""A fake verbs layer for the verbs transport's tests: a fabric in one process.

`FakeFabric` stands for the RDMA network: devices, the memory regions registered on them (by
rkey) and the queue pairs (by number). Each `FakeVerbs` is one process's VerbsLayer on it. It
checks what real hardware would refuse (a queue pair used out of its INIT -> RTR -> RTS order,
a key that does not cover a range, a full send queue) and records what the tests assert on:
every post_send call (a doorbell) with its chain, and every queue pair's transitions with their
attributes. Work requests run when the completion queue is polled (as if the NIC had moved the
bytes by then), copying between the registered host buffers with memmove; only signaled
requests and errors produce completions, as with sq_sig_all = 0.
"""

from __future__ import annotations

import ctypes
import itertools
import threading
from collections.abc import Sequence
from dataclasses import dataclass, field

from dualpath_ray.runtime.transport.verbs_layer import (
    LINK_INFINIBAND,
    Completion,
    MemoryKeys,
    PathAttributes,
    PortAttributes,
    SendAttributes,
    VerbsError,
    VerbsLayer,
    WorkOp,
    WorkRequest,
)

STATES = ("reset", "init", "rtr", "rts", "err")


@dataclass
class FakeMR:
    pd: int
    keys: MemoryKeys
    closed: bool = False

    def covers(self, address: int, length: int) -> bool:
        return not self.closed and self.keys.address <= address and address + length <= self.keys.address + self.keys.length


@dataclass
class FakeQP:
    qp_num: int
    pd: int
    cq: int
    depth: int
    state: str = "reset"
    path: PathAttributes | None = None
    send: SendAttributes | None = None
    pending: list[WorkRequest] = field(default_factory=list)
    transitions: list[tuple[str, object]] = field(default_factory=list)
    closed: bool = False


@dataclass
class Doorbell:
    """One post_send call: the queue pair and the whole chain it rang for."""

    qp_num: int
    chain: tuple[WorkRequest, ...]


class FakeFabric:
    """The shared network of every FakeVerbs in a test."""

    def __init__(self, link_layer: str = LINK_INFINIBAND) -> None:
        self.link_layer = link_layer
        self.lock = threading.RLock()
        self.mrs: dict[int, FakeMR] = {}  # by rkey (== lkey here)
        self.qps: dict[int, FakeQP] = {}
        self.completions: dict[int, list[Completion]] = {}  # by cq id
        self.ids = itertools.count(1)
        self.hold = False  # True: posted requests stay on the wire until released

    def qp(self, qp_num: int) -> FakeQP:
        return self.qps[qp_num]


class FakeVerbs(VerbsLayer):
    """One process's verbs layer on a FakeFabric, with one device of LID `lid`."""

    def __init__(self, fabric: FakeFabric, device: str = "mlx5_0", lid: int = 1, devices: Sequence[str] | None = None) -> None:
        self.fabric = fabric
        self.device = device
        self.lid = lid
        self.gid = f"fe80:0000:0000:0000:0000:0000:0000:{lid:04x}"
        self.devices = [device] if devices is None else list(devices)
        self.doorbells: list[Doorbell] = []
        self.qps: list[FakeQP] = []
        self.closed: list[object] = []

    # ---- device, PD, MR, CQ ---------------------------------------------------------------
    def device_names(self) -> list[str]:
        if not self.devices:
            raise VerbsError("ibv_get_device_list: Failed to get devices list")
        return list(self.devices)

    def open_context(self, device: str) -> object:
        return ("context", device)

    def query_port(self, context: object, port: int) -> PortAttributes:
        return PortAttributes(self.lid, self.fabric.link_layer, True)

    def query_gid(self, context: object, port: int, index: int) -> str:
        return self.gid

    def alloc_pd(self, context: object) -> object:
        return ("pd", next(self.fabric.ids))

    def register_mr(self, pd: object, address: int, length: int) -> tuple[object, MemoryKeys]:
        with self.fabric.lock:
            key = next(self.fabric.ids)
            mr = FakeMR(pd[1], MemoryKeys(address, length, key, key))  # type: ignore[index]
            self.fabric.mrs[key] = mr
        return mr, mr.keys

    def create_cq(self, context: object, depth: int) -> object:
        cq = ("cq", next(self.fabric.ids))
        self.fabric.completions[cq[1]] = []
        return cq

    # ---- queue pairs ----------------------------------------------------------------------
    def create_qp(self, pd: object, cq: object, send_depth: int) -> tuple[object, int]:
        with self.fabric.lock:
            qp = FakeQP(next(self.fabric.ids), pd[1], cq[1], send_depth)  # type: ignore[index]
            self.fabric.qps[qp.qp_num] = qp
        self.qps.append(qp)
        return qp, qp.qp_num

    def _move(self, qp: object, start: str, end: str, attrs: object) -> FakeQP:
        assert isinstance(qp, FakeQP)
        if qp.state != start:
            raise VerbsError(f"qp {qp.qp_num}: {start}->{end.upper()} from state {qp.state}")
        qp.state = end
        qp.transitions.append((end, attrs))
        return qp

    def modify_to_init(self, qp: object, port: int) -> None:
        self._move(qp, "reset", "init", port)

    def modify_to_rtr(self, qp: object, path: PathAttributes) -> None:
        self._move(qp, "init", "rtr", path).path = path

    def modify_to_rts(self, qp: object, send: SendAttributes) -> None:
        self._move(qp, "rtr", "rts", send).send = send

    def modify_to_error(self, qp: object) -> None:
        assert isinstance(qp, FakeQP)
        with self.fabric.lock:
            qp.state = "err"
            qp.transitions.append(("err", None))
            self._flush(qp, "wr_flush_err")

    def post_send(self, qp: object, chain: Sequence[WorkRequest]) -> None:
        assert isinstance(qp, FakeQP)
        with self.fabric.lock:
            if qp.state != "rts":
                raise VerbsError(f"ibv_post_send on qp {qp.qp_num} in state {qp.state}")
            if len(qp.pending) + len(chain) > qp.depth:
                raise VerbsError(f"ibv_post_send: send queue of qp {qp.qp_num} is full")
            qp.pending.extend(chain)
            self.doorbells.append(Doorbell(qp.qp_num, tuple(chain)))

    def poll_cq(self, cq: object, max_entries: int) -> list[Completion]:
        with self.fabric.lock:
            if not self.fabric.hold:
                for qp in [q for q in self.fabric.qps.values() if q.cq == cq[1] and q.pending]:  # type: ignore[index]
                    self._execute(qp)
            queue = self.fabric.completions[cq[1]]  # type: ignore[index]
            taken, queue[:] = queue[:max_entries], queue[max_entries:]
            return taken

    def close(self, handle: object) -> None:
        if isinstance(handle, (FakeQP, FakeMR)):
            handle.closed = True
        self.closed.append(handle)

    # ---- the wire -------------------------------------------------------------------------
    def _execute(self, qp: FakeQP) -> None:
        """Run the posted requests in order; the first bad one fails the QP (as RC does)."""
        while qp.pending and qp.state == "rts":
            request = qp.pending.pop(0)
            error = self._transfer(qp, request)
            if error is not None:
                self.fabric.completions[qp.cq].append(Completion(request.wr_id, False, error))
                qp.state = "err"
                self._flush(qp, "wr_flush_err")
                return
            if request.signaled:
                self.fabric.completions[qp.cq].append(Completion(request.wr_id, True, "success"))

    def _flush(self, qp: FakeQP, status: str) -> None:
        for request in qp.pending:
            self.fabric.completions[qp.cq].append(Completion(request.wr_id, False, status))
        qp.pending.clear()

    def _transfer(self, qp: FakeQP, request: WorkRequest) -> str | None:
        local = self.fabric.mrs.get(request.lkey)
        if local is None or local.pd != qp.pd or not local.covers(request.local_address, request.length):
            return "loc_prot_err"
        assert qp.path is not None
        remote_qp = self.fabric.qps.get(qp.path.remote.qp_num)
        if remote_qp is None or remote_qp.closed or remote_qp.state not in ("rtr", "rts"):
            return "retry_exc_err"
        remote = self.fabric.mrs.get(request.rkey)
        if remote is None or remote.pd != remote_qp.pd or not remote.covers(request.remote_address, request.length):
            return "rem_access_err"
        source, target = (
            (request.remote_address, request.local_address) if request.op is WorkOp.RDMA_READ
            else (request.local_address, request.remote_address)
        )
        ctypes.memmove(target, source, request.length)
        return None
