"""Engine groups: one group per node, whose first engine (g0) is the leader.

The leader pulls work for its whole group: it gathers its members' load reports and its node's
read queue, calls the scheduler's fetch, and hands each assignment to the engine it names.
Members answer `load` and take work on their `control` concurrency group, so a member busy
computing still answers at once.
"""

from __future__ import annotations

import threading
from collections import defaultdict
from typing import Any, Callable, Literal

import ray

from dualpath_ray.runtime.messages import GroupReport
from dualpath_ray.scheduling import EngineLoad


class ActorDirectory:
    """Named actors of one namespace, looked up once and cached."""

    def __init__(self, namespace: str) -> None:
        self.namespace = namespace
        self._handles: dict[str, Any] = {}

    def get(self, name: str) -> Any:
        if name not in self._handles:
            self._handles[name] = ray.get_actor(name, namespace=self.namespace)
        return self._handles[name]


class GroupLeader:
    """The pull loop of one engine group, run on a thread of the leader engine."""

    def __init__(
        self,
        role: Literal["prefill", "decode"],
        node_id: str,
        members: list[str],
        reader: str,
        directory: ActorDirectory,
        local_name: str,
        local_load: Callable[[], EngineLoad],
        local_accept: Callable[[list[Any]], None],
        interval_s: float,
        wait_s: float = 0.0,
    ) -> None:
        self.role = role
        self.node_id = node_id
        self.members = members
        self.reader = reader
        self.directory = directory
        self.local_name = local_name
        self.local_load = local_load
        self.local_accept = local_accept
        self.interval_s = interval_s
        self.wait_s = wait_s
        self.stopped = threading.Event()
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            while not self.stopped.is_set():
                # The scheduler holds an empty fetch up to wait_s until new work may exist, so
                # an idle group does not poll; interval_s only spaces pulls that found nothing.
                if not self.pull_once():
                    self.stopped.wait(self.interval_s)
        except BaseException as exc:  # noqa: BLE001 - surfaced through the engine's health()
            if not self.stopped.is_set():
                self.error = exc

    def report(self) -> GroupReport:
        others = [m for m in self.members if m != self.local_name]
        refs = [self.directory.get(m).load.remote() for m in others]
        read_q_ref = self.directory.get(self.reader).read_q.remote()
        loads = [self.local_load(), *ray.get(refs)]
        return GroupReport(f"{self.role}/{self.node_id}", self.node_id, tuple(loads), ray.get(read_q_ref))

    def pull_once(self) -> bool:
        """One fetch; True when something was assigned."""
        scheduler = self.directory.get("scheduler")
        report = self.report()
        if self.role == "prefill":
            work = ray.get(scheduler.fetch_prefill.remote(report, self.wait_s))
            by_engine = _group_by(work, lambda task: task.prefill_engine)
        else:
            work = ray.get(scheduler.fetch_decode.remote(report, self.wait_s))
            by_engine = _group_by(work, lambda reservation: reservation.decode_engine)
        pending = []
        for engine, items in by_engine.items():
            if engine == self.local_name:
                self.local_accept(items)
            else:
                pending.append(self.directory.get(engine).accept.remote(items))
        # Reservations must be in place before the next report, or free HBM is counted twice.
        ray.get(pending)
        return bool(work)


def _group_by(items: list[Any], key: Callable[[Any], str]) -> dict[str, list[Any]]:
    grouped: dict[str, list[Any]] = defaultdict(list)
    for item in items:
        grouped[key(item)].append(item)
    return grouped


def start_thread(target: Callable[[], None], name: str) -> threading.Thread:
    thread = threading.Thread(target=target, name=name, daemon=True)
    thread.start()
    return thread

