"""A restarted engine's catch-up (runtime/engine/weights_catch_up.py): from the published
checkpoint when it still holds the published weights, else from a peer; never from weights that
are not the published ones; not ready until loaded."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from dualpath_ray.model.weights import weights_fingerprint, write_checkpoint
from dualpath_ray.protocol.weights import WeightsId
from dualpath_ray.runtime.weights.ledger import Publication
from dualpath_ray.runtime.engine.held_weights import HeldWeights
from dualpath_ray.runtime.engine.weights_catch_up import CatchUpPorts, WeightsCatchUp, peers_of


def run_catch_up(published: Publication, peers: dict[str, dict | None]) -> tuple[HeldWeights, list, WeightsCatchUp]:
    weights = HeldWeights(lambda v: f"m@w{v}", WeightsId(0, "config:x"))
    weights.awaiting()
    loaded: list[tuple[WeightsId, dict]] = []

    def load(w: WeightsId, state: dict) -> None:
        loaded.append((w, state))
        weights.now_holds(w)

    def from_peer(peer: str, w: WeightsId) -> dict | None:
        state = peers[peer]
        if state is None:
            raise ConnectionError(f"{peer} is dead")
        return state

    stopped = threading.Event()
    catch_up = WeightsCatchUp("e0", list(peers), weights, CatchUpPorts(lambda: published, from_peer, load), stopped,
                              retry_s=(0.01, 0.02))
    thread = threading.Thread(target=catch_up.run)
    thread.start()
    thread.join(timeout=5)
    stopped.set()
    thread.join()
    return weights, loaded, catch_up


def test_from_the_published_checkpoint_when_it_still_holds_the_published_weights(tmp_path: Path) -> None:
    state = {"w": torch.ones(4)}
    write_checkpoint(state, tmp_path)
    published = Publication(WeightsId(2, weights_fingerprint(state)), str(tmp_path))
    weights, loaded, catch_up = run_catch_up(published, {"e1": {"w": torch.zeros(4)}})
    assert catch_up.source == str(tmp_path), "the checkpoint is read first (no peer is asked)"
    assert weights.ready() and weights.held == published.weights, "ready under the published version"
    assert torch.equal(loaded[0][1]["w"], state["w"]), "the published tensors were loaded"


def test_a_changed_checkpoint_is_skipped_for_a_peer_that_holds_the_published_weights(tmp_path: Path) -> None:
    published_state = {"w": torch.ones(4)}
    write_checkpoint({"w": torch.full((4,), 7.0)}, tmp_path)  # the trainer overwrote the directory since
    published = Publication(WeightsId(2, weights_fingerprint(published_state)), str(tmp_path))
    weights, loaded, catch_up = run_catch_up(published, {"dead": None, "e2": published_state})
    assert catch_up.source == "e2", "a dead peer is passed over, a live one holding the weights serves them"
    assert torch.equal(loaded[0][1]["w"], published_state["w"]), "never the changed checkpoint's tensors"
    assert weights.ready()


def test_without_any_source_the_engine_stays_not_ready() -> None:
    published = Publication(WeightsId(2, "tensors:gone"))
    weights, loaded, _ = run_catch_up(published, {"dead": None})
    assert not loaded and not weights.ready(), "nothing loaded: it keeps refusing work (no wrong weights served)"


def test_peers_on_the_same_node_are_asked_first() -> None:
    by_node = {"p0": ["p/0", "p/1"], "d0": ["d/0", "d/1"]}
    assert peers_of("d/1", "d0", by_node) == ["d/0", "p/0", "p/1"], "same node first, never itself"
