"""The weights a deployment published, kept where a restarted process finds them (Ray's GCS).

Every weight update goes through the Scheduler (`Scheduler.update_weights`,
`update_weights_from_group`): it asks every engine to load the new weights, each answers with
the fingerprint of what it loaded, and only when all of them loaded the same weights does it
publish them here: the current `Publication` (version, fingerprint, and the checkpoint directory
they came from, if any) and, for every version ever published, its fingerprint.

Who reads it:
- A restarted engine (runtime/engine/base.py): Ray rebuilds it from its config, so it holds the
  config's weights; if those are not the current publication it is not ready until it has
  caught up (runtime/engine/weights_catch_up.py).
- The Scheduler before an update: a version already published with other weights is refused
  (`check`), so a version number names one set of weights for the life of the deployment and KV
  stored under it is never KV of other weights.
- A restarted rollout-server (api/server.py): it serves the version the engines hold, whatever
  it had kept itself when it died.

The first Scheduler of a deployment (not a restarted one) starts the ledger afresh with the
config's weights, so a ledger a crashed deployment left in the same Ray namespace is never
taken for this one's (as with runtime/restarts/kept_state.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dualpath_ray.runtime.restarts.kept_state import KeptState
from dualpath_ray.protocol.weights import WeightsId

LEDGER_NAME = "weight-ledger"


class WeightVersionConflict(ValueError):
    """A version number already published with other weights."""


@dataclass(frozen=True)
class Publication:
    """The weights every engine holds now: a restarted engine loads these before it serves."""

    weights: WeightsId
    checkpoint: str | None = None  # the safetensors directory they were loaded from, if any


def check_version_reuse(published: dict[int, str], weights: WeightsId) -> None:
    """Refuse `weights` if its version was published before with another fingerprint."""
    known = published.get(weights.version)
    if known is not None and known != weights.fingerprint:
        raise WeightVersionConflict(
            f"weight version {weights.version} was published before with other weights (fingerprint {known}, "
            f"these are {weights.fingerprint}); a version names one set of weights: use a new version number"
        )


class WeightLedger:
    """The ledger of one deployment (Ray namespace `namespace`). Reads and writes are blocking
    GCS calls of about a millisecond, made on rare events (an update, a restart)."""

    def __init__(self, namespace: str, kept: KeptState | None = None) -> None:
        self.kept = kept if kept is not None else KeptState(namespace, LEDGER_NAME)

    def start(self, initial: WeightsId) -> None:
        """A new deployment: the config's weights are current, nothing else was published."""
        self._save(Publication(initial), {initial.version: initial.fingerprint})

    def current(self) -> Publication | None:
        """The weights the engines hold (None: no ledger, e.g. a deployment of an older version)."""
        record = self.kept.load()
        if not record:
            return None
        weights = WeightsId(int(record["version"]), str(record["fingerprint"]))
        checkpoint = record.get("checkpoint")
        return Publication(weights, str(checkpoint) if checkpoint else None)

    def published(self) -> dict[int, str]:
        """Every version published so far -> its fingerprint."""
        return {int(v): str(fp) for v, fp in dict(self.kept.load().get("published", {})).items()}

    def fingerprint_of(self, version: int) -> str | None:
        return self.published().get(version)

    def publish(self, publication: Publication) -> None:
        """Make `publication` current (after every engine loaded it); refuses a reused version."""
        published = self.published()
        check_version_reuse(published, publication.weights)
        published[publication.weights.version] = publication.weights.fingerprint
        self._save(publication, published)

    def _save(self, publication: Publication, published: dict[int, str]) -> None:
        record: dict[str, Any] = {
            "version": publication.weights.version, "fingerprint": publication.weights.fingerprint,
            "checkpoint": publication.checkpoint, "published": {str(v): fp for v, fp in published.items()},
        }
        self.kept.save(record)
