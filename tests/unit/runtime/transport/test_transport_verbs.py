"""The pyverbs transport (runtime/transport/verbs.py) against a fake verbs layer (tests/fake_verbs.py):
bytes land, one doorbell per batch, the KV service level on every queue pair, failures abort.

Two endpoints live in this process; their peer calls (connection set-up, liveness probes) go
straight to the other's `serve` instead of through Ray. The real pyverbs layer is checked where it
can be without a device (the attributes it hands to ibverbs), and on a device where there is one.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

from dualpath_ray.config.qos import QosConfig
from dualpath_ray.config.verbs import VerbsConfig
from dualpath_ray.runtime.placement.qos import kv_transport_knobs
from dualpath_ray.runtime.transport.moves import PeerDiedError, Region, TransportError
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.verbs import VerbsTransport
from dualpath_ray.runtime.transport.verbs_layer import (
    LINK_ETHERNET,
    PathAttributes,
    QpAddress,
    SendAttributes,
    VerbsError,
    WorkOp,
    WorkRequest,
)
from tests.fake_verbs import FakeFabric, FakeVerbs

POOL_BYTES = 4096


class Endpoints:
    """Verbs endpoints of one fake fabric that reach each other by name."""

    def __init__(self, fabric: FakeFabric, depth: int = 16, timeout_s: float = 5.0, **knobs: int) -> None:
        self.fabric = fabric
        self.depth = depth
        self.timeout_s = timeout_s
        self.knobs = knobs
        self.by_name: dict[str, VerbsTransport] = {}
        self.pools: dict[str, torch.Tensor] = {}

    def start(self, name: str, lid: int, seed: int) -> VerbsTransport:
        transport = VerbsTransport(
            name, "dualpath", self.timeout_s, layer=FakeVerbs(self.fabric, lid=lid),
            settings=VerbsConfig(send_queue_depth=self.depth), **self.knobs,
        )
        transport._call_peer = self._caller()  # type: ignore[method-assign]
        pool = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        transport.register("kv", pool)
        transport.seal()
        self.by_name[name], self.pools[name] = transport, pool
        return transport

    def _caller(self) -> Callable[..., object]:
        def call(peer: str, request: object, timeout_s: float | None = None) -> object:
            if peer not in self.by_name:
                raise PeerDiedError(f"endpoint {peer!r} not found")
            return self.by_name[peer].serve(request)

        return call


@pytest.fixture
def pair() -> tuple[Endpoints, VerbsTransport, VerbsTransport]:
    endpoints = Endpoints(FakeFabric(), service_level=2)
    return endpoints, endpoints.start("prefill/p0/g0", 1, seed=1), endpoints.start("reader/d0", 2, seed=2)


def scattered(count: int, size: int = 8) -> list[tuple[Region, Region]]:
    """`count` moves that never continue each other on the remote side, so none coalesce."""
    return [(Region("kv", i * size, size), Region("kv", 2 * i * size, size)) for i in range(count)]


def test_reads_and_writes_land_byte_exact(pair: tuple[Endpoints, VerbsTransport, VerbsTransport]) -> None:
    endpoints, engine, _ = pair
    mine, theirs = endpoints.pools["prefill/p0/g0"], endpoints.pools["reader/d0"]
    before = theirs.clone()
    moves = scattered(5)
    assert engine.read("reader/d0", moves).wait() == 40, "a read reports its bytes"
    for local, remote in moves:
        assert torch.equal(engine.view(local), before[remote.offset : remote.end]), "read: remote bytes land locally"
    write = [(Region("kv", 1000, 64), Region("kv", 3000, 64))]
    assert engine.write("reader/d0", write).wait() == 64, "a write reports its bytes"
    assert torch.equal(theirs[3000:3064], mine[1000:1064]), "write: local bytes land remotely"
    assert torch.equal(theirs[:3000], before[:3000]) and torch.equal(theirs[3064:], before[3064:]), (
        "nothing outside the written region changes"
    )
    stats = engine.stats()
    assert (stats.bytes_read, stats.bytes_written, stats.posted) == (40, 64, 2), "the base's counters hold for verbs"


def test_one_doorbell_per_batch_only_the_last_request_signaled(
    pair: tuple[Endpoints, VerbsTransport, VerbsTransport],
) -> None:
    _, engine, _ = pair
    engine.read("reader/d0", scattered(5)).wait()
    layer: FakeVerbs = engine._layer  # type: ignore[assignment]
    assert len(layer.doorbells) == 1, "five non-contiguous regions are one batch: one post_send, one doorbell"
    chain = layer.doorbells[0].chain
    assert len(chain) == 5 and all(wr.op is WorkOp.RDMA_READ for wr in chain), "one RDMA READ per region"
    assert [wr.signaled for wr in chain] == [False] * 4 + [True], "only the batch's last request asks for a completion"
    assert len({wr.wr_id for wr in chain}) == 5, "work request ids are distinct"
    engine.write("reader/d0", [(Region("kv", 0, 16), Region("kv", 100, 16)), (Region("kv", 16, 16), Region("kv", 116, 16))]).wait()
    assert len(layer.doorbells) == 2 and len(layer.doorbells[1].chain) == 1, (
        "moves contiguous on both sides coalesce into one work request of the next batch"
    )
    assert layer.doorbells[1].chain[0].op is WorkOp.RDMA_WRITE and layer.doorbells[1].chain[0].length == 32, "one WRITE"
    assert engine.doorbells == 2, "the transport counts its doorbells"


def test_a_transfer_larger_than_the_send_queue_is_split_into_full_batches(
    pair: tuple[Endpoints, VerbsTransport, VerbsTransport],
) -> None:
    endpoints, engine, _ = pair
    before = endpoints.pools["reader/d0"].clone()
    moves = scattered(40)
    engine.read("reader/d0", moves).wait()
    chains = [bell.chain for bell in engine._layer.doorbells]  # type: ignore[attr-defined]
    assert [len(chain) for chain in chains] == [16, 16, 8], "a batch holds at most send_queue_depth requests"
    assert all([wr.signaled for wr in chain] == [False] * (len(chain) - 1) + [True] for chain in chains), (
        "each batch is signaled on its last request only"
    )
    assert all(torch.equal(engine.view(local), before[remote.offset : remote.end]) for local, remote in moves), (
        "every region of every batch landed"
    )


def test_threads_sharing_a_connection_wait_for_send_queue_room(
    pair: tuple[Endpoints, VerbsTransport, VerbsTransport],
) -> None:
    endpoints, engine, _ = pair
    before = endpoints.pools["reader/d0"].clone()
    jobs = [[(Region("kv", 200 * j + 16 * i, 8), Region("kv", 200 * j + 32 * i, 8)) for i in range(10)] for j in range(8)]
    with ThreadPoolExecutor(8) as pool:
        sizes = list(pool.map(lambda moves: engine.read("reader/d0", moves).wait(), jobs))
    assert sizes == [80] * 8, "every thread's transfer completed"
    for moves in jobs:
        for local, remote in moves:
            assert torch.equal(engine.view(local), before[remote.offset : remote.end]), "each region landed"
    assert engine._connections["reader/d0"].outstanding == 0, "every posted request was accounted back"
    assert len(endpoints.fabric.qps) == 2, "the threads shared one connection"


def test_every_queue_pair_carries_the_kv_service_level_and_is_cross_connected(
    pair: tuple[Endpoints, VerbsTransport, VerbsTransport],
) -> None:
    endpoints, engine, reader = pair
    engine.read("reader/d0", scattered(2)).wait()
    reader.write("prefill/p0/g0", scattered(2)).wait()
    qps = list(endpoints.fabric.qps.values())
    assert len(qps) == 4, "each initiator made one queue pair and its peer one responder queue pair"
    for qp in qps:
        assert [state for state, _ in qp.transitions] == ["init", "rtr", "rts"], "RESET -> INIT -> RTR -> RTS, in order"
        assert qp.path is not None and qp.path.service_level == 2, f"qp {qp.qp_num} sends on the KV SL 2"
        assert not qp.path.is_global, "InfiniBand within a subnet needs no GRH"
    by_num = {qp.qp_num: qp for qp in qps}
    for qp in qps:
        other = by_num[qp.path.remote.qp_num]  # type: ignore[union-attr]
        assert other.path.remote.qp_num == qp.qp_num, "the two queue pairs of a connection point at each other"  # type: ignore[union-attr]
        assert qp.path.remote.psn == other.send.psn, "my receive PSN is the first PSN the other side sends"  # type: ignore[union-attr]


def test_roce_paths_are_global_with_the_kv_traffic_class() -> None:
    knobs = kv_transport_knobs(QosConfig(fabric="roce"))
    endpoints = Endpoints(FakeFabric(link_layer=LINK_ETHERNET), **knobs)
    engine, _ = endpoints.start("decode/d0/g0", 0, seed=3), endpoints.start("reader/d0", 0, seed=4)
    engine.read("reader/d0", scattered(1)).wait()
    for qp in endpoints.fabric.qps.values():
        path = qp.path
        assert path is not None and path.is_global, "RoCE needs a GRH on every packet"
        assert (path.service_level, path.traffic_class) == (2, 64), "priority 2 and DSCP 16 << 2 on every queue pair"


def test_an_error_completion_fails_the_transfer_and_the_next_one_reconnects(
    pair: tuple[Endpoints, VerbsTransport, VerbsTransport],
) -> None:
    endpoints, engine, reader = pair
    engine.read("reader/d0", scattered(1)).wait()
    first = engine._connections["reader/d0"]
    remote_mr = endpoints.fabric.mrs[reader.info().backend.pools[0].rkey]  # type: ignore[attr-defined]
    remote_mr.closed = True  # the responder refuses the rkey, as a NIC does for a deregistered region
    with pytest.raises(TransportError, match="rem_access_err"):
        engine.read("reader/d0", scattered(2)).wait()
    assert endpoints.fabric.qp(first.qp_num).state == "err", "a failed request leaves its queue pair in ERR"
    assert endpoints.fabric.qp(first.remote_qp_num).closed, "the peer was asked to drop its side, and did"
    remote_mr.closed = False
    engine.read("reader/d0", scattered(1)).wait()
    assert engine._connections["reader/d0"].qp_num != first.qp_num, "the next move made a new connection"


def test_a_transfer_past_its_deadline_is_aborted_and_nothing_lands_after(
    pair: tuple[Endpoints, VerbsTransport, VerbsTransport],
) -> None:
    endpoints, engine, _ = pair
    endpoints.fabric.hold = True  # requests stay on the wire
    target = engine.view(Region("kv", 0, 8)).clone()
    transfer = engine.read("reader/d0", scattered(1))
    with pytest.raises(TransportError, match=r"wait\(0.05\) expired; the queue pair was failed and the peer dropped"):
        transfer.wait(0.05)
    endpoints.fabric.hold = False
    engine._reap()
    assert torch.equal(engine.view(Region("kv", 0, 8)), target), "the aborted read's bytes never land"
    with pytest.raises(TransportError):
        transfer.done()


def test_a_restarted_peer_gets_a_new_connection(pair: tuple[Endpoints, VerbsTransport, VerbsTransport]) -> None:
    endpoints, engine, _ = pair
    engine.read("reader/d0", scattered(1)).wait()
    old = engine._connections["reader/d0"]
    endpoints.by_name["reader/d0"].close()  # the process died: its queue pairs and regions are gone
    endpoints.start("reader/d0", 2, seed=5)  # same name, new incarnation
    with pytest.raises(PeerDiedError, match="restarted"):
        engine.read("reader/d0", scattered(1)).wait()  # the cached addressing is the dead incarnation's
    engine.read("reader/d0", scattered(1)).wait()
    assert engine._connections["reader/d0"].incarnation != old.incarnation, "connected to the new incarnation"
    assert endpoints.fabric.qp(old.qp_num).state == "err", "the old connection's queue pair was failed"


def test_without_a_device_the_error_names_the_setting_and_the_fix() -> None:
    with pytest.raises(VerbsError, match=r"runtime.transport: verbs needs an RDMA device .* use runtime.transport: nixl"):
        VerbsTransport("reader/d0", "dualpath", 1.0, layer=FakeVerbs(FakeFabric(), devices=[]), settings=VerbsConfig())
    with pytest.raises(VerbsError, match=r"verbs.devices names 'mlx5_9'.*\(mlx5_0\)"):
        VerbsTransport("reader/d0", "dualpath", 1.0, layer=FakeVerbs(FakeFabric()), settings=VerbsConfig(), device="mlx5_9")


def test_make_transport_without_pyverbs_names_the_os_package(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    from dualpath_ray.runtime.transport import verbs_pyverbs

    monkeypatch.setitem(sys.modules, "pyverbs.device", None)  # what a missing package looks like
    monkeypatch.setattr(verbs_pyverbs, "OS_PACKAGES", tmp_path / "missing")
    with pytest.raises(VerbsError, match=r"not on PyPI: install the OS package \(Debian/Ubuntu: apt-get install python3-pyverbs"):
        make_transport("verbs", "reader/d0", namespace="dualpath")


def _pyverbs_missing() -> str | None:
    try:
        from dualpath_ray.runtime.transport.verbs_pyverbs import load_pyverbs

        load_pyverbs()
    except VerbsError as exc:
        return f"pyverbs is not installed (the rdma extra: apt-get install python3-pyverbs): {exc}"
    return None


@pytest.mark.skipif(_pyverbs_missing() is not None, reason=str(_pyverbs_missing()))
def test_real_pyverbs_attributes_put_the_service_level_in_the_address_vector() -> None:
    from dualpath_ray.runtime.transport.verbs_pyverbs import (
        load_pyverbs,
        rtr_attr,
        rts_attr,
        send_chain,
    )

    pv = load_pyverbs()
    remote = QpAddress(77, 5, "fe80:0000:0000:0000:0000:0000:0000:0001", 1234)
    ib = rtr_attr(pv, PathAttributes(remote, 1, 0, False, 2, 0, 4096, 16))
    assert (ib.ah_attr.sl, ib.ah_attr.is_global, ib.ah_attr.dlid) == (2, 0, 5), "IB: SL 2 to the peer's LID, no GRH"
    assert (ib.dest_qp_num, ib.rq_psn, ib.path_mtu) == (77, 1234, pv.enums.IBV_MTU_4096), "the remote QP and PSN"
    roce = rtr_attr(pv, PathAttributes(remote, 1, 3, True, 2, 64, 1024, 16))
    assert (roce.ah_attr.sl, roce.ah_attr.traffic_class, roce.ah_attr.sgid_index) == (2, 64, 3), (
        "RoCE: priority 2 and traffic class 64 in the GRH, from the RoCE v2 GID"
    )
    assert rts_attr(pv, SendAttributes(99, 16)).sq_psn == 99, "RTS starts sending at our PSN"
    chain = send_chain(pv, [
        WorkRequest(1, WorkOp.RDMA_READ, 4096, 8, 1, 8192, 2, False),
        WorkRequest(2, WorkOp.RDMA_WRITE, 4104, 8, 1, 8200, 2, True),
    ])
    assert [(w.wr_id, w.opcode, w.send_flags) for w in chain] == [
        (1, pv.enums.IBV_WR_RDMA_READ, 0), (2, pv.enums.IBV_WR_RDMA_WRITE, pv.enums.IBV_SEND_SIGNALED),
    ], "each request's opcode, and the signaled flag on the last one only"


def _rdma_device_missing() -> str | None:
    missing = _pyverbs_missing()
    if missing is not None:
        return missing
    from dualpath_ray.runtime.transport.verbs_pyverbs import PyverbsLayer

    try:
        names = PyverbsLayer().device_names()
    except VerbsError as exc:
        return f"no RDMA device here ({exc}); this test needs an InfiniBand or RoCE NIC"
    return None if names else "no RDMA device here; this test needs an InfiniBand or RoCE NIC"


@pytest.mark.rdma
@pytest.mark.skipif(_rdma_device_missing() is not None, reason=str(_rdma_device_missing()))
def test_real_device_loopback_read_and_write() -> None:
    from dualpath_ray.runtime.transport.verbs_pyverbs import PyverbsLayer

    endpoints = Endpoints(FakeFabric(), service_level=0)
    engines = {}
    for name, seed in (("prefill/p0/g0", 1), ("reader/p0", 2)):
        transport = VerbsTransport(name, "dualpath", 10.0, layer=PyverbsLayer(), settings=VerbsConfig())
        transport._call_peer = endpoints._caller()  # type: ignore[method-assign]
        pool = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
        transport.register("kv", pool)
        transport.seal()
        endpoints.by_name[name], engines[name] = transport, pool
    before = engines["reader/p0"].clone()
    moves = scattered(4)
    endpoints.by_name["prefill/p0/g0"].read("reader/p0", moves).wait()
    for local, remote in moves:
        assert torch.equal(engines["prefill/p0/g0"][local.offset : local.end], before[remote.offset : remote.end]), (
            "an RDMA READ on the device lands the remote bytes"
        )
