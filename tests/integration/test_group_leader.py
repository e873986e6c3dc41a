"""A group's pull loop (runtime/leader.py) over real Ray actors standing in for its members: a
member written off as dead is taken back once it answers again (Ray restarted it), so the group
never runs two leaders and never leaves a live engine out of its reports for good."""

from __future__ import annotations

from typing import Any

import pytest

from tests.helpers import ray_test_env

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.runtime.leader import ActorDirectory, GroupLeader  # noqa: E402
from dualpath_ray.runtime.messages import LoadReport  # noqa: E402
from dualpath_ray.scheduling.loads import EngineLoad  # noqa: E402
from dualpath_ray.scheduling.types import Role  # noqa: E402

pytestmark = pytest.mark.integration
NAMESPACE = "leader-test"


@ray.remote
class Member:
    """An engine as its group sees it: answers `load` and `load_report`, or raises as one whose
    worker loop died does (which a leader takes for a death, not a slow answer)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.incarnation = "first"
        self.broken = False

    def load(self) -> EngineLoad:
        if self.broken:
            raise RuntimeError(f"{self.name}: worker loop died")
        return EngineLoad(self.name, "d0", 0, 0, 4096)

    def load_report(self) -> LoadReport:
        return LoadReport(self.incarnation, self.load())

    def fail(self) -> None:
        self.broken = True

    def restart(self) -> None:
        self.broken, self.incarnation = False, "second"


@ray.remote
class Reader:
    def queue_report(self) -> tuple[str, int]:
        return "reader-1", 0


@pytest.fixture(scope="module")
def group() -> Any:
    ray.init(num_cpus=2, include_dashboard=False, namespace=NAMESPACE)
    members = {name: Member.options(name=name).remote(name) for name in ("decode/d0/g0", "decode/d0/g1")}
    reader = Reader.options(name="reader/d0").remote()
    ray.get([m.load.remote() for m in members.values()] + [reader.queue_report.remote()])
    standby = GroupLeader(
        Role.DECODE, "d0", list(members), "reader/d0", ActorDirectory(NAMESPACE), "decode/d0/g1",
        lambda: LoadReport("standby", EngineLoad("decode/d0/g1", "d0", 0, 0, 4096)), lambda items: None,
        interval_s=0.1, member_timeout_s=5.0,
    )
    yield members, standby
    ray.shutdown()


def reported(leader: GroupLeader) -> list[str]:
    return [load.engine_id for load in leader.report().engines]


def test_a_written_off_member_that_answers_again_is_taken_back(group) -> None:
    members, standby = group
    first = members["decode/d0/g0"]
    assert not standby.leads(), "g1 stands by while g0 answers"
    assert reported(standby) == ["decode/d0/g1", "decode/d0/g0"], "both members are in the report"

    ray.get(first.fail.remote())
    assert standby.leads(), "g1 leads once g0's worker loop died"
    assert standby.dead == {"decode/d0/g0"}, "g0 is written off (a death, not a slow answer)"
    assert reported(standby) == ["decode/d0/g1"], "a written-off member is left out of the report"
    assert standby.leads() and standby.dead == {"decode/d0/g0"}, "it stays written off while it fails"

    ray.get(first.restart.remote())
    report = standby.report()
    assert [load.engine_id for load in report.engines] == ["decode/d0/g1", "decode/d0/g0"], (
        "the restarted member is back in the report, so it is given work again"
    )
    assert ("decode/d0/g0", "second") in report.incarnations, "with its new incarnation, for the scheduler"
    assert not standby.dead, "it is no longer written off"
    assert not standby.leads(), "g1 hands the lead back: one leader per group"
