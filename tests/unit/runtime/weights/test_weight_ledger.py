"""The weight ledger: what a restarted engine catches up to, and a version never names two
sets of weights (runtime/weights/ledger.py)."""

from __future__ import annotations

import pytest

from dualpath_ray.protocol.weights import WeightsId
from dualpath_ray.runtime.weights.ledger import Publication, WeightLedger, WeightVersionConflict
from tests.fakes import FakeKeptState


def test_publications_become_current_and_a_reused_version_with_other_weights_is_refused() -> None:
    ledger = WeightLedger("ns", FakeKeptState())
    assert ledger.current() is None, "no ledger before a deployment starts it"
    ledger.start(WeightsId(0, "config:a"))
    assert ledger.current() == Publication(WeightsId(0, "config:a")), "a new deployment holds the config's weights"
    ledger.publish(Publication(WeightsId(1, "tensors:b"), "/ckpt/v1"))
    assert ledger.current() == Publication(WeightsId(1, "tensors:b"), "/ckpt/v1"), "the last publication is current"
    with pytest.raises(WeightVersionConflict, match="version 1 was published before"):
        ledger.publish(Publication(WeightsId(1, "tensors:other")))
    assert ledger.current().weights.fingerprint == "tensors:b", "a refused publication changes nothing"
    ledger.publish(Publication(WeightsId(1, "tensors:b")))  # the same weights again: allowed (a resent update)
    ledger.publish(Publication(WeightsId(0, "config:a")))  # back to an old version with its own weights: allowed
    assert ledger.fingerprint_of(1) == "tensors:b" and ledger.current().weights.version == 0
    ledger.start(WeightsId(0, "config:c"))
    assert ledger.fingerprint_of(1) is None, "a new deployment starts the history afresh"
