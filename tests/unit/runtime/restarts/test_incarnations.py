"""Actor restarts without Ray: incarnations, what a silent peer is taken for, what the scheduler
fails when an engine or reader comes back as a new process, routing around a reader that is
only unavailable, rejoining the transport, and a kill fault that ends the first incarnation only."""

from __future__ import annotations

from pathlib import Path

import pytest
import ray.exceptions

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultInjector
from dualpath_ray.faults.plan import FaultPlan, FaultSite
from dualpath_ray.protocol.messages import GroupReport, PeerState
from dualpath_ray.runtime.reader.actor import build_core as build_reader_core
from dualpath_ray.runtime.restarts.incarnations import IncarnationTracker, TransportKeeper, peer_state_of, rejoin_transport
from dualpath_ray.runtime.control.scheduler_core import build_core
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.runtime.transport.moves import PeerDiedError, TransportState
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.requests import RequestState
from dualpath_ray.protocol.types import Role
from tests.unit.runtime.engine.test_failures import core_with_chain

FREE = 1 << 20


def test_a_new_incarnation_is_a_restart_and_the_first_sighting_is_not() -> None:
    tracker = IncarnationTracker()
    assert not tracker.observe("decode/d0/g0", "a"), "the first incarnation seen is no restart"
    assert not tracker.observe("decode/d0/g0", "a"), "the same incarnation again is no restart"
    assert not tracker.observe("reader/d0", ""), "an unnamed incarnation (an old peer) is ignored"
    assert tracker.observe("decode/d0/g0", "b"), "another incarnation under the same name is a restart"
    assert tracker.restarts == 1 and tracker.known["decode/d0/g0"] == "b", "counted once; the new one is known"


@pytest.mark.parametrize(
    ("error", "state"),
    [
        (ray.exceptions.GetTimeoutError("slow"), PeerState.SILENT),
        (TimeoutError("heartbeat dropped"), PeerState.SILENT),
        (ray.exceptions.ActorUnavailableError("restarting", None), PeerState.RESTARTING),
        (ray.exceptions.ActorDiedError(), PeerState.DEAD),
        (PeerDiedError("no actor of that name"), PeerState.DEAD),
        (RuntimeError("worker loop died"), PeerState.DEAD),
    ],
)
def test_silence_restart_and_death_are_told_apart(error: BaseException, state: PeerState) -> None:
    assert peer_state_of(error) is state, f"{type(error).__name__} means {state.value}"


def decode_report(core: SchedulerCore, reader: PeerState = PeerState.ALIVE, *engines: str) -> GroupReport:
    names = engines or ("decode/d0/g0", "decode/d0/g1")
    return GroupReport("decode/d0", "d0", tuple(EngineLoad(e, "d0", 0, 0, FREE) for e in names), 0, reader)


def prefill_report(reader: PeerState = PeerState.ALIVE) -> GroupReport:
    return GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, 0),), 0, reader)


def test_a_restarted_engine_hands_back_its_requests_and_takes_work_again(tmp_path: Path) -> None:
    core, _, spec = core_with_chain(tmp_path)
    core.submit(spec)
    (placed,) = core.fetch_decode(decode_report(core))
    core.engine_died(placed.decode_engine, confirmed=False)
    assert core.engine_restarted(placed.decode_engine) == [spec], (
        "the request reserved on the dead incarnation is returned, to be failed and retried"
    )
    assert placed.decode_engine not in core.out_of_service(), "the new incarnation is in service at once"


def test_a_restarted_reader_fails_what_was_staged_through_its_node_only(tmp_path: Path) -> None:
    core, _, spec = core_with_chain(tmp_path)
    core.submit(spec)
    core.fetch_decode(decode_report(core))
    assert core.reader_restarted("d0") == [], "a request not yet prefilling holds no extent there"
    (task,) = core.fetch_prefill(prefill_report())
    assert core.dispatcher.requests[spec.request_id].state is RequestState.PREFILLING
    assert core.reader_restarted("d1") == [], "another node's reader holds nothing of it"
    assert core.reader_restarted(task.decode_node) == [spec], "its extents on the restarted reader are gone"


def test_an_unavailable_reader_is_routed_around_without_failing_anything(tmp_path: Path) -> None:
    core, _, spec = core_with_chain(tmp_path)
    core.submit(spec)
    for state in (PeerState.SILENT, PeerState.RESTARTING):
        assert core.note_report(Role.DECODE, decode_report(core, state)) == [], f"a {state.value} reader fails nothing"
        assert core.fetch_decode(decode_report(core, state)) == [], (
            f"a decode group whose reader is {state.value} gets no work (its KV would pass through that reader)"
        )
    assert not core.out_of_service(), "no decode engine is taken out for its reader's silence"
    core.note_report(Role.DECODE, decode_report(core))
    assert len(core.fetch_decode(decode_report(core))) == 1, "the group takes work again once its reader answers"
    assert core.note_report(Role.PREFILL, prefill_report(PeerState.RESTARTING)) == [], "nothing failed"
    assert core.dispatcher.no_pe_reads == {"p0"}, "meanwhile the prefill node's hits are read through the DE path"
    (task,) = core.fetch_prefill(prefill_report(PeerState.RESTARTING))
    assert task.path == "de", "a dualpath prefill group keeps working, reading through the decode node"
    core.note_report(Role.PREFILL, prefill_report())
    assert not core.dispatcher.no_pe_reads, "the PE path is back once the reader answers"


def test_basic_mode_gives_a_prefill_group_no_work_while_its_reader_is_unavailable(tmp_path: Path) -> None:
    cfg = DualPathConfig().with_overrides(store={"root": str(tmp_path)})
    core = build_core(cfg, str(tmp_path), "basic")
    _, _, spec = core_with_chain(tmp_path)
    core.submit(spec)
    core.fetch_decode(decode_report(core))
    assert core.fetch_prefill(prefill_report(PeerState.SILENT)) == [], "basic mode reads only through the PE side"
    assert len(core.fetch_prefill(prefill_report())) == 1, "it is placed once the reader answers"


class FakeTransport:
    endpoint_name = "decode/d0/g0"

    def __init__(self) -> None:
        self.state = TransportState.AWAITING_WORLD
        self.on_broken = None


def test_a_restarted_gloo_endpoint_asks_for_a_world_until_it_is_in_one() -> None:
    transport = FakeTransport()
    asked: list[int] = []

    def reform() -> bool:
        asked.append(1)
        if len(asked) == 1:
            raise ray.exceptions.ActorUnavailableError("the scheduler is restarting", None)
        transport.state = TransportState.READY
        return True

    assert rejoin_transport(transport, reform, timeout_s=5.0), "ready once a world was formed"  # type: ignore[arg-type]
    assert len(asked) == 2, "a failed request is asked again"
    never = FakeTransport()
    assert not rejoin_transport(never, lambda: False, timeout_s=0.2), "not ready within the bound: False"  # type: ignore[arg-type]


def test_a_kill_fault_ends_the_first_incarnation_only() -> None:
    plan = FaultPlan.model_validate({"faults": [
        {"site": "layer_transfer", "mode": "kill", "nth": 1},
        {"site": "layer_transfer", "mode": "fail", "probability": 1.0},
    ]})
    restarted = FaultInjector(plan, "prefill/p0/g0", restarted=True)
    decided = restarted.decide(FaultSite.LAYER_TRANSFER)
    assert decided is not None and decided.mode.value == "fail", "the restarted process keeps the other faults"
    assert set(restarted.counts()) == {"layer_transfer:fail"}, "and has no kill left to fire"


def test_grants_name_the_reader_incarnation(tmp_path: Path) -> None:
    cfg = DualPathConfig().with_overrides(store={"root": str(tmp_path)}, cluster={"buffer_blocks_per_node": 4})
    core = build_reader_core(cfg, "d0", str(tmp_path), incarnation="abc")
    grant = core.grant(core.lease("r#0", 2), "reader/d0")
    assert grant.incarnation == "abc", "a grant says which process's extent ids it names"


def test_a_broken_world_is_healed_in_the_background_once_however_often_it_is_reported(monkeypatch) -> None:
    import threading
    from tests.helpers import wait_until

    transport = FakeTransport()
    keeper = TransportKeeper(transport, "dualpath", timeout_s=5.0)  # type: ignore[arg-type]
    assert transport.on_broken == keeper.heal, "the keeper hears of every abort"
    release = threading.Event()
    asked: list[int] = []

    def reform() -> bool:
        asked.append(1)
        release.wait(5.0)
        transport.state = TransportState.READY
        return True

    monkeypatch.setattr(keeper, "_reform", reform)
    transport.state = TransportState.BROKEN
    ran: list[str] = []
    keeper.heal(then=lambda: ran.append("started"))
    transport.on_broken()  # a second abort while the first heal runs
    release.set()
    wait_until(lambda: bool(ran))
    assert transport.state is TransportState.READY and ran == ["started"], "healed, then the follow-up ran"
    assert keeper.heals == 1 and len(asked) == 1, "a report while healing asks for no second world"


def test_a_restarted_endpoint_is_announced_only_once_it_rejoined_the_transport(monkeypatch) -> None:
    import threading
    from tests.helpers import wait_until

    from dualpath_ray.runtime.transport.moves import TransportError

    transport = FakeTransport()
    keeper = TransportKeeper(transport, "dualpath", timeout_s=5.0)  # type: ignore[arg-type]
    keeper.require_joined()  # a first incarnation is never held back
    release = threading.Event()

    def reform() -> bool:
        release.wait(5.0)
        transport.state = TransportState.READY
        return True

    monkeypatch.setattr(keeper, "_reform", reform)
    announced: list[str] = []
    keeper.rejoin_then(lambda: announced.append("report"))
    with pytest.raises(TransportError, match="rejoining"):
        keeper.require_joined()  # a heartbeat answer while the world is formed again
    assert not announced, "nothing tells the scheduler of the new incarnation before it is in a world"
    release.set()
    wait_until(lambda: bool(announced))
    assert announced == ["report"] and transport.state is TransportState.READY, "announced once it rejoined"
    keeper.require_joined()  # answers again
