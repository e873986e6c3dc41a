"""KV transport between endpoint actors on a 2-worker-node Ray cluster, once per backend.

A source on node 1 offers non-contiguous slots of its registered pool; pullers on node 2 fill
slots of their own pools; bytes must be identical, and every misuse must raise TransportError.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Iterator
from typing import Any

os.environ["RAY_AUTH_MODE"] = "disabled"
os.environ["RAY_USAGE_STATS_ENABLED"] = "0"
os.environ.setdefault("RAY_rdt_fetch_fail_timeout_milliseconds", "20000")

import pytest  # noqa: E402
import ray  # noqa: E402
import torch  # noqa: E402
from ray.cluster_utils import Cluster  # noqa: E402

from dualpath_ray.runtime.transport import (  # noqa: E402
    TRANSPORT_GROUP,
    SourceDiedError,
    TransferTicket,
    TransportEndpoint,
    TransportError,
    endpoint_actor_options,
    make_transport,
    setup_gloo_world,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


def _nixl_import_error() -> str | None:
    try:
        import nixl  # noqa: F401
    except Exception as exc:  # a broken install counts as missing, whatever it raises
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


@ray.remote(num_cpus=0, max_concurrency=16, **endpoint_actor_options())
class PoolEndpoint(TransportEndpoint):
    """An engine/reader stand-in: a registered uint8 pool [slot, layer, block, width]."""

    def __init__(
        self, kind: str, name: str, namespace: str, seed: int, verify_bytes: bool = False, timeout_s: float = 10.0
    ) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.pool = torch.randint(0, 256, (SLOTS, LAYERS, BLOCK, WIDTH), dtype=torch.uint8, generator=generator)
        self.transport = self.attach_transport(
            make_transport(kind, name, namespace=namespace, timeout_s=timeout_s, verify_bytes=verify_bytes)
        )
        self.transport.register(self.pool)
        self.stalls: list[float] = []

    @ray.method(concurrency_group=TRANSPORT_GROUP)
    def stall(self, seconds: float) -> None:
        """Occupy a transport thread, as a wedged source would."""
        self.stalls.append(seconds)
        time.sleep(seconds)

    def stalled_threads(self) -> int:
        return len(self.stalls)

    def state(self) -> str:
        return self.transport.state.value

    def offer(self, slots: list[Slot]) -> TransferTicket:
        return self.transport.offer([self.pool[s, layer] for s, layer in slots])

    def pull(self, ticket: TransferTicket, slots: list[Slot]) -> tuple[int, list[bytes]]:
        """Pull into the slots; return bytes moved and what landed (read in the same call)."""
        targets = [self.pool[s, layer] for s, layer in slots]
        moved = self.transport.pull(ticket, targets)
        return moved, [t.numpy().tobytes() for t in targets]

    def pull_from_message(self, message: dict[str, Any], slots: list[Slot]) -> tuple[int, list[bytes]]:
        return self.pull(message["ticket"], slots)

    def pull_then_release(self, message: dict[str, Any], slots: list[Slot]) -> tuple[int, list[bytes]]:
        """The decode-side flow: pull a relayed ticket, then tell its source to release it."""
        result = self.pull(message["ticket"], slots)
        self.transport.release(message["ticket"])
        return result

    def pull_and_hand_back(self, ticket: TransferTicket, slots: list[Slot], source: Any) -> tuple[int, str]:
        """Pull, send the ticket itself back to its source's release method, then pull again."""
        moved, _ = self.pull(ticket, slots)
        ray.get(source.release.remote(ticket))
        try:
            self.pull(ticket, slots)
        except TransportError as exc:
            return moved, str(exc)
        return moved, ""

    def pull_raw(self, ticket: TransferTicket, targets: list[torch.Tensor]) -> int:
        return self.transport.pull(ticket, targets)

    def slot_bytes(self, slots: list[Slot]) -> list[bytes]:
        return [self.pool[s, layer].numpy().tobytes() for s, layer in slots]

    def release(self, ticket: TransferTicket) -> None:
        self.transport.release(ticket)

    def outstanding(self) -> int:
        return self.transport.outstanding_offers()

    def rdt_counts(self) -> tuple[int, int]:
        """(RDT objects this process holds, RDT refs it tracks): the NIXL leak check."""
        manager = ray._private.worker.global_worker.rdt_manager
        return manager.rdt_store.get_num_objects(), len(manager._managed_rdt_metadata)


@ray.remote(num_cpus=0)
class Relay:
    """A scheduler stand-in that forwards tickets without touching KV."""

    def forward(self, message: dict[str, Any], puller: Any, slots: list[Slot]) -> tuple[int, list[bytes]]:
        return ray.get(puller.pull_then_release.remote({"hop": 2, **message}, slots))


@dataclasses.dataclass
class Endpoints:
    kind: str
    namespace: str
    a: Any  # node 1, the usual source
    b: Any  # node 2, the usual puller
    c: Any  # node 2, a puller with byte verification on
    relay: Any


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    started = Cluster(
        initialize_head=True,
        head_node_args=dict(num_cpus=1, include_dashboard=False, object_store_memory=80 << 20),
    )
    for index in (1, 2):
        started.add_node(num_cpus=1, resources={f"node{index}": 1}, object_store_memory=80 << 20)
    started.wait_for_nodes()
    ray.init(address=started.address, namespace="dualpath-test")
    yield started
    ray.shutdown()
    started.shutdown()


def _endpoint(
    kind: str, name: str, namespace: str, node: int, seed: int, verify: bool = False, **options: Any
) -> Any:
    timeout_s = options.pop("timeout_s", 10.0)
    return PoolEndpoint.options(name=name, namespace=namespace, resources={f"node{node}": 0.01}, **options).remote(
        kind, name, namespace, seed, verify, timeout_s
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
    a = _endpoint(kind, "reader/n1", namespace, node=1, seed=1)
    b = _endpoint(kind, "decode/n2/g0", namespace, node=2, seed=2)
    c = _endpoint(kind, "decode/n2/g1", namespace, node=2, seed=3, verify=True)
    ray.get([h.outstanding.remote() for h in (a, b, c)])
    if kind == "gloo":
        setup_gloo_world([a, b, c])
    yield Endpoints(kind, namespace, a, b, c, Relay.remote())
    for handle in (a, b, c):
        ray.kill(handle)


def test_pull_fills_non_contiguous_slots_with_identical_bytes(endpoints: Endpoints) -> None:
    source_slots, target_slots = [(3, 1), (7, 1)], [(5, 0), (2, 1)]
    untouched = ray.get(endpoints.b.slot_bytes.remote([(5, 1), (2, 0)]))
    ticket = ray.get(endpoints.a.offer.remote(source_slots))
    assert ticket.nbytes == 2 * SLOT_BYTES, "nbytes counts every offered byte"
    assert ticket.shapes == ((BLOCK, WIDTH), (BLOCK, WIDTH)), "shapes mirror the offered views"
    moved, landed = ray.get(endpoints.b.pull.remote(ticket, target_slots))
    assert moved == 2 * SLOT_BYTES, "pull returns the bytes it moved"
    assert landed == ray.get(endpoints.a.slot_bytes.remote(source_slots)), "puller slots hold the source bytes"
    assert ray.get(endpoints.b.slot_bytes.remote([(5, 1), (2, 0)])) == untouched, "neighbours untouched"
    ray.get(endpoints.a.release.remote(ticket))
    assert ray.get(endpoints.a.outstanding.remote()) == 0, "release drops the offer"


def test_ticket_crosses_two_hops_and_puller_releases(endpoints: Endpoints) -> None:
    ticket = ray.get(endpoints.a.offer.remote([(1, 0), (8, 1), (4, 0)]))
    moved, landed = ray.get(endpoints.relay.forward.remote({"ticket": ticket}, endpoints.c, [(9, 1), (0, 0), (6, 1)]))
    assert moved == 3 * SLOT_BYTES, "a ticket relayed nested in messages still pulls every byte"
    assert landed == ray.get(endpoints.a.slot_bytes.remote([(1, 0), (8, 1), (4, 0)])), "relayed bytes identical"
    assert _wait_until(lambda: ray.get(endpoints.a.outstanding.remote()) == 0), "puller's release reaches the source"
    del ticket
    if endpoints.kind == "nixl":
        assert _wait_until(lambda: ray.get(endpoints.a.rdt_counts.remote())[0] == 0), "source frees its RDT object"
        assert ray.get(endpoints.c.rdt_counts.remote()) == (0, 0), "puller keeps no RDT metadata after a pull"


def test_puller_hands_the_pulled_ticket_back_to_its_source(endpoints: Endpoints) -> None:
    ticket = ray.get(endpoints.a.offer.remote([(9, 0)]))
    moved, second_pull = ray.get(endpoints.b.pull_and_hand_back.remote(ticket, [(8, 1)], endpoints.a))
    assert moved == SLOT_BYTES, "the first pull moves the block"
    assert ray.get(endpoints.a.outstanding.remote()) == 0, "a pulled ticket sent back to its source releases it"
    assert second_pull, "pulling a ticket again after its release raises TransportError"
    del ticket
    if endpoints.kind == "nixl":
        assert _wait_until(lambda: ray.get(endpoints.a.rdt_counts.remote())[0] == 0), "source frees its RDT object"


def test_many_concurrent_transfers_in_both_directions(endpoints: Endpoints) -> None:
    # A offers the slots (k, k % 2); pulls into A use the other parity, so nothing offered moves.
    a_slots = [[(k, k % LAYERS), ((k + 5) % SLOTS, (k + 5) % LAYERS)] for k in range(SLOTS)]
    b_slots = [[(k, 1)] for k in range(6)]
    a_tickets = ray.get([endpoints.a.offer.remote(slots) for slots in a_slots])
    b_tickets = ray.get([endpoints.b.offer.remote(slots) for slots in b_slots])
    to_b = [endpoints.b.pull.remote(a_tickets[k], [(k, 0), (k + 5, 0)]) for k in range(5)]
    to_c = [endpoints.c.pull.remote(a_tickets[k], [(k, 0), (k, 1)]) for k in range(SLOTS)]
    to_a = [endpoints.a.pull.remote(b_tickets[k], [(k, (k + 1) % LAYERS)]) for k in range(6)]
    at_b, at_c, at_a = ray.get(to_b), ray.get(to_c), ray.get(to_a)
    expected = ray.get([endpoints.a.slot_bytes.remote(slots) for slots in a_slots])
    for k, (moved, landed) in enumerate(at_b):
        assert (moved, landed) == (2 * SLOT_BYTES, expected[k]), f"concurrent pull {k} into B is exact"
    for k, (moved, landed) in enumerate(at_c):
        assert (moved, landed) == (2 * SLOT_BYTES, expected[k]), f"second puller C of ticket {k} is exact"
    sent_by_b = ray.get([endpoints.b.slot_bytes.remote(slots) for slots in b_slots])
    for k, (moved, landed) in enumerate(at_a):
        assert (moved, landed) == (SLOT_BYTES, sent_by_b[k]), f"reverse pull {k} into A is exact"
    ray.get([endpoints.a.release.remote(t) for t in a_tickets] + [endpoints.b.release.remote(t) for t in b_tickets])
    assert ray.get([endpoints.a.outstanding.remote(), endpoints.b.outstanding.remote()]) == [0, 0], "all released"


def test_released_or_unknown_ticket_raises(endpoints: Endpoints) -> None:
    ticket = ray.get(endpoints.a.offer.remote([(2, 0)]))
    ray.get(endpoints.a.release.remote(ticket))
    with pytest.raises(TransportError, match="no longer offers|not offered"):
        ray.get(endpoints.b.pull.remote(ticket, [(2, 0)]))
    live = ray.get(endpoints.a.offer.remote([(2, 1)]))
    forged = dataclasses.replace(live, transfer_id="reader/n1#bogus-0")
    with pytest.raises(TransportError, match="no longer offers|not offered"):
        ray.get(endpoints.b.pull.remote(forged, [(2, 1)]))
    with pytest.raises(TransportError, match="handle"):
        ray.get(endpoints.b.pull.remote(dataclasses.replace(live, handle=None), [(2, 1)]))
    ray.get(endpoints.a.release.remote(live))


def test_mismatched_targets_raise_and_leave_the_ticket_usable(endpoints: Endpoints) -> None:
    ticket = ray.get(endpoints.a.offer.remote([(1, 1)]))
    wrong = {
        "shape": [torch.zeros(BLOCK * WIDTH, dtype=torch.uint8)],
        "dtype": [torch.zeros(BLOCK, WIDTH, dtype=torch.float32)],
        "count": [torch.zeros(BLOCK, WIDTH, dtype=torch.uint8)] * 2,
        "contiguous": [torch.zeros(WIDTH, BLOCK, dtype=torch.uint8).t()],
    }
    for what, targets in wrong.items():
        with pytest.raises(TransportError):
            ray.get(endpoints.b.pull_raw.remote(ticket, targets))
    moved, landed = ray.get(endpoints.b.pull.remote(ticket, [(4, 1)]))
    assert landed == ray.get(endpoints.a.slot_bytes.remote([(1, 1)])), "a rejected pull does not spoil the ticket"
    ray.get(endpoints.a.release.remote(ticket))


def test_local_pull_copies_within_the_source(endpoints: Endpoints) -> None:
    ticket = ray.get(endpoints.a.offer.remote([(6, 0)]))
    moved, landed = ray.get(endpoints.a.pull.remote(ticket, [(0, 1)]))
    assert moved == SLOT_BYTES and landed == ray.get(endpoints.a.slot_bytes.remote([(6, 0)])), "self-pull copies"
    ray.get(endpoints.a.release.remote(ticket))


def test_source_that_never_answers_fails_the_pull(endpoints: Endpoints) -> None:
    wedged = _endpoint(endpoints.kind, "prefill/n1/g1", endpoints.namespace, node=1, seed=5)
    impatient = _endpoint(endpoints.kind, "decode/n2/g2", endpoints.namespace, node=2, seed=6, timeout_s=1.0)
    if endpoints.kind == "gloo":
        setup_gloo_world([endpoints.a, endpoints.b, endpoints.c, wedged, impatient])
    ticket = ray.get(wedged.offer.remote([(2, 1)]))
    threads = endpoint_actor_options()["concurrency_groups"][TRANSPORT_GROUP]
    for _ in range(threads):
        wedged.stall.remote(9.0)
    assert _wait_until(lambda: ray.get(wedged.stalled_threads.remote()) == threads), "every transport thread is busy"
    with pytest.raises(TransportError, match="did not answer"):
        ray.get(impatient.pull.remote(ticket, [(2, 1)]))
    if endpoints.kind == "gloo":
        assert ray.get(impatient.state.remote()) == "broken", "an unanswered gloo request aborts the puller's world"
        with pytest.raises(TransportError, match="setup_gloo_world"):
            ray.get(impatient.pull.remote(ticket, [(2, 1)]))
    for handle in (wedged, impatient):
        ray.kill(handle)


def test_dead_source_raises_and_other_pairs_keep_working(endpoints: Endpoints) -> None:
    doomed = _endpoint(endpoints.kind, "prefill/n1/g0", endpoints.namespace, node=1, seed=4)
    if endpoints.kind == "gloo":
        setup_gloo_world([endpoints.a, endpoints.b, endpoints.c, doomed])
    ticket = ray.get(doomed.offer.remote([(3, 0)]))
    ray.kill(doomed)
    started = time.monotonic()
    with pytest.raises(SourceDiedError):
        ray.get(endpoints.b.pull.remote(ticket, [(3, 0)]))
    assert time.monotonic() - started < 10, "a dead source is reported promptly"
    survivor = ray.get(endpoints.a.offer.remote([(5, 1)]))
    moved, landed = ray.get(endpoints.b.pull.remote(survivor, [(5, 1)]))
    assert landed == ray.get(endpoints.a.slot_bytes.remote([(5, 1)])), "other pairs survive a dead endpoint"
    ray.get(endpoints.a.release.remote(survivor))
