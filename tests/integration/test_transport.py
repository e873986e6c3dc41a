"""KV transport between endpoint actors on a 2-worker-node Ray cluster, once per backend.

Endpoints on node 1 and node 2 each register a random uint8 pool "hbm" [slot, layer, block,
width]; reads and writes name regions of both pools; landed bytes must equal the source bytes,
neighbours must stay untouched, and every misuse or failure must raise its typed error.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from tests.helpers import ray_test_env

ray_test_env()

import pytest
import ray
import torch
from ray.cluster_utils import Cluster

from dualpath_ray.runtime.transport.base import TRANSPORT_GROUP
from dualpath_ray.runtime.transport.moves import PeerDiedError, Region, RegionError, TransportError, TransportStats
from dualpath_ray.runtime.transport.endpoint import TransportEndpoint, endpoint_actor_options
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.transport.gloo_world import setup_gloo_world

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _nixl_import_error() -> str | None:
    try:
        import nixl._api  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - a broken install counts as missing, whatever it raises
        return f"`import nixl` fails ({type(exc).__name__}: {exc}); install the nixl extra"
    return None


_NIXL_MISSING = _nixl_import_error()
KINDS = [
    pytest.param("nixl", id="nixl", marks=pytest.mark.skipif(_NIXL_MISSING is not None, reason=str(_NIXL_MISSING))),
    pytest.param("gloo", id="gloo"),
]
SLOTS, LAYERS, BLOCK, WIDTH = 10, 2, 4, 32
SLOT_BYTES = BLOCK * WIDTH
Slot = tuple[int, int]


def region(slot: Slot, count: int = 1) -> Region:
    """The Region of `count` consecutive (slot, layer) entries of an "hbm" pool, from `slot` on."""
    return Region("hbm", (slot[0] * LAYERS + slot[1]) * SLOT_BYTES, count * SLOT_BYTES)


def moves(local: list[Slot], remote: list[Slot]) -> list[tuple[Region, Region]]:
    return [(region(a), region(b)) for a, b in zip(local, remote)]


@ray.remote(num_cpus=0, max_concurrency=16, **endpoint_actor_options())
class PoolEndpoint(TransportEndpoint):
    """An engine/reader stand-in: one registered uint8 pool "hbm" [slot, layer, block, width]."""

    def __init__(self, kind: str, name: str, namespace: str, seed: int, timeout_s: float) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (SLOTS, LAYERS, BLOCK, WIDTH), dtype=torch.uint8, generator=generator)
        self.transport = self.attach_transport(make_transport(kind, name, namespace=namespace, timeout_s=timeout_s))
        self.transport.register("hbm", self.pool)
        self.transport.seal()
        self.stalls: list[float] = []

    @ray.method(concurrency_group=TRANSPORT_GROUP)
    def stall(self, seconds: float) -> None:
        """Occupy a transport thread, as a wedged peer would."""
        self.stalls.append(seconds)
        time.sleep(seconds)

    def pid(self) -> int:
        return os.getpid()

    def stalled_threads(self) -> int:
        return len(self.stalls)

    def state(self) -> str:
        return self.transport.state.value

    def move(self, op: str, peer: str, pairs: list[tuple[Region, Region]]) -> int:
        transfer = self.transport.read(peer, pairs) if op == "read" else self.transport.write(peer, pairs)
        return transfer.wait()

    def move_many(self, jobs: list[tuple[str, str, list[tuple[Region, Region]]]], threads: int) -> list[int]:
        """Post and wait for every job from `threads` threads of this process at once."""
        with ThreadPoolExecutor(threads) as pool:
            return list(pool.map(lambda job: self.move(*job), jobs))

    def slot_bytes(self, slots: list[Slot]) -> list[bytes]:
        return [self.pool[s, layer].numpy().tobytes() for s, layer in slots]

    def stats(self) -> TransportStats:
        return self.transport.stats()


@dataclasses.dataclass
class Endpoints:
    kind: str
    namespace: str
    a: Any  # node 1
    b: Any  # node 2
    c: Any  # node 2

    def world(self, *extra: Any) -> None:
        """gloo only: (re-)form the world over a, b, c and `extra`."""
        if self.kind == "gloo":
            setup_gloo_world([self.a, self.b, self.c, *extra])


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster(
        initialize_head=True,
        head_node_args={"num_cpus": 1, "include_dashboard": False, "object_store_memory": 80 << 20},
    )
    try:
        for index in (1, 2):
            started.add_node(num_cpus=1, resources={f"node{index}": 1}, object_store_memory=80 << 20)
        started.wait_for_nodes()
        ray.init(address=started.address, namespace="dualpath-test")
        yield started
    finally:
        ray.shutdown()
        started.shutdown()


def _endpoint(endpoints_kind: str, name: str, namespace: str, node: int, seed: int, timeout_s: float = 10.0) -> Any:
    return PoolEndpoint.options(name=name, namespace=namespace, resources={f"node{node}": 0.01}).remote(
        endpoints_kind, name, namespace, seed, timeout_s
    )


def _wait_until(condition: Any, timeout_s: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


@pytest.fixture(scope="module", params=KINDS)
def endpoints(request: pytest.FixtureRequest, cluster: Cluster) -> Iterator[Endpoints]:
    kind = request.param
    namespace = f"transport-{kind}"
    handles = [
        _endpoint(kind, "reader/n1", namespace, node=1, seed=1),
        _endpoint(kind, "decode/n2/g0", namespace, node=2, seed=2),
        _endpoint(kind, "decode/n2/g1", namespace, node=2, seed=3),
    ]
    ray.get([h.state.remote() for h in handles])
    found = Endpoints(kind, namespace, *handles)
    found.world()
    yield found
    for handle in handles:
        ray.kill(handle)


def test_read_fills_non_contiguous_regions_with_identical_bytes(endpoints: Endpoints) -> None:
    a, b = endpoints.a, endpoints.b
    remote, local, neighbours = [(3, 1), (7, 1)], [(5, 0), (2, 1)], [(5, 1), (2, 0)]
    untouched = ray.get(b.slot_bytes.remote(neighbours))
    moved = ray.get(b.move.remote("read", "reader/n1", moves(local, remote)))
    assert moved == 2 * SLOT_BYTES, "wait() returns the bytes the transfer moved"
    landed = ray.get(b.slot_bytes.remote(local))
    assert landed == ray.get(a.slot_bytes.remote(remote)), "local regions hold the peer's bytes"
    assert ray.get(b.slot_bytes.remote(neighbours)) == untouched, "bytes next to the regions are untouched"


def test_write_fills_non_contiguous_remote_regions(endpoints: Endpoints) -> None:
    a, c = endpoints.a, endpoints.c
    local, remote, neighbours = [(1, 0), (8, 1), (4, 0)], [(9, 1), (0, 0), (6, 1)], [(9, 0), (0, 1), (6, 0)]
    untouched = ray.get(c.slot_bytes.remote(neighbours))
    moved = ray.get(a.move.remote("write", "decode/n2/g1", moves(local, remote)))
    assert moved == 3 * SLOT_BYTES, "a write reports every byte it pushed"
    assert ray.get(c.slot_bytes.remote(remote)) == ray.get(a.slot_bytes.remote(local)), "remote regions hold the bytes"
    assert ray.get(c.slot_bytes.remote(neighbours)) == untouched, "the peer's other bytes are untouched"


def test_consecutive_slots_travel_as_one_descriptor_and_peer_calls_are_counted(endpoints: Endpoints) -> None:
    a, b = endpoints.a, endpoints.b
    ray.get(b.move.remote("read", "reader/n1", moves([(0, 0)], [(0, 0)])))  # peer info is cached from here on
    before = ray.get(b.stats.remote())
    run = [(4, 0), (4, 1), (5, 0)]
    ray.get(b.move.remote("read", "reader/n1", moves([(6, 1), (7, 0), (7, 1)], run)))
    after = ray.get(b.stats.remote())
    assert after.descriptors - before.descriptors == 1, "three moves contiguous on both sides coalesce into one"
    assert after.posted - before.posted == 1 and after.bytes_read - before.bytes_read == 3 * SLOT_BYTES, (
        "one posted transfer, every byte counted once completed"
    )
    assert ray.get(b.slot_bytes.remote([(6, 1), (7, 0), (7, 1)])) == ray.get(a.slot_bytes.remote(run)), "exact bytes"
    calls = after.peer_calls - before.peer_calls
    expected = 0 if endpoints.kind == "nixl" else 1
    assert calls == expected, f"{endpoints.kind}: {expected} Ray call(s) per transfer once the peer's info is cached"


def test_many_concurrent_transfers_from_several_threads(endpoints: Endpoints) -> None:
    a, b, c = endpoints.a, endpoints.b, endpoints.c
    # b reads a's layer-0 slots into its layer 1 and writes its layer-0 slots into a's layer 1;
    # c reads a's layer-0 slots; a reads b's layer-1 slots 5..9 into its own layer 0 slots 5..9.
    b_jobs = [("read", "reader/n1", moves([(k, 1)], [(k, 0)])) for k in range(5)]
    b_jobs += [("write", "reader/n1", moves([(k, 0)], [(k, 1)])) for k in range(5, 10)]
    c_jobs = [("read", "reader/n1", moves([(k, 0)], [(k, 0)])) for k in range(5)]
    expected_a0 = ray.get(a.slot_bytes.remote([(k, 0) for k in range(5)]))
    expected_b0 = ray.get(b.slot_bytes.remote([(k, 0) for k in range(5, 10)]))
    expected_b1 = ray.get(b.slot_bytes.remote([(k, 1) for k in range(5, 10)]))
    a_jobs = [("read", "decode/n2/g0", moves([(k, 0)], [(k, 1)])) for k in range(5, 10)]
    results = ray.get([b.move_many.remote(b_jobs, 4), c.move_many.remote(c_jobs, 3), a.move_many.remote(a_jobs, 3)])
    assert all(moved == SLOT_BYTES for batch in results for moved in batch), "every concurrent transfer completes"
    assert ray.get(b.slot_bytes.remote([(k, 1) for k in range(5)])) == expected_a0, "b's concurrent reads are exact"
    assert ray.get(c.slot_bytes.remote([(k, 0) for k in range(5)])) == expected_a0, "a second reader is exact"
    assert ray.get(a.slot_bytes.remote([(k, 1) for k in range(5, 10)])) == expected_b0, "b's concurrent writes landed"
    assert ray.get(a.slot_bytes.remote([(k, 0) for k in range(5, 10)])) == expected_b1, "reverse reads are exact"


def test_misuse_raises_typed_errors(endpoints: Endpoints) -> None:
    b = endpoints.b
    outside = [(region((0, 0)), Region("hbm", SLOTS * LAYERS * SLOT_BYTES - 8, SLOT_BYTES))]
    with pytest.raises(RegionError, match="past the end of reader/n1's pool 'hbm'"):
        ray.get(b.move.remote("read", "reader/n1", outside))
    with pytest.raises(RegionError, match="'window' is not a pool of reader/n1"):
        ray.get(b.move.remote("write", "reader/n1", [(region((0, 0)), Region("window", 0, SLOT_BYTES))]))
    with pytest.raises(RegionError, match="local nbytes"):
        ray.get(b.move.remote("read", "reader/n1", [(region((0, 0)), region((1, 0), 2))]))
    with pytest.raises(PeerDiedError, match="not found"):
        ray.get(b.move.remote("read", "prefill/n9/g9", moves([(0, 0)], [(0, 0)])))


def test_dead_peer_raises_within_the_timeout_and_other_pairs_keep_working(endpoints: Endpoints) -> None:
    a, b = endpoints.a, endpoints.b
    doomed = _endpoint(endpoints.kind, "prefill/n1/g0", endpoints.namespace, node=1, seed=4)
    endpoints.world(doomed)
    ray.get(b.move.remote("read", "prefill/n1/g0", moves([(3, 0)], [(3, 0)])))  # b now caches its info
    pid = ray.get(doomed.pid.remote())
    ray.kill(doomed)
    # Ray reports the actor dead before its process exits; until then its memory is still readable
    # one-sided. The embedded nodes are local processes, so wait for the process itself.
    assert _wait_until(lambda: not os.path.exists(f"/proc/{pid}")), "ray.kill ends the peer's process"
    for op in ("read", "write"):
        with pytest.raises(PeerDiedError) as died:
            ray.get(b.move.remote(op, "prefill/n1/g0", moves([(3, 0)], [(3, 0)])))
        assert "transport timeout" not in str(died.value) and "did not answer within" not in str(died.value), (
            f"a {op} to a dead peer fails on its death, not once the transport timeout ran out: {died.value}"
        )
    ray.get(b.move.remote("read", "reader/n1", moves([(5, 1)], [(5, 1)])))
    assert ray.get(b.slot_bytes.remote([(5, 1)])) == ray.get(a.slot_bytes.remote([(5, 1)])), "other pairs survive"


def test_wedged_peer(endpoints: Endpoints) -> None:
    """nixl is one-sided: a peer whose transport threads are all busy is still read once its info
    is cached. gloo needs the peer's thread: the initiator times out, aborts its world (BROKEN),
    and setup_gloo_world heals it."""
    wedged = _endpoint(endpoints.kind, "prefill/n1/g1", endpoints.namespace, node=1, seed=5)
    impatient = _endpoint(endpoints.kind, "decode/n2/g2", endpoints.namespace, node=2, seed=6, timeout_s=1.0)
    endpoints.world(wedged, impatient)
    # nixl: b caches the wedged peer's info, impatient never met it; gloo: impatient caches it.
    warm = endpoints.b if endpoints.kind == "nixl" else impatient
    ray.get(warm.move.remote("read", "prefill/n1/g1", moves([(2, 0)], [(2, 1)])))
    threads = endpoint_actor_options()["concurrency_groups"][TRANSPORT_GROUP]
    for _ in range(threads):
        wedged.stall.remote(6.0)
    assert _wait_until(lambda: ray.get(wedged.stalled_threads.remote()) == threads), "every transport thread is busy"
    with pytest.raises(TransportError, match="did not answer"):
        ray.get(impatient.move.remote("read", "prefill/n1/g1", moves([(2, 1)], [(2, 1)])))
    if endpoints.kind == "nixl":
        moved = ray.get(endpoints.b.move.remote("read", "prefill/n1/g1", moves([(4, 0)], [(2, 1)])))
        assert moved == SLOT_BYTES, "a one-sided read needs no thread of the peer"
    else:
        assert ray.get(impatient.state.remote()) == "broken", "an unanswered gloo request aborts the initiator's world"
        with pytest.raises(TransportError, match="setup_gloo_world"):
            ray.get(impatient.move.remote("read", "reader/n1", moves([(2, 1)], [(2, 1)])))
        endpoints.world(impatient)
        assert ray.get(impatient.state.remote()) == "ready", "setup_gloo_world heals a broken endpoint"
        ray.get(impatient.move.remote("read", "reader/n1", moves([(2, 1)], [(2, 1)])))
        assert ray.get(impatient.slot_bytes.remote([(2, 1)])) == ray.get(endpoints.a.slot_bytes.remote([(2, 1)])), (
            "the re-formed world moves exact bytes"
        )
    for handle in (wedged, impatient):
        ray.kill(handle)
