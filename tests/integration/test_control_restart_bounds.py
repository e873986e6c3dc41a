"""The control actors' restarts are bounded by the config: the Scheduler is restarted at most
runtime.scheduler_max_restarts times, and a call that kills its actor is sent again at most
runtime.max_call_resends times (then its caller gets the error) instead of killing every new
incarnation in turn. On a bare one-node Ray instance: nothing but the actors under test."""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.helpers import ray_test_env

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.runtime.control.scheduler import Scheduler  # noqa: E402
from dualpath_ray.runtime.deploy.topology import front_end_options, scheduler_options  # noqa: E402

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def bare_ray():
    ray.init(address="local", num_cpus=1, include_dashboard=False, namespace="restart-bounds")
    yield
    ray.shutdown()


@ray.remote(num_cpus=0)
class Mortal:
    """Counts its incarnations in a file (a restart runs __init__ again); `die` kills it."""

    def __init__(self, tally: str) -> None:
        with open(tally, "a") as out:
            out.write("x")

    def die(self) -> None:
        os._exit(1)

    def alive(self) -> bool:
        return True


def test_the_scheduler_is_restarted_at_most_scheduler_max_restarts_times(bare_ray) -> None:
    cfg = DualPathConfig().with_overrides(
        runtime={"namespace": "restart-bounds", "scheduler_max_restarts": 1, "transport": "gloo"}
    )
    scheduler = Scheduler.options(**scheduler_options(cfg, on_head=False)).remote(cfg, tempfile.mkdtemp(), "dualpath")
    assert ray.get(scheduler.ready.remote(), timeout=120), "the scheduler starts"
    ray.kill(scheduler, no_restart=False)
    assert ray.get(scheduler.ready.remote(), timeout=120), "its first death is restarted (1 restart allowed)"
    ray.kill(scheduler, no_restart=False)
    with pytest.raises(ray.exceptions.RayActorError, match="(?i)dead|died"):  # the second death is for good
        ray.get(scheduler.ready.remote(), timeout=120)


def test_a_call_that_kills_its_actor_is_sent_again_at_most_max_call_resends_times(bare_ray) -> None:
    cfg = DualPathConfig().with_overrides(
        runtime={"namespace": "restart-bounds", "front_end_max_restarts": 5, "max_call_resends": 1}
    )
    tally = tempfile.mktemp()
    mortal = Mortal.options(**front_end_options(cfg, "mortal")).remote(tally)
    assert ray.get(mortal.alive.remote(), timeout=60), "the actor starts"
    with pytest.raises(ray.exceptions.RayActorError):
        ray.get(mortal.die.remote(), timeout=120)
    assert ray.get(mortal.alive.remote(), timeout=120), "restarts are left: the poison call did not use them up"
    with open(tally) as counted:
        incarnations = len(counted.read())
    assert incarnations == 3, f"the call ran once and was sent again once (2 deaths, 3 incarnations): {incarnations}"
