"""End-to-end KV digests with faults on the hops (in-process engines, real store and pools):
a damaged transfer is caught by its receiver before the KV is used, read again once, and the
output is what a fault-free run gives; damage that stays in the buffer fails the attempt."""

from __future__ import annotations

from pathlib import Path

import numpy as np

from dualpath_ray.config import DualPathConfig, parse_config
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.protocol.messages import ErrorKind
from dualpath_ray.runtime.engine.faulty_ports import with_faults
from tests.engine_harness import DE, PE, EngineHarness, Request


def config(*faults: dict) -> DualPathConfig:
    return parse_config({
        "model": {"n_layer": 3, "max_context": 512},
        "cluster": {"hbm_tokens_per_engine": 4096, "buffer_blocks_per_node": 256, "prefill_hbm_tokens": 2048},
        "store": {"block_size": 16},
        "emulation": {"enabled": False, "compute": "profile"},
        "faults": {"faults": list(faults)},
    })


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def serve_two_turns(root: Path, cfg: DualPathConfig, path: str) -> tuple[EngineHarness, list]:
    """Turn 1 fault-free (it fills the store), then turn 2 with the plan's faults applied."""
    h = EngineHarness(cfg, root)
    context = tokens(100, 1)
    (turn1,) = h.serve([Request("t1", context, path)])
    prefill_faults, decode_faults = FaultInjector(cfg.faults, PE), FaultInjector(cfg.faults, DE)
    h.prefill.ports = with_faults(h.prefill.ports, prefill_faults, lambda r: h.fabric.view(PE, r))
    h.decode.ports = with_faults(h.decode.ports, decode_faults, lambda r: h.fabric.view(DE, r))
    (turn2,) = h.serve([Request("t2", context + list(turn1.output_tokens) + tokens(20, 2), path)])
    return h, [turn1, turn2, prefill_faults, decode_faults]


def reference(root: Path, path: str) -> tuple[int, ...]:
    h, (_, turn2, _, _) = serve_two_turns(root, config(), path)
    h.close()
    return turn2.output_tokens


def test_a_layer_read_damaged_in_transit_is_read_again_before_compute(tmp_path: Path) -> None:
    want = reference(tmp_path / "ref", "de")
    h, (_, turn2, faults, _) = serve_two_turns(tmp_path / "run", config({"site": "layer_transfer", "mode": "corrupt", "nth": 1}), "de")
    stats = h.prefill.stats.pipeline
    assert faults.counts()["layer_transfer:corrupt"].injected == 1, "one layer read was damaged"
    assert (stats.digest_mismatches, stats.digest_rereads) == (1, 1), "the prefill engine caught it and read again"
    assert turn2.error is None and turn2.output_tokens == want, "the output is the fault-free one"
    h.assert_idle()
    h.close()


def test_a_copy_into_decode_pages_damaged_is_loaded_again(tmp_path: Path) -> None:
    want = reference(tmp_path / "ref", "pe")
    h, (_, turn2, _, faults) = serve_two_turns(tmp_path / "run", config({"site": "buffer_to_hbm", "mode": "corrupt", "nth": 1}), "pe")
    assert faults.counts()["buffer_to_hbm:corrupt"].injected == 1, "one buffer -> HBM copy was damaged"
    assert (h.decode.stats.digest_mismatches, h.decode.stats.digest_reloads) == (1, 1), "decode caught it, loaded again"
    assert turn2.error is None and turn2.output_tokens == want, "the output is the fault-free one"
    h.assert_idle()
    h.close()


def test_kv_damaged_on_its_way_into_the_decode_buffer_fails_the_attempt_before_decode(tmp_path: Path) -> None:
    # The first write of the second turn (layer 0 to the decode node) is damaged: the buffer
    # holds bad KV, a second load finds it again, and the attempt fails (retried by the scheduler).
    # Transfer events of a 3-layer batch: read 0, read 1, then write 0 (the third).
    cfg = config({"site": "layer_transfer", "mode": "corrupt", "nth": 3})
    h, (_, turn2, faults, _) = serve_two_turns(tmp_path, cfg, "pe")
    assert faults.counts()["layer_transfer:corrupt"].injected == 1, "one transfer was damaged"
    assert turn2.error_kind is ErrorKind.KV_MISMATCH, f"the attempt failed with kv_mismatch: {turn2.error}"
    assert h.decode.stats.digest_mismatches == 1, "the decode side detected exactly the one damaged token"
    h.assert_idle()
    h.close()


def test_digests_off_means_no_checks_and_no_cost(tmp_path: Path) -> None:
    cfg = config().with_overrides(runtime={"kv_digests": False})
    h, (_, turn2, _, _) = serve_two_turns(tmp_path, cfg, "de")
    assert turn2.error is None, "serving works without digests"
    assert h.prefill.stats.pipeline.digest_mismatches == 0 and h.decode.stats.digest_mismatches == 0, "nothing checked"
    h.close()
