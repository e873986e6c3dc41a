"""How `dualpath serve` stops: on SIGTERM or SIGINT, within a bounded time, leaving no process.

The first signal starts a graceful stop (`stop_serving`): the endpoint listens no more, requests
in flight get `--shutdown-grace-s` to finish, the rest are aborted (a stream ends with
finish_reason "abort" and [DONE]), then the cluster stops: an embedded one by stopping all of its
processes at once (Ray's own shutdown stops them one at a time, a second or more each), a cluster
at `--address` by tearing down the actors this run deployed (the cluster and anything else on it
stay). Every step is bounded, and the whole stop has a deadline (`stop_deadline_s`): past it, or
on a second signal, what this run started is killed and the process exits at once (128 + the
signal's number after a second signal; else 0, or 1 when the start-up failed).

What this run started (`RunProcesses`) is what carries the mark serve puts in its environment
before it starts anything, what descends from serve, and what has a file open in the embedded
cluster's Ray session directory; a process of another user, of another serve or of another Ray
cluster on the machine has none of these, and neither do an external cluster's workers.

An embedded cluster whose own processes die under the stop (SIGTERM sent to serve's whole
process group or cgroup, as `kill -- -PGID` or systemd's default KillMode do) cannot answer the
graceful steps: each Ray call would wait for a GCS that is gone (60 s; serve stopped after 62 s
with rc 1 so). The stop notices that the cluster is gone and kills what is left at once.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NoReturn

RUN_ENV = "DUALPATH_SERVE_RUN"
DEFAULT_SHUTDOWN_GRACE_S = 3.0
# The endpoint's drain may take this much past its own bound (api/openai_server.py stop_bound_s):
# the abort call and the answer's way back, on a loaded machine.
DRAIN_MARGIN_S = 0.5
# SIGTERM lets a Ray process flush its logs; one still there after this is SIGKILLed.
TERM_WAIT_S = 1.5
# The cluster's part of the stop: the driver's disconnect, the actors' teardown (external) or
# the processes' stop (embedded), measured at 2-3 s on a loaded 2-core machine.
CLUSTER_STOP_S = 4.0
POLL_S = 0.05
# Each look for the run's processes reads /proc of every process the user may read.
SCAN_POLL_S = 0.1


def drain_bound_s(grace_s: float) -> float:
    """The longest the endpoint's drain may take: the grace, the aborted streams' last chunks."""
    from dualpath_ray.api.openai_server import stop_bound_s

    return stop_bound_s(grace_s) + DRAIN_MARGIN_S


def stop_deadline_s(grace_s: float) -> float:
    """The longest a graceful stop may take before what the run started is killed: the drain
    and the cluster's stop (9 s with the default grace)."""
    return drain_bound_s(grace_s) + CLUSTER_STOP_S


class StopRequested(BaseException):
    """Raised in the main thread by the first SIGTERM or SIGINT while serve starts or serves. A
    BaseException, as KeyboardInterrupt, so no `except Exception` on the way swallows it."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _state_and_parent(proc: Path) -> tuple[str, int]:
    """A /proc/PID entry's state letter and parent pid (after the command name, which may hold
    spaces and parentheses: hence the last ')')."""
    fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
    return fields[0], int(fields[1])


def _descends(pid: int, ancestor: int, parents: dict[int, int]) -> bool:
    seen: set[int] = set()
    while pid in parents and pid not in seen:
        seen.add(pid)
        pid = parents[pid]
        if pid == ancestor:
            return True
    return False


@dataclass
class RunProcesses:
    """The processes one serve run started: those whose environment holds the mark
    `RUN_ENV=token`, the descendants of this process, and those with a file open in the
    embedded cluster's Ray session directory (`session_dir`, once it is known).

    Each alone misses some: a Ray worker rewrites its title over the start of its environment
    (setproctitle), which can take the mark with it; a worker or agent whose raylet died is
    reparented away from this process; a process started before the session directory exists
    has nothing open in it. Together they find every one: the mark and the descendants from the
    start, the session directory (every Ray process logs there) once a parent died.
    A zombie (dead, not yet reaped by its parent) counts as gone: nothing of it runs."""

    token: str
    session_dir: str | None = None
    root: int = field(default_factory=os.getpid)  # the process whose descendants are the run's: serve

    @classmethod
    def mark(cls) -> RunProcesses:
        """A fresh mark in this process's environment, set before anything is started: a mark
        inherited from a serve that started this one is replaced, so each run is its own."""
        run = cls(uuid.uuid4().hex)
        os.environ[RUN_ENV] = run.token
        return run

    def pids(self) -> list[int]:
        """The live processes of this run but its root. Another user's processes cannot be read
        and are skipped: they are never this run's."""
        entry = f"{RUN_ENV}={self.token}".encode()
        parents: dict[int, int] = {}
        found: set[int] = set()
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) in (self.root, os.getpid()):
                continue
            pid = int(proc.name)
            try:
                state, ppid = _state_and_parent(proc)
                if state == "Z":  # dead, its parent has not reaped it: nothing left to stop
                    continue
                parents[pid] = ppid
                if entry in (proc / "environ").read_bytes().split(b"\0") or self._holds_session_file(proc):
                    found.add(pid)
            except OSError:
                continue  # gone since the listing, or another user's
        found.update(pid for pid in parents if _descends(pid, self.root, parents))
        return sorted(found)

    def _holds_session_file(self, proc: Path) -> bool:
        if self.session_dir is None:
            return False
        prefix = self.session_dir.rstrip("/") + "/"
        for fd in (proc / "fd").iterdir():
            try:
                if os.readlink(fd).startswith(prefix):
                    return True
            except OSError:
                continue
        return False

    def signal_all(self, signum: int) -> None:
        for pid in self.pids():
            try:
                os.kill(pid, signum)
            except OSError:
                continue  # gone since the listing

    def stop(self, term_wait_s: float = TERM_WAIT_S, kill_wait_s: float = 1.0) -> list[int]:
        """SIGTERM every process of the run at once, SIGKILL those still there after
        term_wait_s; returns the pids still alive (none unless one is stuck in the kernel)."""
        self.signal_all(signal.SIGTERM)
        if _wait_until(lambda: not self.pids(), term_wait_s):
            return []
        return self.kill(kill_wait_s)

    def kill(self, wait_s: float = 1.0) -> list[int]:
        """SIGKILL every process of the run; returns the pids still alive wait_s later."""
        self.signal_all(signal.SIGKILL)
        _wait_until(lambda: not self.pids(), wait_s)
        return self.pids()


def _wait_until(condition: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(SCAN_POLL_S)
    return True


def say(message: str) -> None:
    print(f"dualpath serve: {message}", file=sys.stderr, flush=True)


class StopSignals:
    """SIGTERM and SIGINT for the whole run. The first raises StopRequested in the main thread
    (so it ends a start-up as well as the wait for requests); once `stopping` is set, any
    signal (a second SIGTERM, Ctrl-C again) kills what the run started and exits at once.

    Ray replaces the process's SIGTERM handler: `ray.init` with its own, `ray.shutdown` with
    one that ends the process on the spot (the workers, orphaned, stay: seen), behind Python's
    back (signal.getsignal still names ours). So `install` is called again after each, and
    only the main thread can call it."""

    def __init__(self, processes: RunProcesses) -> None:
        self.processes = processes
        self.stopping = False
        self.previous: dict[int, Any] = {}

    def install(self) -> None:
        for signum in (signal.SIGTERM, signal.SIGINT):
            previous = signal.signal(signum, self._handle)
            self.previous.setdefault(signum, previous)

    def restore(self) -> None:
        for signum, handler in self.previous.items():
            signal.signal(signum, handler)

    def _handle(self, signum: int, frame: object) -> None:
        if self.stopping:
            force_exit(self.processes, f"{signal.Signals(signum).name} while stopping", 128 + signum)
        self.stopping = True  # whatever the main thread does next is the stop
        raise StopRequested(signum)


def force_exit(processes: RunProcesses, why: str, code: int) -> NoReturn:
    """Kill what the run started and exit now, without Python's exit handlers (Ray's would wait
    for a cluster that is gone)."""
    say(f"{why}: killing what this run started")
    left = processes.kill()
    if left:
        say(f"processes still alive after SIGKILL: {left}")
    exit_now(code)


def exit_now(code: int) -> NoReturn:
    """Exit without the interpreter's finalization: once torch and Ray are loaded it takes 2-3 s
    on a loaded 2-core machine (their native destructors; no Python frame runs), a third of the
    stop's bound, and there is nothing left for it to do: the stop ended what the run started."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@dataclass
class Served:
    """What a run has started so far (None: not yet)."""

    cluster: Any = None  # DualPathCluster
    actor: Any = None  # the openai-server actor
    embedded: bool = True


def graceful_stop(served: Served, processes: RunProcesses, grace_s: float, killing: threading.Event) -> None:
    """The stop's steps, each bounded: drain the endpoint, then stop the cluster. `killing` is
    set once the embedded cluster's processes are being stopped on purpose."""
    import ray

    if served.actor is not None:
        try:
            aborted = ray.get(served.actor.stop.remote(grace_s), timeout=drain_bound_s(grace_s))
            if aborted:
                say(f"aborted {aborted} request(s) still running after the {grace_s:g} s grace")
        except Exception as exc:  # noqa: BLE001 - a dead or hung endpoint is killed below all the same
            say(f"the endpoint did not drain: {exc!r}")
        ray.kill(served.actor, no_restart=True)
    cluster = served.cluster
    if cluster is None:
        return
    if not served.embedded:
        # Only what this run deployed: the cluster and whatever else runs on it stay.
        cluster.teardown(stop_timeout_s=1.0)
        ray.shutdown()
        return
    # The whole embedded cluster goes, its actors with it: no teardown one actor at a time.
    ray.shutdown()
    killing.set()
    processes.stop()
    cluster.shutdown(teardown=False)  # Ray's bookkeeping and the store's temporary root; no process is left


def stop_serving(served: Served, processes: RunProcesses, signals: StopSignals, grace_s: float, code: int) -> None:
    """Run `graceful_stop` in a thread while the main thread keeps the signal handlers
    installed (Ray's shutdown replaces them) and watches the deadline: past
    `stop_deadline_s(grace_s)`, or as soon as the embedded cluster's processes died under it,
    what the run started is killed and the process exits with `code`. Returns when the
    graceful stop finished in time and left no process."""
    killing = threading.Event()
    failure: list[BaseException] = []

    def run() -> None:
        try:
            graceful_stop(served, processes, grace_s, killing)
        except BaseException as exc:  # noqa: BLE001 - reported by the waiting thread
            failure.append(exc)

    started = time.monotonic()
    deadline = started + stop_deadline_s(grace_s)
    stopper = threading.Thread(target=run, name="serve-stop", daemon=True)
    stopper.start()
    while stopper.is_alive():
        signals.install()
        stopper.join(POLL_S)
        if time.monotonic() > deadline:
            force_exit(processes, f"not stopped within {stop_deadline_s(grace_s):g} s", code)
        cluster = served.cluster
        if served.embedded and cluster is not None and not killing.is_set() and not cluster.embedded_alive():
            force_exit(processes, "the embedded Ray cluster's processes exited under the stop", code)
    signals.install()
    if failure:
        say(f"the graceful stop failed: {failure[0]!r}")
        force_exit(processes, "stop failed", code)
    left = processes.pids()
    if left:
        force_exit(processes, f"processes of this run outlived the stop: {left}", code)
    say(f"stopped in {time.monotonic() - started:.1f} s")
