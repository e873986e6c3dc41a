"""An engine's `engine_stats` record (runtime/telemetry/engine_stats.py): typed fields, and the
plain dict the benchmarks and the chaos tests' figures always read, with the same keys."""

from __future__ import annotations

from dualpath_ray.runtime.prefill.core import PrefillStats
from dualpath_ray.runtime.telemetry.engine_stats import EngineStats, HbmMoveCounts
from dualpath_ray.runtime.transport.moves import TransportStats


def test_engine_stats_read_by_name_and_flatten_to_the_old_keys() -> None:
    core = PrefillStats(batches=3, handoffs=2)
    core.pipeline.digest_mismatches = 5
    stats = EngineStats(
        core, TransportStats(posted=7), "cpu", HbmMoveCounts("registered", 10, 20, 2, {"pool": True}), "inc-1",
        {"report": 4}, 9, {},
    )
    assert stats.core.pipeline.digest_mismatches == 5, "the core's own record is read by name, nested ones too"
    flat = stats.to_json()
    assert set(flat) == {"core", "transport", "device", "hbm_moves", "incarnation", "sent", "worker_loops", "compute"}, (
        "the keys engine_stats always answered with"
    )
    assert flat["core"]["pipeline"]["digest_mismatches"] == 5 and flat["core"]["handoffs"] == 2, "the core as a dict"
    assert flat["transport"]["posted"] == 7 and flat["worker_loops"] == 9 and flat["sent"] == {"report": 4}
    assert flat["hbm_moves"] == {"mode": "registered", "h2d_bytes": 10, "d2h_bytes": 20, "copies": 2,
                                 "mirrors_pinned": {"pool": True}}, "the HBM moves as one flat dict, as before"
