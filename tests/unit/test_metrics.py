"""The metric definitions and the exporters: running totals become counters equal to them, loads
become gauges, turns and decisions become observations; docs/metrics.md documents every metric
and tag. The exporters run here over real in-process cores (tests/engine_harness.py)."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import numpy as np
import pytest

from dualpath_ray import metrics as m
from dualpath_ray.config import ConfigError, DualPathConfig, parse_config
from dualpath_ray.metrics import ALL_METRICS, TAGS, MetricKind, RayMetrics
from dualpath_ray.protocol.counters import PATHS
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.telemetry.actor_metrics import EngineMetrics, ReaderMetrics, SchedulerMetrics, node_role
from dualpath_ray.protocol.messages import ErrorKind, GroupReport, TurnResult
from dualpath_ray.scheduling.loads import EngineLoad
from dualpath_ray.runtime.telemetry.metrics_export import CounterTotals, PeriodicExport
from dualpath_ray.protocol.types import ReadPath
from tests.engine_harness import DE, PE, EngineHarness, Request
from tests.metric_sink import RecordingSink

REPO = Path(__file__).resolve().parents[2]
BLOCK = 16


def config(**runtime: object) -> DualPathConfig:
    return parse_config({
        "model": {"n_layer": 2, "max_context": 512},
        "cluster": {"hbm_tokens_per_engine": 2048, "buffer_blocks_per_node": 64, "prefill_hbm_tokens": 1024,
                    "gpus_per_node": 1},
        "store": {"block_size": BLOCK},
        "emulation": {"enabled": False, "compute": "profile"},
        "runtime": runtime,
    })


def tokens(n: int, seed: int) -> list[int]:
    return [int(t) for t in np.random.default_rng(seed).integers(0, 512, n)]


def test_metric_names_are_under_dualpath_and_exported_with_rays_prefix_and_suffix() -> None:
    names = [spec.name for spec in ALL_METRICS]
    assert len(set(names)) == len(names), "every metric is defined once"
    for spec in ALL_METRICS:
        assert re.fullmatch(r"dualpath_[a-z0-9_]+", spec.name), f"{spec.name} is under dualpath_"
        assert set(spec.tags) <= set(TAGS), f"{spec.name}: every tag is one of the documented tags"
        assert (spec.kind is MetricKind.HISTOGRAM) == bool(spec.boundaries), f"{spec.name}: only histograms have buckets"
        assert list(spec.boundaries) == sorted(spec.boundaries) and all(b > 0 for b in spec.boundaries), (
            f"{spec.name}: Ray needs positive increasing boundaries"
        )
    assert m.SNIC_READ_BYTES.exported_name == "ray_dualpath_snic_read_bytes_total", "counters get ray_ and _total"
    assert m.READ_QUEUE_TOKENS.exported_name == "ray_dualpath_read_queue_tokens", "gauges get ray_ only"


def test_docs_metrics_md_documents_every_metric_and_every_tag() -> None:
    text = (REPO / "docs" / "metrics.md").read_text()
    for spec in ALL_METRICS:
        assert f"`{spec.exported_name}`" in text, f"docs/metrics.md documents {spec.exported_name}"
    for tag in TAGS:
        assert f"| `{tag}` |" in text, f"docs/metrics.md's tag table explains `{tag}`"


def test_ray_metrics_refuse_a_wrong_kind_or_wrong_tags_where_they_are_recorded() -> None:
    sink = RayMetrics()
    with pytest.raises(TypeError, match="dualpath_snic_read_bytes is a counter"):
        sink.set(m.SNIC_READ_BYTES, 1.0, {"node": "p0", "role": "prefill", "path": "pe"})
    with pytest.raises(ValueError, match="takes tags"):
        sink.inc(m.SNIC_READ_BYTES, 1.0, {"node": "p0"})


def test_counter_totals_add_only_the_growth_so_the_counter_equals_the_total() -> None:
    sink = RecordingSink()
    totals = CounterTotals(sink)
    tags = {"node": "p0", "role": "prefill"}
    for total in (0, 4096, 4096, 10_000, 123_456_789):
        totals.update(m.SNIC_WRITE_BYTES, total, tags)
        assert sink.counter(m.SNIC_WRITE_BYTES, **tags) == total, f"after a total of {total} the counter holds it"
    assert sink.increments == 3, "an unchanged total (or zero) is no increment: Ray refuses inc(0)"
    totals.update(m.SNIC_WRITE_BYTES, 7, {"node": "d0", "role": "decode"})
    assert sink.counter(m.SNIC_WRITE_BYTES, node="d0", role="decode") == 7, "each tag set has its own total"


def test_periodic_export_keeps_going_after_a_failed_collect_and_collects_once_more_on_close() -> None:
    calls: list[int] = []
    ticked = threading.Event()

    def collect() -> None:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("a reader call failed")
        ticked.set()

    export = PeriodicExport("test", 0.01, collect).start()
    assert ticked.wait(5), "the thread collects again after a failed collect"
    export.close()
    count = len(calls)
    assert export.failures == 1, "the failure is counted, not raised into the actor"
    export.flush()
    assert len(calls) == count + 1, "flush collects at once"


def test_exporters_report_the_cores_exact_counters_loads_and_memory(tmp_path: Path) -> None:
    h = EngineHarness(config(), tmp_path)
    try:
        sink = RecordingSink()
        readers = {node: ReaderMetrics(sink, core, node_role(h.cfg, node)) for node, core in h.readers.cores.items()}
        engines = [EngineMetrics(sink, PE, "p0", "prefill", h.prefill), EngineMetrics(sink, DE, "d0", "decode", h.decode)]
        context = tokens(70, 1)
        (turn1,) = h.serve([Request("t1", context, "pe")])
        for exporter in [*readers.values(), *engines]:
            exporter.collect()
        context = context + list(turn1.output_tokens) + tokens(20, 2)
        h.serve([Request("t2", context, "pe"), Request("t3", context + tokens(5, 3), "de")])
        for exporter in [*readers.values(), *engines]:
            exporter.collect()
        for node, core in h.readers.cores.items():
            role = node_role(h.cfg, node)
            for path in PATHS:
                assert sink.counter(m.SNIC_READ_BYTES, node=node, role=role, path=path) == core.counters.snic_read[path], (
                    f"{node} {path}: the SNIC read counter equals the reader's exact bytes"
                )
            assert sink.counter(m.SNIC_WRITE_BYTES, node=node, role=role) == core.counters.snic_write, (
                f"{node}: the SNIC write counter equals the reader's exact bytes"
            )
            capacity = core.pool.capacity * core.layout.full_block_bytes
            assert sink.gauge(m.BUFFER_BYTES_CAPACITY, node=node, role=role) == capacity, f"{node}: buffer size"
            assert sink.gauge(m.BUFFER_BYTES_USED, node=node, role=role) == 0, f"{node}: an idle buffer holds nothing"
            assert sink.gauge(m.READ_QUEUE_TOKENS, node=node, role=role) == 0, f"{node}: an idle read queue is empty"
        assert sum(h.readers.cores[n].counters.snic_read[p] for n in ("p0", "d0") for p in PATHS) > 0, "turns 2-3 hit"
        for engine, node, role, core in ((PE, "p0", "prefill", h.prefill), (DE, "d0", "decode", h.decode)):
            for direction, totals in (("in", core.counters.cnic_in), ("out", core.counters.cnic_out)):
                for path in PATHS:
                    got = sink.counter(m.CNIC_BYTES, engine=engine, node=node, role=role, direction=direction, path=path)
                    assert got == totals[path], f"{engine} cnic {direction} {path} equals the core's bytes"
            assert sink.gauge(m.ENGINE_TOKENS, engine=engine, node=node, role=role) == 0, f"{engine}: idle, no tokens"
            assert sink.gauge(m.HBM_BYTES_USED, engine=engine, node=node, role=role) == 0, f"{engine}: idle, no KV held"
        pages = h.decode.pages
        assert sink.gauge(m.HBM_BYTES_CAPACITY, engine=DE, node="d0", role="decode") == pages.capacity * h.layout.full_block_bytes, (
            "decode KV memory is its page pool"
        )
        assert sink.gauge(m.HBM_BYTES_CAPACITY, engine=PE, node="p0", role="prefill") == 3 * h.window.slot_bytes, (
            "prefill KV memory is its 3-slot layer window"
        )
    finally:
        h.close()


def test_kv_load_is_observed_for_stage_calls_with_hits_that_succeed(tmp_path: Path) -> None:
    h = EngineHarness(config(), tmp_path)
    try:
        sink = RecordingSink()
        exporter = ReaderMetrics(sink, h.readers.cores["d0"], "decode")
        with exporter.kv_load(ReadPath.DE, 3):
            pass
        with exporter.kv_load(ReadPath.DE, 0):
            pass
        with pytest.raises(RuntimeError), exporter.kv_load(ReadPath.DE, 2):
            raise RuntimeError("the read failed")
        seen = sink.observations[("dualpath_kv_load_seconds", (("node", "d0"), ("path", "de"), ("role", "decode")))]
        assert len(seen) == 1 and seen[0] >= 0, f"only the successful stage with hits is a KV load: {seen}"
    finally:
        h.close()


def turn(request_id: str, path: str, ttft: float, tpot: float, error: ErrorKind | None = None) -> TurnResult:
    return TurnResult(request_id, 0, (1, 2, 3), (0.0, 0.0, 0.0), "length", 100, 64, path, PE, DE, ttft, tpot,
                      error=None if error is None else "boom", error_kind=error)


def test_scheduler_metrics_observe_turns_count_failures_and_export_its_call_counts() -> None:
    sink = RecordingSink()
    calls = SchedulerCounts()
    metrics = SchedulerMetrics(sink, "dualpath", calls)
    metrics.finished(turn("a", "pe", 0.5, 0.02))
    metrics.finished(turn("b", "de", 0.7, 0.03))
    metrics.finished(turn("c", "de", 0.0, 0.0, ErrorKind.KV_CORRUPT))
    assert sink.observations[("dualpath_ttft_seconds", (("mode", "dualpath"), ("path", "de")))] == [0.7], "TTFT by path"
    assert sink.observations[("dualpath_tpot_seconds", (("mode", "dualpath"), ("path", "pe")))] == [0.02], "TPOT by path"
    assert sink.counter(m.ATTEMPT_FAILURES, mode="dualpath", kind="kv_corrupt") == 1, "a failed attempt counted by kind"
    assert [(t[1], t[3]) for t in metrics.recent_turns()] == [(0.5, "pe"), (0.7, "de")], "served turns are remembered"
    calls.retries, calls.unindexed_blocks, calls.timeouts = 2, 5, 1
    metrics.collect()
    assert sink.counter(m.RETRIES, mode="dualpath") == 2, "retries come from the scheduler's call counts"
    assert sink.counter(m.RECOMPUTED_BLOCKS, mode="dualpath") == 5, "so do the blocks unindexed for a recompute"
    assert sink.counter(m.ATTEMPT_FAILURES, mode="dualpath", kind="timeout") == 1, "timeouts are failures of kind timeout"


def test_scheduler_metrics_time_decisions_and_count_placements_by_path() -> None:
    class Task:
        def __init__(self, path: str, recomputed_tokens: int = 0) -> None:
            self.path, self.recomputed_tokens, self.prefill_engine = path, recomputed_tokens, "prefill/p0/g0"

    sink = RecordingSink()
    metrics = SchedulerMetrics(sink, "basic", SchedulerCounts())
    metrics.decided("prefill", 0.002)  # the rounds report each ask of the core (scheduling/rounds.py)
    metrics.placed([Task("pe"), Task("pe", recomputed_tokens=128), Task("de")])
    assert sink.observations[("dualpath_scheduler_decision_seconds", (("role", "prefill"),))], "the decision is timed"
    assert sink.counter(m.REQUESTS, mode="basic", path="pe") == 2, "placed prefill requests counted by path"
    assert sink.counter(m.REQUESTS, mode="basic", path="de") == 1, "placed prefill requests counted by path"
    assert sink.counter(m.RECOMPUTED_HIT_TOKENS, mode="basic", engine="prefill/p0/g0", why="compute_path") == 128, (
        "hit tokens placed to be computed instead of read are counted per prefill engine"
    )


def test_metrics_off_records_nothing_and_starts_no_thread(tmp_path: Path) -> None:
    cfg = config(metrics=False)
    before = {t.name for t in threading.enumerate()}
    h = EngineHarness(cfg, tmp_path)
    try:
        exporter = ReaderMetrics.start(cfg, h.readers.cores["p0"])
        scheduler = SchedulerMetrics.start(cfg, "dualpath", {})
        assert exporter.export is None and scheduler.export is None, "no exporter thread with runtime.metrics off"
        assert not exporter.sink.enabled, "the sink records nothing"
        started = [t.name for t in threading.enumerate() if t.name not in before and t.name.startswith("metrics-")]
        assert not started, f"no metrics thread runs: {started}"
        exporter.close()
    finally:
        h.close()


def test_metrics_interval_must_be_positive() -> None:
    with pytest.raises(ConfigError, match="runtime.metrics_interval_s"):
        config(metrics_interval_s=0)


def test_scheduler_metrics_export_the_cores_late_hits_and_prefixes_shared_in_flight() -> None:
    """Driven through a real scheduler core: three samples of one prompt, two of which wait for
    the first (tests/unit/scheduling/test_sharing.py has the scenario's figures)."""
    from tests.unit.scheduling.test_sharing import core, result, spec, three_samples

    c, clock = core()
    three_samples(c)
    clock.now = 0.5
    c.finish(result(spec("s0")))
    c.fetch_prefill(GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, 0),), 0))
    sink = RecordingSink()
    metrics = SchedulerMetrics(sink, "dualpath", SchedulerCounts())
    metrics.core = c
    metrics.collect()
    engine = {"mode": "dualpath", "engine": "prefill/p0/g0"}
    assert sink.counter(m.SHARED_PREFIX_TOKENS, **engine) == 256, "2 x 128 prompt tokens read instead of computed"
    assert sink.counter(m.PREFIX_WAITS, **engine) == 2, "two waits, counted for the engine they were placed on"
    assert sink.counter(m.PREFIX_WAIT_SECONDS, **engine) == 1.0, "each waited 0.5 s"
    assert sink.counter(m.LATE_HIT_TOKENS, mode="dualpath") == 256, "found at placement, not at submit"
    metrics.collect()
    assert sink.counter(m.PREFIX_WAITS, **engine) == 2, "a second export adds nothing: counters equal the totals"
