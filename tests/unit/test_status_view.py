"""`dualpath status`'s figures and text view from a snapshot (collecting one from a live cluster
is tested in tests/integration/test_observability.py)."""

from __future__ import annotations

import dataclasses
import json

from dualpath_ray.observability.status import ClusterStatus, EngineView, RayNodeView, ReaderView, emulation_state, latency
from dualpath_ray.observability.status_view import human_bytes, render


def test_latency_takes_the_turns_of_the_window_and_skips_single_token_tpot() -> None:
    now = 1000.0
    recent = [(900.0, 9.0, 0.9, "pe"), (990.0, 0.1, 0.01, "pe"), (995.0, 0.3, 0.0, "de"), (999.0, 0.2, 0.02, "de")]
    view = latency(recent, now, window_s=60)
    assert view.turns == 3 and view.turns_by_path == {"pe": 1, "de": 2}, "only turns of the last 60 s count"
    assert view.ttft_s["p50"] == 0.2, f"TTFT median of 0.1, 0.3, 0.2: {view.ttft_s}"
    assert view.tpot_s["p50"] == 0.015, f"TPOT over turns with more than one token only: {view.tpot_s}"
    assert latency([], now, 60).ttft_s == {}, "no turns, no percentiles"


def snapshot(deployed: bool) -> ClusterStatus:
    status = ClusterStatus("dualpath", 0.0, [RayNodeView("a" * 56, "10.0.0.1", "prefill", True, 2, 1, ["p0"])], deployed)
    if deployed:
        status.mode = "dualpath"
        status.readers = [ReaderView("p0", True, 640, {"pe": 2_500_000, "de": 0}, 0, 3, 64), ReaderView("d0", False)]
        status.engines = [EngineView("prefill/p0/g0", "prefill", "p0", True, 2, 900, 0, {"pe": 10, "de": 0}, {"pe": 0, "de": 0})]
        status.snic_read_by_path = {"pe": 2_500_000, "de": 2_500_000}
        status.latency = latency([(0.0, 0.25, 0.01, "pe")], 0.0, 60)
    return status


def test_render_shows_nodes_readers_engines_paths_and_latency() -> None:
    text = render(snapshot(deployed=True))
    for expected in ("prefill", "p0", "640", "2.5 MB / 0 B", "3/64", "d0", "not answering", "prefill/p0/g0", "900",
                     "pe 2.5 MB (50%), de 2.5 MB (50%)", "TTFT p50 0.250 s", "TPOT p50 10.0 ms"):
        assert expected in text, f"the view shows {expected!r}:\n{text}"
    assert json.loads(json.dumps(dataclasses.asdict(snapshot(True))))["readers"][0]["read_q_tokens"] == 640, (
        "the snapshot is JSON as it is"
    )


def test_render_says_when_nothing_is_deployed() -> None:
    assert "No dualpath deployment answers in namespace 'dualpath'" in render(snapshot(deployed=False)), (
        "an empty namespace is named, with the flag that picks another"
    )
    assert [human_bytes(n) for n in (0, 999, 1500, 2_000_000_000)] == ["0 B", "999 B", "1.5 KB", "2.0 GB"], "units"


def test_status_shows_emulation_and_each_readers_buffer_pinning() -> None:
    status = snapshot(deployed=True)
    status.readers = [
        ReaderView("p0", True, 0, {}, 0, 0, 64, "n1", True, "pinned (cudaHostRegister)", False),
        ReaderView("d0", True, 0, {}, 0, 0, 64, "n2", False, "not pinned: CUDA_VISIBLE_DEVICES is empty", False),
    ]
    status.emulation = emulation_state(status.readers)
    text = render(status)
    assert "emulation off" in text, f"the deployment line says whether NICs are emulated:\n{text}"
    assert "PINNED" in text and "d0: not pinned: CUDA_VISIBLE_DEVICES is empty" in text, (
        f"each reader's buffer pinning is shown, with the reason where it is not pinned:\n{text}"
    )
    assert emulation_state([ReaderView("p0", True, emulation=True), ReaderView("d0", True, emulation=False)]) == "mixed", (
        "readers that disagree are shown as mixed"
    )
    assert emulation_state([ReaderView("p0", False)]) == "unknown", "no reader said: unknown"
