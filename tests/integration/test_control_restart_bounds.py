"""The control actors' restarts are bounded by the config: the Scheduler is restarted at most
runtime.scheduler_max_restarts times, and a call that kills its actor is sent again at most
runtime.max_call_resends times (then its caller gets the error) instead of killing every new
incarnation in turn. On a bare one-node Ray instance: nothing but the actors under test."""

from __future__ import annotations

import os
import tempfile
import time

import pytest

from tests.helpers import ray_test_env

ray_test_env()

import ray  # noqa: E402

from dualpath_ray.config import DualPathConfig  # noqa: E402
from dualpath_ray.runtime.control.plane import EPOCH_SERVING_BITS  # noqa: E402
from dualpath_ray.runtime.control.scheduler import Scheduler  # noqa: E402
from dualpath_ray.runtime.placement.topology import front_end_options, scheduler_options  # noqa: E402

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


def pid_of(actor: ray.actor.ActorHandle) -> int:
    """The process serving `actor` now (a restart is a new process)."""
    return ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=120)


def wait_for_death(actor: ray.actor.ActorHandle, doomed_pid: int, timeout_s: float = 120.0) -> BaseException:
    """The error a call to `actor` gets once the kill of `doomed_pid` landed. ray.kill only asks the
    GCS to kill, so the doomed process may still answer a call sent right after it; a call
    answered by any other process means Ray restarted the actor."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            pid = pid_of(actor)
        except ray.exceptions.RayActorError as error:
            return error
        assert pid == doomed_pid, f"the actor was restarted beyond its bound: process {pid} serves it"
        time.sleep(0.2)
    raise AssertionError(f"process {doomed_pid} still serves the actor {timeout_s} s after its kill")


def test_the_scheduler_is_restarted_at_most_scheduler_max_restarts_times(bare_ray) -> None:
    cfg = DualPathConfig().with_overrides(
        runtime={"namespace": "restart-bounds", "scheduler_max_restarts": 1, "transport": "gloo"}
    )
    scheduler = Scheduler.options(**scheduler_options(cfg, on_head=False)).remote(cfg, tempfile.mkdtemp(), "dualpath")
    assert ray.get(scheduler.ready.remote(), timeout=120), "the scheduler starts"
    epochs = [ray.get(scheduler.collect.remote("probe", None, 0.0), timeout=120).epoch]
    first = pid_of(scheduler)
    ray.kill(scheduler, no_restart=False)
    deadline = time.monotonic() + 120
    while pid_of(scheduler) == first:  # calls resent to the new incarnation (max_call_resends)
        assert time.monotonic() < deadline, "the scheduler's first death is restarted (1 restart allowed)"
        time.sleep(0.2)
    assert ray.get(scheduler.ready.remote(), timeout=120), "the restarted scheduler is ready"
    epochs.append(ray.get(scheduler.collect.remote("probe", None, 0.0), timeout=120).epoch)
    # Invariant: epochs come from the incarnation counter kept in the GCS, not a clock: the next
    # incarnation's is exactly one incarnation above, whatever the clocks did meanwhile.
    assert epochs[1] == epochs[0] + (1 << EPOCH_SERVING_BITS), f"consecutive incarnations' epochs: {epochs}"
    second = pid_of(scheduler)
    ray.kill(scheduler, no_restart=False)
    error = wait_for_death(scheduler, second)
    assert "dead" in str(error).lower() or "died" in str(error).lower(), f"the second death is for good: {error}"


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
