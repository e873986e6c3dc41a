"""A restarted engine's way back to the published weights before it takes work.

Ray restarts a dead engine by running its constructor again: it builds its config's weights,
not the ones a trainer sent since. If those are not the weights the deployment published last
(runtime/weights/ledger.py), the engine is not ready (runtime/engine/held_weights.py) and
this loop brings the published ones, from, in order:

1. the checkpoint directory they were published from, if they came from one: read and checked
   against the published fingerprint (a directory the trainer has overwritten since fails the
   check and is skipped);
2. a live peer engine that holds them (`export_weights`, through Ray's object store): every
   engine of a deployment holds the same weights, so with any engine alive the published ones
   exist, whichever way they came (a checkpoint, a state dict, a trainer's broadcast that was
   never stored anywhere). Same node first (no network), then the rest.

Why not the object store ref of the update, or a re-broadcast: the ref of a state dict lives as
long as its owner (the trainer's driver, which may be gone), a broadcast is not stored at all,
and asking a trainer to broadcast again would make an engine's restart wait on the trainer's
loop. With no source (every engine died at once, and the weights came from no directory) the
engine stays not ready and says so in its log: the trainer's next update (`update_weights` or a
broadcast) loads every engine, this one included.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from dualpath_ray.model.weights import read_checkpoint, weights_fingerprint
from dualpath_ray.protocol.weights import WeightsId
from dualpath_ray.runtime.weights.ledger import Publication
from dualpath_ray.runtime.engine.held_weights import HeldWeights

LOG = logging.getLogger("dualpath_ray.engine")

StateDict = dict[str, torch.Tensor]


@dataclass(frozen=True)
class CatchUpPorts:
    """What the loop needs from its engine (the actor binds these to Ray calls and its lock)."""

    published: Callable[[], Publication | None]  # the ledger's current publication
    from_peer: Callable[[str, WeightsId], StateDict | None]  # a peer's export, None if it holds other weights
    load: Callable[[WeightsId, StateDict], None]  # load under the engine's compute lock, then ready


class WeightsCatchUp:
    """Runs on its own thread until the engine holds the published weights (or it stops)."""

    def __init__(
        self, engine: str, peers: Sequence[str], weights: HeldWeights, ports: CatchUpPorts,
        stopped: threading.Event, retry_s: tuple[float, float] = (0.5, 10.0),
    ) -> None:
        self.engine = engine
        self.peers = list(peers)
        self.weights = weights
        self.ports = ports
        self.stopped = stopped
        self.retry_s = retry_s
        self.source = ""  # where the weights came from, once caught up (for logs and tests)

    def run(self) -> None:
        wait_s, told = self.retry_s[0], False
        while not self.stopped.is_set():
            published = self.ports.published()
            if published is None or self.weights.is_current(published.weights):
                # Nothing published, or an update reached this engine meanwhile.
                if not self.weights.ready():
                    self.weights.now_holds(self.weights.held)
                return
            found = self._fetch(published)
            if found is not None:
                self.source, state = found
                self.ports.load(published.weights, state)
                LOG.info("%s: caught up with weight version %d from %s", self.engine, published.weights.version, self.source)
                return
            if not told:
                LOG.warning(
                    "%s: restarted, and no source of the published weights (version %d) answers: not taking work until "
                    "a peer holding them answers or a trainer's next update loads them", self.engine,
                    published.weights.version,
                )
                told = True
            self.stopped.wait(wait_s)
            wait_s = min(2 * wait_s, self.retry_s[1])

    def _fetch(self, published: Publication) -> tuple[str, StateDict] | None:
        if published.checkpoint is not None:
            try:
                state = read_checkpoint(published.checkpoint)
            except Exception as exc:  # noqa: BLE001 - a directory gone or unreadable: try the peers
                LOG.warning("%s: published checkpoint %s unreadable (%s)", self.engine, published.checkpoint, exc)
            else:
                if weights_fingerprint(state) == published.weights.fingerprint:
                    return published.checkpoint, state
                LOG.warning("%s: checkpoint %s changed since it was published; asking the peers",
                            self.engine, published.checkpoint)
        for peer in self.peers:
            try:
                state = self.ports.from_peer(peer, published.weights)
            except Exception as exc:  # noqa: BLE001 - dead, restarting itself, slow: the next one
                LOG.info("%s: peer %s gave no weights (%r)", self.engine, peer, exc)
                continue
            if state is not None:
                return peer, state
        return None


def peers_of(engine: str, node: str, engines_by_node: dict[str, list[str]]) -> list[str]:
    """The engines to ask, same node first (the weights need not cross the network)."""
    same = [e for e in engines_by_node.get(node, []) if e != engine]
    rest = [e for n, names in sorted(engines_by_node.items()) if n != node for e in names]
    return same + rest
