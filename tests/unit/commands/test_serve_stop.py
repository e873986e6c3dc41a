"""What `dualpath serve` stops when it stops (commands/serve_stop.py), without Ray: the run's
processes are found by the mark in their environment, by descent, or by a file open in the
embedded cluster's session directory, each of which alone misses some; a process that has none
of them (another user's Ray, say) is never touched. And the grace flag is checked before
anything starts."""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from dualpath_ray.cli import build_parser
from dualpath_ray.commands.serve import main
from dualpath_ray.commands.serve_stop import RUN_ENV, RunProcesses, stop_deadline_s


def orphan(command: str, env: dict[str, str]) -> int:
    """A process whose parent (a shell) exited at once, so it is not a descendant of this one:
    what a Ray worker becomes when its raylet dies."""
    out = subprocess.run(["sh", "-c", f"{command} >/dev/null 2>&1 & echo $!"], env=env, capture_output=True,
                         text=True, check=True)
    return int(out.stdout)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.fixture
def started() -> Iterator[list[int]]:
    """The pids a test started; whatever of them still runs at its end is killed."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


def holder(started: list[int]) -> tuple[subprocess.Popen[bytes], int]:
    """A process with a child of its own (the stand-in for serve and a raylet it started), and
    that child's pid."""
    parent = subprocess.Popen(["sh", "-c", "sleep 60 & wait"], env=plain_env())
    started.append(parent.pid)
    children = Path(f"/proc/{parent.pid}/task/{parent.pid}/children")
    deadline = time.monotonic() + 10
    while not children.read_text().split() and time.monotonic() < deadline:
        time.sleep(0.02)
    child = int(children.read_text().split()[0])
    started.append(child)
    return parent, child


def plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != RUN_ENV}


def test_the_run_is_its_marked_its_descendant_and_its_session_s_processes_and_no_other(
        tmp_path: Path, started: list[int]) -> None:
    session = tmp_path / "session_1"
    session.mkdir()
    serve, child = holder(started)
    run = RunProcesses("test-run-token", str(session), root=serve.pid)
    marked = orphan("sleep 60", {**plain_env(), RUN_ENV: run.token})
    logging = orphan(f"exec 3>{session}/worker.out; sleep 60", plain_env())
    stranger = orphan("sleep 60", {**plain_env(), RUN_ENV: "another-run"})
    started.extend([marked, logging, stranger])

    found = run.pids()
    assert child in found, "a descendant of serve is the run's (started before any mark or session existed)"
    assert marked in found, "a process carrying the run's mark is the run's, though reparented"
    assert logging in found, "a process with a file open in the run's Ray session directory is the run's"
    assert stranger not in found, "a process of another run (or another user's Ray) is never the run's"
    assert serve.pid not in found and os.getpid() not in found, "the run's root (serve itself) is not stopped"

    assert run.stop(term_wait_s=2.0) == [], "stop leaves none of the run's processes"
    assert not any(map(alive, [child, marked, logging])), "the run's processes are gone, orphans included"
    assert alive(stranger), "stop never signals a process that is not the run's"


def test_what_ignores_sigterm_is_killed(started: list[int]) -> None:
    serve = subprocess.Popen(["sh", "-c", "trap '' TERM; sleep 60 & wait"], env=plain_env())  # sleep ignores it too
    started.append(serve.pid)
    run = RunProcesses("test-run-token", root=serve.pid)
    deadline = time.monotonic() + 10
    while not run.pids() and time.monotonic() < deadline:
        time.sleep(0.02)
    stubborn = run.pids()
    started.extend(stubborn)
    assert stubborn, "the stand-in for serve started its child"
    assert run.stop(term_wait_s=0.5) == [], "what outlives SIGTERM is SIGKILLed"
    assert not any(map(alive, stubborn))


def test_a_negative_grace_ends_the_command_before_anything_starts() -> None:
    args = build_parser().parse_args(["serve", "--shutdown-grace-s", "-1"])
    with pytest.raises(SystemExit, match="--shutdown-grace-s must be >= 0"):
        main(args)


def test_the_default_grace_stops_within_ten_seconds() -> None:
    grace = build_parser().parse_args(["serve"]).shutdown_grace_s
    assert stop_deadline_s(grace) < 10.0, "the whole stop, drain and cluster, is bounded under 10 s by default"
