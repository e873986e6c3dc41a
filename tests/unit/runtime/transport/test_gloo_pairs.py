"""The gloo backend's broken pairs, without Ray or sockets: a fake process group stands in for
gloo's, so the test drives exactly the passive side of a transfer whose world is replaced."""

from __future__ import annotations

from datetime import timedelta
from typing import Any, Callable

import torch

from dualpath_ray.runtime.transport.gloo import GlooTransport, RecvRegions, _World
from dualpath_ray.runtime.transport.moves import Region, TransportState


class AbortedWork:
    """A posted recv whose wait runs `meanwhile` (the world is replaced) and then fails, as
    gloo's ops do once their group was aborted."""

    def __init__(self, meanwhile: Callable[[], None]) -> None:
        self.meanwhile = meanwhile

    def wait(self, timeout: timedelta) -> None:
        self.meanwhile()
        raise RuntimeError("the group was aborted")


class FakeGroup:
    def __init__(self, meanwhile: Callable[[], None] = lambda: None) -> None:
        self.meanwhile = meanwhile
        self.aborted = False

    def recv(self, views: list[torch.Tensor], rank: int, tag: int) -> Any:
        return AbortedWork(self.meanwhile)

    def abort(self) -> None:
        self.aborted = True


def test_a_served_transfer_cut_by_a_new_world_leaves_the_new_worlds_pair_usable() -> None:
    transport = GlooTransport("reader/d0", "dualpath", timeout_s=1.0)
    transport.register("buffer", torch.zeros(256, dtype=torch.uint8))
    transport.seal()
    ranks = {"reader/d0": 0, "prefill/p0/g0": 1}
    new_world = _World("new", 0, ranks, FakeGroup())

    def replaced() -> None:  # what _serve_join does when the scheduler forms a new world
        transport._world, transport._broken_ranks = new_world, set()

    transport._world = _World("old", 0, ranks, FakeGroup(replaced))
    transport._state = TransportState.READY
    outcome = transport._serve_regions(RecvRegions("old", (Region("buffer", 0, 64),), 1, (7,)), "recv")
    assert outcome.posted and outcome.error, "the op of the replaced world failed, and the peer is told"
    assert 1 not in transport._broken_ranks, (
        "the new world's pair with rank 1 is not marked broken by an op of the world it replaced"
    )
    failed_in_place = _World("same", 0, ranks, FakeGroup())
    transport._world = failed_in_place
    transport._serve_regions(RecvRegions("same", (Region("buffer", 0, 64),), 1, (8,)), "recv")
    assert 1 in transport._broken_ranks, "an op that fails in the current world still breaks its pair"
