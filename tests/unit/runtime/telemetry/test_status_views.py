"""The Scheduler actor's status views (runtime/telemetry/status_views.py): typed and frozen, and
their `to_json()` the flat dicts `dualpath status --json`, the benchmarks and the tests read."""

from __future__ import annotations

import dataclasses

import pytest

from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.telemetry.status_views import (
    CallCounts, ChannelRefusals, RequestView, ServiceView, ToolStagingCounts, TrackedTables,
)


def counts(channel: ChannelRefusals | None) -> CallCounts:
    return CallCounts(
        SchedulerCounts(submit=2, adopted=9, retries=1), {"cancel": 3}, 4, 5, 6, 7, 1, 0, True, 2, 0, 8, 11, 12, 13,
        {"kv_unreadable": 2}, ToolStagingCounts(1, 3, 1, 3, 0, 0, 0, 0), channel,
    )


def test_call_counts_flatten_to_the_keys_call_counts_always_answered() -> None:
    flat = counts(ChannelRefusals(1, 0, 0, 0)).to_json()
    assert flat["submit"] == 2 and flat["retries"] == 1, "the actor's own counts keep their names"
    assert flat["adopted"] == 1, "the adoptions' count overrides the received one, as before"
    assert flat["sent_cancel"] == 3 and flat["reread_elsewhere_kv_unreadable"] == 2, "keyed counts get their prefix"
    assert flat["restarted"] == 1 and flat["queue_full"] == 8, "a restarted incarnation counts 1"
    assert (flat["stage_orders"], flat["stage_order_blocks"], flat["stage_claimed_blocks"]) == (1, 3, 3)
    assert flat["channel_rejected"] == 1, "the report channel's refusals are there once it runs"
    assert all(isinstance(v, int) for v in flat.values()), "every value is a plain count"
    assert not any(k.startswith("channel_") for k in counts(None).to_json()), "and absent before"


def test_views_are_frozen_and_keep_their_json_shape() -> None:
    view = ServiceView(("decode/d0/g0",), (), (), ("d1",), (), ("p0",), {"scheduler": "b", "reader/d0": "a"})
    assert view.to_json() == {
        "dead": ["decode/d0/g0"], "presumed_dead": [], "unready": [], "readers_dead": ["d1"],
        "readers_unavailable": [], "no_pe_reads": ["p0"], "incarnations": ["reader/d0=a", "scheduler=b"],
    }, "the service view's JSON is the lists `status` always printed, incarnations as sorted name=incarnation"
    request = RequestView("prefilling", 1, "prefill/p0/g0", "decode/d0/g0")
    assert request.to_json()["state"] == "prefilling"
    tables = TrackedTables(1, 2, 3, 4, 5, 6, 7, 8, 9, 10)
    assert list(tables.to_json()) == ["requests", "pending", "clients", "suspects", "streams", "running",
                                      "abort_marks", "silent", "unheld", "delivering"], "the soak test's table names"
    with pytest.raises(dataclasses.FrozenInstanceError):
        request.attempt = 2  # type: ignore[misc]
