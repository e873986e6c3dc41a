"""The NIXL transport's UCX progress: event-driven, so idle agents cost no CPU, yet a passive peer
that never calls its agent still serves one-sided READs and WRITEs promptly.

Two real NixlTransport endpoints live in this process (no Ray: each one's peer lookup is wired to
the other's `info()`); only the threads the agents start are measured.
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Iterator

import pytest
import torch

pytest.importorskip("nixl", reason="the nixl extra is not installed")

import dualpath_ray.runtime.transport.nixl as nixl_transport  # noqa: E402
from dualpath_ray.runtime.transport.moves import Region, TransportStats  # noqa: E402
from dualpath_ray.runtime.transport.nixl import PROGRESS_FALLBACK_US, NixlTransport  # noqa: E402

pytestmark = [pytest.mark.nixl, pytest.mark.timeout(60)]

POOL_BYTES = 1 << 20
MOVE_BYTES = 64 << 10
IDLE_S = 2.0
# Per thread started by the agents, over the idle window: a busy-spinning progress thread
# (pthrDelay 0) burns ~IDLE_S CPU-s, the old 1 ms Python progress thread woke ~2000 times. An
# idle process cannot burn more CPU for being on a slow machine, so the CPU bound is absolute.
MAX_IDLE_CPU_S = 0.1
# A fallback wake-up (pthrDelay) the passive peer never reaches within the test's timeout: a move
# completes only if UCX events wake its progress thread.
UNREACHED_FALLBACK_US = 600_000_000


def max_idle_wakeups(window_s: float) -> int:
    """Wake-ups an idle agent thread may have over a window of window_s: its fallback wake-up
    (with slack for one more, poll() may return twice) plus 6. The window is measured around
    the sleep, so a slow machine that oversleeps allows as many more as it had time for."""
    return 2 * math.ceil(window_s * 1e6 / PROGRESS_FALLBACK_US) + 6


def _tids() -> set[int]:
    return {int(tid) for tid in os.listdir("/proc/self/task")}


def _thread_usage(tid: int) -> tuple[float, int]:
    """(CPU seconds, context switches) of one thread of this process so far."""
    with open(f"/proc/self/task/{tid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    cpu_s = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    switches = 0
    with open(f"/proc/self/task/{tid}/status") as status:
        for line in status:
            if line.startswith(("voluntary_ctxt_switches", "nonvoluntary_ctxt_switches")):
                switches += int(line.split()[1])
    return cpu_s, switches


def _endpoint(name: str, seed: int) -> tuple[NixlTransport, torch.Tensor]:
    pool = torch.randint(0, 256, (POOL_BYTES,), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
    transport = NixlTransport(name, "dualpath-test", timeout_s=10.0)
    transport.register("hbm", pool)
    transport.seal()
    return transport, pool


Endpoints = tuple[NixlTransport, torch.Tensor, NixlTransport, torch.Tensor, set[int]]


@pytest.fixture
def endpoints(monkeypatch: pytest.MonkeyPatch) -> Iterator[Endpoints]:
    """An initiator and a passive endpoint, plus the ids of the threads their agents started."""
    before = _tids()
    initiator, initiator_pool = _endpoint("prefill/n0/g0", seed=1)
    passive, passive_pool = _endpoint("reader/n1", seed=2)
    infos = {initiator.endpoint_name: initiator.info(), passive.endpoint_name: passive.info()}
    # The only Ray call a NIXL move makes is the peer's info request: answer it in-process.
    for transport in (initiator, passive):
        monkeypatch.setattr(transport, "_call_peer", lambda peer, request, timeout_s=None: infos[peer])
    yield initiator, initiator_pool, passive, passive_pool, _tids() - before
    initiator.close()
    passive.close()


def _moves_between(
    initiator: NixlTransport, initiator_pool: torch.Tensor, passive: NixlTransport, passive_pool: torch.Tensor
) -> list[float]:
    """A READ then a WRITE per round, each checked byte for byte; returns the moves' sizes."""
    moved = []
    for round_ in range(8):
        offset = round_ * MOVE_BYTES
        here, there = Region("hbm", offset, MOVE_BYTES), Region("hbm", POOL_BYTES - MOVE_BYTES - offset, MOVE_BYTES)
        moved.append(initiator.read(passive.endpoint_name, [(here, there)]).wait())
        assert torch.equal(initiator_pool[here.offset : here.end], passive_pool[there.offset : there.end]), (
            f"round {round_}: the READ must land the passive pool's bytes in the initiator's"
        )
        initiator_pool[here.offset : here.end] = round_
        moved.append(initiator.write(passive.endpoint_name, [(here, there)]).wait())
        assert bool((passive_pool[there.offset : there.end] == round_).all()), (
            f"round {round_}: the WRITE must land the initiator's bytes in the passive pool"
        )
    return moved


def test_idle_agents_sleep_between_ucx_events(endpoints: Endpoints) -> None:
    initiator, initiator_pool, passive, passive_pool, agent_threads = endpoints
    assert agent_threads, "each NIXL agent must run its own UCX progress thread (it serves passive peers)"
    _moves_between(initiator, initiator_pool, passive, passive_pool)  # connected endpoints, then idle
    window_started = time.monotonic()
    before = {tid: _thread_usage(tid) for tid in agent_threads}
    time.sleep(IDLE_S)
    after = {tid: _thread_usage(tid) for tid in agent_threads}
    window_s = time.monotonic() - window_started
    for tid, (cpu_s, switches) in before.items():
        cpu_after, switches_after = after[tid]
        assert cpu_after - cpu_s < MAX_IDLE_CPU_S, (
            f"agent thread {tid} burnt {cpu_after - cpu_s:.2f} CPU-s in {IDLE_S} s idle: the UCX progress "
            f"thread must sleep in poll() between events, not spin (pthrDelay must be {PROGRESS_FALLBACK_US} us)"
        )
        assert switches_after - switches <= max_idle_wakeups(window_s), (
            f"agent thread {tid} woke {switches_after - switches} times in {window_s:.2f} s idle: nothing may wake an "
            f"idle process more often than once per PROGRESS_FALLBACK_US ({PROGRESS_FALLBACK_US} us)"
        )
    stats = initiator.stats()
    assert stats.bytes_read == stats.bytes_written == 8 * MOVE_BYTES, f"every move must be counted once: {stats}"
    assert passive.stats() == TransportStats(), "the passive endpoint must not have run a single move itself"


def test_passive_peer_serves_rma_emulated_over_tcp_promptly(monkeypatch: pytest.MonkeyPatch) -> None:
    # Over tcp UCX emulates RMA with active messages the target must handle, so the passive
    # endpoint's progress thread (nothing else runs its agent) has to wake on every move. Its
    # fallback wake-up is put out of reach (UNREACHED_FALLBACK_US): if UCX events did not wake it,
    # the first move would wait for it and the test's timeout would fail it; no move is timed.
    monkeypatch.setenv("UCX_TLS", "tcp")  # read when each agent's UCX context is created
    initiator, initiator_pool = _endpoint("prefill/n0/g0", seed=3)
    create, delays = nixl_transport.new_nixl_agent, []

    def agent_without_fallback(name: str) -> object:
        delays.append(UNREACHED_FALLBACK_US)
        return create(name, UNREACHED_FALLBACK_US)

    monkeypatch.setattr(nixl_transport, "new_nixl_agent", agent_without_fallback)
    before = _tids()
    passive, passive_pool = _endpoint("reader/n1", seed=4)
    passive_threads = _tids() - before  # its UCX progress thread (UCX's async thread is older)
    infos = {initiator.endpoint_name: initiator.info(), passive.endpoint_name: passive.info()}
    monkeypatch.setattr(initiator, "_call_peer", lambda peer, request, timeout_s=None: infos[peer])
    try:
        wakeups_before = sum(_thread_usage(tid)[1] for tid in passive_threads)
        moves = len(_moves_between(initiator, initiator_pool, passive, passive_pool))
        wakeups = sum(_thread_usage(tid)[1] for tid in passive_threads) - wakeups_before
    finally:
        initiator.close()
        passive.close()
    assert delays == [UNREACHED_FALLBACK_US], "the passive agent was created without a reachable fallback wake-up"
    assert moves == 16, "every READ and WRITE to the passive peer completed without its fallback wake-up"
    assert wakeups >= moves, (
        f"the passive agent's threads woke {wakeups} times for {moves} moves over tcp: its "
        "progress thread must wake to serve each emulated READ/WRITE (is UCX_TLS=tcp honoured?)"
    )
