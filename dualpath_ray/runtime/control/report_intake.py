"""What engines and readers tell the Scheduler on its report channel, handled on its event loop.

An `EngineReport` is one step of an engine (whether it takes work, the handoffs it took, the
turns that ended, the tokens it streamed); a `ReaderReport` is a reader's read queue. Each part
of a report is handled on its own: one that raises (a bug) is logged and counted and never
costs the others. Before this, a persisted block whose parent had left the index (a repair, a
`reset_prefix_cache` that verl's abort calls by default) raised out of the whole report, whose
frame was still acknowledged, so every result and streamed token in it was lost and those
turns waited for runtime.request_timeout_s.
"""

from __future__ import annotations

import contextlib
import logging
from typing import Iterator

from dualpath_ray.protocol.messages import EngineReport, PeerState, ReaderReport, attempt_owner
from dualpath_ray.runtime.telemetry.scheduler_counts import SchedulerCounts
from dualpath_ray.runtime.control.attempts import Attempts
from dualpath_ray.runtime.control.decisions import Decisions, ReaderStates
from dualpath_ray.runtime.control.streaming import TokenStreams
from dualpath_ray.runtime.control.watchdog import Watchdog
from dualpath_ray.scheduling.liveness import is_attempt
from dualpath_ray.scheduling.scheduler import SchedulerCore

LOG = logging.getLogger("dualpath_ray.scheduler")


class ReportIntake:
    def __init__(
        self, core: SchedulerCore, decisions: Decisions, watchdog: Watchdog, attempts: Attempts, streams: TokenStreams,
        readers: ReaderStates, calls: SchedulerCounts,
    ) -> None:
        self.core = core
        self.decisions = decisions
        self.watchdog = watchdog
        self.attempts = attempts
        self.streams = streams
        self.readers = readers
        self.calls = calls

    def received(self, message: EngineReport | ReaderReport) -> None:
        """A message from the report channel, on this actor's event loop."""
        if isinstance(message, EngineReport):
            self._engine_report(message)
        elif isinstance(message, ReaderReport):
            self._reader_report(message)
        else:
            raise TypeError(f"the report channel carries EngineReport and ReaderReport, not {type(message).__name__}")

    def _engine_report(self, report: EngineReport) -> None:
        """One step of an engine: whether it takes work, the handoffs it took (those attempts
        are decoding and no longer depend on their prefill engines), the turns that ended, the
        tokens it streamed. Each is handled on its own: one that raises (a bug) is logged and
        never costs the others, which would otherwise wait for their deadline (the frame is
        acknowledged either way); a result that raises answers its turn with INTERNAL."""
        self.calls.report += 1
        self.watchdog.observe(report.engine, report.incarnation)
        self.watchdog.engine_ready(report.engine, report.ready)
        for rid, holding in report.handed_off.items():
            with self._isolated(f"the handoff of {rid}"):
                request = self.core.requests.get(rid)
                if request is not None and is_attempt(holding, request.spec):
                    self.decisions.rounds.handed_off(rid)
        for result in report.results:
            try:
                self.attempts.complete(result)
            except Exception as exc:  # noqa: BLE001 - see the docstring
                self.calls.report_errors += 1
                LOG.exception("the result of %s from %s could not be handled", result.owner, report.engine)
                self.attempts.answer_failed(result, exc)
        with self._isolated(f"the streamed tokens of {report.engine}"):
            self.streams.pass_on(report.chunks, self.core.requests)

    @contextlib.contextmanager
    def _isolated(self, what: str) -> Iterator[None]:
        try:
            yield
        except Exception:  # noqa: BLE001 - see _engine_report
            self.calls.report_errors += 1
            LOG.exception("%s could not be handled", what)

    def _reader_report(self, report: ReaderReport) -> None:
        """A reader's read queue changed (or the reader just started), or it holds attempts'
        computed prompt blocks in memory: those are published now (in-flight sharing,
        SchedulerCore.prompt_persisted) if the attempt is still the one in flight."""
        self.calls.reader_report += 1
        self.watchdog.observe(report.reader, report.incarnation)
        self.core.dispatcher.report_read_q(report.node_id, report.read_q_tokens)
        for owner in report.prompts_on_node:
            with self._isolated(f"the prompt of {owner} on {report.node_id}"):
                rid = owner.rsplit("#", 1)[0]
                request = self.core.requests.get(rid)
                if request is not None and attempt_owner(rid, request.spec.attempt, request.spec.epoch) == owner:
                    self.decisions.rounds.prompt_persisted(rid)
        if self.readers.state(report.node_id) is not PeerState.ALIVE and report.node_id not in self.core.readers_dead:
            self.watchdog.reader_state(report.node_id, PeerState.ALIVE)

