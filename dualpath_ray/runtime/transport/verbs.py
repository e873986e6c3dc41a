"""verbs backend of the KV transport: RC queue pairs driven directly through ibverbs (pyverbs).

Each endpoint opens one RDMA device port (the compute NIC paired with its GPU, `verbs.devices`),
one protection domain and one completion queue. `register` makes each pool a memory region
(host memory, or GPU memory with GPUDirect RDMA, which needs the nvidia_peermem module);
`seal` publishes the port's LID/GID and each pool's base address and rkey in
`EndpointInfo.backend`.

Connections: the first move to a peer creates an RC queue pair here and asks the peer, through
the Ray actor call every transport already answers (`transport_serve`), for one of its own:
both sides exchange queue pair number, LID, GID and first PSN, and each moves its queue pair
INIT -> RTR -> RTS with the KV service level (and, on RoCE, traffic class) of the `qos` section
in its path. The responder's queue pair carries the read responses, so it uses the KV class
too. A connection is per (peer, peer incarnation); a restarted peer gets a new one.

Moves: one transfer is one batch of RDMA READs or WRITEs, one per coalesced region, linked into
one chain and posted with one ibv_post_send, so the NIC's doorbell rings once per batch (the
paper's doorbell batching; a transfer larger than the send queue becomes several batches). Only
the last request of a batch is signaled: on an RC queue pair completions are in order, so its
completion proves the whole batch landed. An error completion, or a transfer given up at its
deadline, moves the queue pair to ERR (nothing more is sent; every request still on it fails)
and asks the peer to drop its side, so no byte lands after the error is raised.
"""

from __future__ import annotations

import random
import threading
import time
from collections.abc import Callable, Sequence

import torch

from dualpath_ray.config.verbs import VerbsConfig
from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import EndpointInfo, Move, RegionError, Transfer, TransportError
from dualpath_ray.runtime.transport.verbs_layer import (
    LINK_ETHERNET,
    Completion,
    MemoryKeys,
    PathAttributes,
    QpAddress,
    SendAttributes,
    VerbsError,
    VerbsLayer,
    WorkOp,
    WorkRequest,
    choose_device,
)
from dualpath_ray.runtime.transport.verbs_messages import (
    ConnectReply,
    ConnectRequest,
    DisconnectRequest,
    VerbsEndpoint,
    VerbsPool,
)
from dualpath_ray.runtime.transport.verbs_records import AcceptedQp, Batch, Connection, WorkPiece

MAX_WR_BYTES = 1 << 30  # one work request moves at most this much (ports allow up to 2 GiB)
_BATCH_BITS = 20  # wr_id = batch number << _BATCH_BITS | index in the batch
_CQ_POLL = 64
_PSN_MASK = (1 << 24) - 1
_DISCONNECT_TIMEOUT_S = 5.0
_OPS = {"read": WorkOp.RDMA_READ, "write": WorkOp.RDMA_WRITE}


class VerbsTransfer(Transfer):
    """Batches posted on one connection; done when each batch's signaled request completed."""

    def __init__(
        self,
        op: str,
        peer: str,
        nbytes: int,
        deadline: float,
        on_done: Callable[[Transfer], None],
        transport: VerbsTransport,
        batches: list[Batch],
    ) -> None:
        super().__init__(op, peer, nbytes, deadline, on_done)
        self._transport = transport
        self._batches = batches

    def _poll(self) -> bool:
        self._transport._reap()
        failed = next((batch.error for batch in self._batches if batch.error is not None), None)
        if failed is not None:
            raise self._transport._failure(self.peer, f"RDMA {self.op} with {self.peer} failed: {failed}")
        return all(batch.done for batch in self._batches)

    def _abort(self, reason: str) -> TransportError:
        confirmed = self._transport._break(self._batches[0].connection, f"aborted: {reason}")
        landing = "the peer dropped its side" if confirmed else "the peer did not confirm: bytes may still land"
        return TransportError(f"RDMA {self.op} with {self.peer}: {reason}; the queue pair was failed and {landing}")


class VerbsTransport(Transport):
    kind = "verbs"

    def __init__(
        self,
        endpoint_name: str,
        namespace: str,
        timeout_s: float,
        *,
        layer: VerbsLayer,
        settings: VerbsConfig,
        device: str | None = None,
        service_level: int = 0,
        traffic_class: int = 0,
    ) -> None:
        super().__init__(endpoint_name, namespace, timeout_s)
        self._layer = layer
        self._settings = settings
        self.service_level = service_level
        self.traffic_class = traffic_class
        self._verbs_lock = threading.Lock()  # every layer call: one CQ, QPs shared by threads
        self._connect_locks: dict[str, threading.Lock] = {}  # per peer: one connection set-up at a time
        self.device = choose_device(layer, device)
        self._context = layer.open_context(self.device)
        self._port = layer.query_port(self._context, settings.port)
        if not self._port.active:
            raise VerbsError(f"{self.device} port {settings.port} is not active; check `ibstat` / the link, or verbs.port")
        self._gid = layer.query_gid(self._context, settings.port, settings.gid_index)
        self._pd = layer.alloc_pd(self._context)
        self._cq = layer.create_cq(self._context, 4 * settings.send_queue_depth)
        self._regions: dict[str, tuple[object, MemoryKeys]] = {}
        self._connections: dict[str, Connection] = {}
        self._accepted: dict[int, AcceptedQp] = {}  # by this side's qp_num
        self._batches: dict[int, Batch] = {}  # in flight, by batch number
        self._next_batch = 1
        self.doorbells = 0  # post_send calls: one per batch

    # ---- registration ------------------------------------------------------------------
    def _register_backend(self, name: str, pool: torch.Tensor) -> None:
        nbytes = pool.numel() * pool.element_size()
        try:
            with self._verbs_lock:
                self._regions[name] = self._layer.register_mr(self._pd, pool.data_ptr(), nbytes)
        except TransportError as exc:
            hint = (
                "; GPU memory needs GPUDirect RDMA (the nvidia_peermem kernel module), or set runtime.hbm_moves: "
                "cuda_copy" if pool.device.type == "cuda" else ""
            )
            raise RegionError(f"register {name!r}: registering {nbytes} bytes on {pool.device} failed: {exc}{hint}") from exc

    def _deregister_backend(self, name: str) -> None:
        region = self._regions.pop(name, None)
        if region is not None:
            with self._verbs_lock:
                self._layer.close(region[0])

    def _seal_backend(self) -> object:
        pools = tuple(VerbsPool(name, keys.address, keys.length, keys.rkey) for name, (_, keys) in self._regions.items())
        return VerbsEndpoint(self.device, self._settings.port, self._port.lid, self._gid, self._port.link_layer, pools)

    # ---- connections -------------------------------------------------------------------
    def _path_to(self, remote: QpAddress) -> PathAttributes:
        return PathAttributes(
            remote=remote, port=self._settings.port, gid_index=self._settings.gid_index,
            is_global=self._port.link_layer == LINK_ETHERNET, service_level=self.service_level,
            traffic_class=self.traffic_class, path_mtu=self._settings.path_mtu,
            max_dest_rd_atomic=self._settings.max_rd_atomic,
        )

    def _new_qp(self) -> tuple[object, QpAddress]:
        """A queue pair in INIT and the address the other side needs (with a random first PSN)."""
        with self._verbs_lock:
            qp, qp_num = self._layer.create_qp(self._pd, self._cq, self._settings.send_queue_depth)
            self._layer.modify_to_init(qp, self._settings.port)
        return qp, QpAddress(qp_num, self._port.lid, self._gid, random.getrandbits(24) & _PSN_MASK)

    def _ready(self, qp: object, mine: QpAddress, remote: QpAddress) -> None:
        """INIT -> RTR -> RTS towards `remote`, the KV class in the path."""
        with self._verbs_lock:
            self._layer.modify_to_rtr(qp, self._path_to(remote))
            self._layer.modify_to_rts(qp, SendAttributes(mine.psn, self._settings.max_rd_atomic))

    def _connection(self, peer: str, info: EndpointInfo) -> Connection:
        """The live connection to this incarnation of `peer`, set up through the peer if needed."""
        with self._lock:
            connect_lock = self._connect_locks.setdefault(peer, threading.Lock())
        with connect_lock:
            with self._lock:
                current = self._connections.get(peer)
            if current is not None and current.incarnation == info.incarnation and not current.broken:
                return current
            if current is not None:
                self._drop(current)
            qp, mine = self._new_qp()
            try:
                reply = self._call_peer(peer, ConnectRequest(self.endpoint_name, self.incarnation, mine))
                if not isinstance(reply, ConnectReply):
                    raise TransportError(f"{peer} answered the connect request with {reply!r}")
                self._ready(qp, mine, reply.address)
            except Exception:
                with self._verbs_lock:
                    self._layer.close(qp)
                raise
            connection = Connection(
                peer, reply.incarnation, qp, mine.qp_num, reply.address.qp_num, self._settings.send_queue_depth
            )
            with self._lock:
                self._connections[peer] = connection
            return connection

    def _accept(self, request: ConnectRequest) -> ConnectReply:
        """Responder side of a connection: a queue pair connected to the initiator's."""
        self._require_ready(f"connect from {request.initiator}")
        qp, mine = self._new_qp()
        try:
            self._ready(qp, mine, request.address)
        except Exception:
            with self._verbs_lock:
                self._layer.close(qp)
            raise
        with self._lock:
            # A new incarnation of the initiator: the queue pairs of its dead ones serve nobody.
            stale = [n for n, a in self._accepted.items() if a.initiator == request.initiator and a.incarnation != request.incarnation]
            dropped = [self._accepted.pop(number).qp for number in stale]
            self._accepted[mine.qp_num] = AcceptedQp(qp, request.initiator, request.incarnation)
        with self._verbs_lock:
            for old in dropped:
                self._layer.close(old)
        return ConnectReply(self.incarnation, mine)

    def _disconnect(self, request: DisconnectRequest) -> bool:
        with self._lock:
            accepted = self._accepted.get(request.qp_num)
            if accepted is None or accepted.initiator != request.initiator:
                return False
            del self._accepted[request.qp_num]
        with self._verbs_lock:
            self._layer.modify_to_error(accepted.qp)
            self._layer.close(accepted.qp)
        return True

    def _serve_backend(self, request: object) -> object:
        if isinstance(request, ConnectRequest):
            return self._accept(request)
        if isinstance(request, DisconnectRequest):
            return self._disconnect(request)
        return super()._serve_backend(request)

    # ---- moves -------------------------------------------------------------------------
    def _post(self, op: str, peer: str, moves: Sequence[Move]) -> Transfer:
        info = self._peer_info(peer)
        backend = info.backend
        if not isinstance(backend, VerbsEndpoint):
            raise TransportError(f"{peer} published {type(backend).__name__}, not verbs addressing")
        requests = self._work_requests(op, moves, {p.name: p for p in backend.pools})
        try:
            connection = self._connection(peer, info)
            batches = [self._post_batch(connection, chain) for chain in self._chains(requests)]
        except TransportError as exc:
            raise self._failure(peer, f"posting RDMA {op} with {peer} failed: {exc}") from exc
        return self._new_transfer(VerbsTransfer, op, peer, moves, self, batches)

    def _work_requests(self, op: str, moves: Sequence[Move], remote: dict[str, VerbsPool]) -> list[WorkPiece]:
        pieces = []
        for local, there in moves:
            keys, pool = self._regions[local.pool][1], remote[there.pool]
            for start in range(0, local.nbytes, MAX_WR_BYTES):
                length = min(MAX_WR_BYTES, local.nbytes - start)
                pieces.append(WorkPiece(
                    _OPS[op], keys.address + local.offset + start, length, keys.lkey,
                    pool.address + there.offset + start, pool.rkey,
                ))
        return pieces

    def _chains(self, pieces: list[WorkPiece]) -> list[list[WorkPiece]]:
        depth = self._settings.send_queue_depth
        return [pieces[start : start + depth] for start in range(0, len(pieces), depth)]

    def _post_batch(self, connection: Connection, pieces: list[WorkPiece]) -> Batch:
        """One chain, one doorbell; waits for send-queue room if other batches fill it."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self._lock:
                if connection.broken:
                    raise TransportError(f"the connection to {connection.peer} failed")
                if connection.outstanding + len(pieces) <= connection.depth:
                    connection.outstanding += len(pieces)
                    number = self._next_batch
                    self._next_batch += 1
                    batch = self._batches[number] = Batch(connection, len(pieces))
                    break
            if time.monotonic() > deadline:
                raise TransportError(f"the send queue to {connection.peer} stayed full for {self.timeout_s}s")
            self._reap()
            time.sleep(0.0005)
        chain = [
            WorkRequest((number << _BATCH_BITS) | index, *piece, signaled=index == len(pieces) - 1)
            for index, piece in enumerate(pieces)
        ]
        try:
            with self._verbs_lock:
                self._layer.post_send(connection.qp, chain)
                self.doorbells += 1
        except TransportError:
            self._break(connection, "post_send failed")
            raise
        return batch

    def _reap(self) -> None:
        """Drain the completion queue into the batches it completes or fails."""
        while True:
            with self._verbs_lock:
                completions = self._layer.poll_cq(self._cq, _CQ_POLL)
            for completion in completions:
                self._settle(completion)
            if len(completions) < _CQ_POLL:
                return

    def _settle(self, completion: Completion) -> None:
        with self._lock:
            batch = self._batches.get(completion.wr_id >> _BATCH_BITS)
            if batch is None:
                return  # a batch already failed with its connection
            if completion.ok:
                batch.done = True
                batch.connection.outstanding -= batch.size
                del self._batches[completion.wr_id >> _BATCH_BITS]
                return
        self._break(batch.connection, f"work request completed with {completion.status}")

    def _break(self, connection: Connection, reason: str) -> bool:
        """Fail a connection: its queue pair to ERR (no more bytes move), every batch on it
        failed, the peer asked to drop its side. True if the peer confirmed."""
        with self._lock:
            already = connection.broken
            connection.broken = True
            for number, batch in list(self._batches.items()):
                if batch.connection is connection:
                    batch.error = batch.error or reason
                    del self._batches[number]
            if self._connections.get(connection.peer) is connection:
                del self._connections[connection.peer]
        if already:
            return False
        with self._verbs_lock:
            self._layer.modify_to_error(connection.qp)
        try:
            request = DisconnectRequest(self.endpoint_name, connection.remote_qp_num)
            confirmed = self._call_peer(connection.peer, request, min(self.timeout_s, _DISCONNECT_TIMEOUT_S))
        except TransportError:
            confirmed = False
        with self._verbs_lock:
            self._layer.close(connection.qp)
        return confirmed is True

    def _drop(self, connection: Connection) -> None:
        """Close a connection that no transfer needs any more (its peer restarted)."""
        self._break(connection, f"{connection.peer} restarted")

    def _forget_backend_peer(self, info: EndpointInfo) -> None:
        with self._lock:
            connection = self._connections.get(info.endpoint)
        if connection is not None:
            self._break(connection, f"{info.endpoint} is gone")

    def _close_backend(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
            accepted, self._accepted = list(self._accepted.values()), {}
            for batch in self._batches.values():
                batch.error = batch.error or "the transport was closed"
            self._batches = {}
        with self._verbs_lock:
            for qp in [c.qp for c in connections] + [a.qp for a in accepted]:
                self._layer.close(qp)
            for handle, _ in self._regions.values():
                self._layer.close(handle)
            self._regions = {}
            for handle in (self._cq, self._pd, self._context):
                self._layer.close(handle)
