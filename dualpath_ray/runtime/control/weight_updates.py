"""Weight updates between rollouts, fanned out by the Scheduler and published in the ledger.

Every way a trainer changes the weights (`DualPathCluster.update_weights`, the rollout-server's
`update_weights` and `update_weights_from_group`, the adapters) ends here: every engine loads
the new weights and answers with their fingerprint, and only when all of them hold the same
weights are they published (runtime/weights/ledger.py), which is what a restarted engine
catches up to (runtime/engine/weights_catch_up.py) and what a restarted front end serves. A
version published before with other weights is refused at every engine before it loads
anything (the engines check the fingerprint they are given), so a version number names one set
of weights for the deployment's life, and KV stored under it is KV of those weights.
"""

from __future__ import annotations

from typing import Sequence

from dualpath_ray.config import DualPathConfig
from dualpath_ray.protocol.weights import TensorSpec, WeightSource, WeightsId
from dualpath_ray.runtime.control.fanout import ClusterControl
from dualpath_ray.runtime.weights.ledger import Publication, WeightLedger
from dualpath_ray.runtime.engine.held_weights import config_fingerprint


class WeightUpdates:
    """The Scheduler's part of weight updates. A first Scheduler of a deployment (`fresh`)
    starts the ledger with the config's weights; a restarted one keeps it."""

    def __init__(self, cfg: DualPathConfig, control: ClusterControl, fresh: bool) -> None:
        self.control = control
        self.ledger = WeightLedger(cfg.runtime.namespace)
        if fresh:
            self.ledger.start(WeightsId(cfg.model.weight_version, config_fingerprint(cfg)))

    async def load(self, version: int, source: WeightSource) -> None:
        """Every engine loads `source` as `version`; then it is published."""
        expected = self.ledger.fingerprint_of(version)
        fingerprints = await self.control.update_weights(version, source.argument(), expected)
        self._publish(version, fingerprints, source.checkpoint)

    async def receive(self, version: int, manifest: Sequence[TensorSpec]) -> None:
        """Every engine receives the trainer's broadcast of `manifest` as `version`; then it is published."""
        expected = self.ledger.fingerprint_of(version)
        fingerprints = await self.control.receive_weights(version, manifest, expected)
        self._publish(version, fingerprints, None)

    def current(self) -> Publication | None:
        return self.ledger.current()

    def _publish(self, version: int, fingerprints: list[str], checkpoint: str | None) -> None:
        if len(set(fingerprints)) != 1:
            raise RuntimeError(
                f"weight version {version}: the engines loaded different weights ({sorted(set(fingerprints))}); "
                "not published: send the update again"
            )
        self.ledger.publish(Publication(WeightsId(version, fingerprints[0]), checkpoint))
