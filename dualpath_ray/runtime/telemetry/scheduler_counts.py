"""What the Scheduler actor counts: the calls it received, the turns it served, and what its
decisions and its watchdog did. One typed record (not a dict with keys added where used), so a
misspelt count is an AttributeError at the line that made it, and the CALLS status view always reports
every count (0 until it happens)."""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass
class SchedulerCounts:
    # calls received
    submit: int = 0  # callers' batched submits
    collect: int = 0  # callers' long-poll collects
    report: int = 0  # engines' step reports (report channel)
    reader_report: int = 0  # readers' read-queue reports (report channel)
    report_errors: int = 0  # parts of reports whose handling raised (a bug: logged, the rest handled)
    # turns
    generate: int = 0  # turns begun
    complete: int = 0  # attempt results handled (current or stale)
    retries: int = 0  # attempts retried
    timeouts: int = 0  # turns failed at runtime.request_timeout_s
    stale_results: int = 0  # results of attempts no longer current
    unindexed_blocks: int = 0  # bad blocks taken out of the index before a retry recomputes them
    aborted: int = 0  # requests aborted (absolute: the aborts' own count)
    adopted: int = 0  # results a restarted incarnation adopted from the engines (absolute)
    adoptable: int = 0  # requests some engine held when this incarnation started (absolute)
    # decisions
    pushes: int = 0  # `accept` calls to prefill engines
    pushed_tasks: int = 0  # tasks those calls carried
    failed_pushes: int = 0  # pushes whose engine did not take them
    # the watchdog
    heartbeats: int = 0  # peers asked
    dead_engines: int = 0
    presumed_dead: int = 0  # of those, judged by silence rather than confirmed by Ray
    restarted_engines: int = 0
    unready_engines: int = 0  # engines that reported not holding the published weights (restarted)
    lost_assignments: int = 0  # attempts no engine named for the grace: retried
    stale_holdings: int = 0  # holdings of attempts no longer current: dropped at the engine
    dead_readers: int = 0
    reader_unavailable: int = 0
    restarted_readers: int = 0
    worlds_formed: int = 0  # gloo worlds formed for restarted endpoints (absolute)

    def as_dict(self) -> dict[str, int]:
        return asdict(self)
