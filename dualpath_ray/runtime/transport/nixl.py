"""NIXL backend of the KV transport: one-sided READ/WRITE through the nixl agent API.

One ``nixl_agent`` per endpoint process, named ``{endpoint}#{incarnation}``, UCX backend with
its progress thread ("Progress" below). Pools are registered with the agent once; `seal`
publishes the agent metadata (taken after every registration, so it covers all pools) and each
pool's base address in `EndpointInfo.backend`. A peer loads that metadata once
(``add_remote_agent``, cached by agent name, i.e. per incarnation). A transfer is then
``initialize_xfer`` over two Nx3 descriptor arrays (address, length, device id) + ``transfer``;
`Transfer.done` is one ``check_xfer_state``.
No Ray call happens per transfer, and the passive side runs no Python code at all.

Progress
--------
A passive peer's UCX worker must be progressed even though nothing calls its agent: it answers
connection set-up, and over tcp (and shared-memory transports without cma) UCX emulates RMA with
active messages that the target handles (measured: with no progress at all on the passive side
the first READ/WRITE never completes). The agent's UCX progress thread does it event-driven: it
sleeps in ``poll()`` on its worker's event fd and wakes when UCX has work, or after
PROGRESS_FALLBACK_US at the latest. nixl's Python API hard-codes that delay to 0, i.e. a busy
spin (a whole core per process), so `new_nixl_agent` sets it while the agent is created. Measured
with nixl 1.5.1 between two processes whose passive side only sleeps: idle 0.00 CPU-s per 5 s and
~1 wake-up per second per process (the old 1 ms Python thread: 0.13 CPU-s and ~900 wake-ups per
second; delay 0: 4.6-5.0 CPU-s); READ/WRITE latency unchanged over cma (1 MiB ~0.09 ms, 64 KiB
~0.015 ms) and lower over tcp (1 MiB READ 0.5 ms vs 1.6 ms: the passive side now answers at once
instead of at its next 1 ms tick); the first transfer (connection set-up) 1-40 ms. Initiators
also progress their worker whenever they poll a transfer (``check_xfer_state``).

Facts about nixl 1.5.1 this relies on (checked on this CPU-only machine, UCX over cma/tcp):
* agent calls raise typed exceptions rather than returning "ERR": a remote range outside the
  peer's registrations fails ``initialize_xfer`` with NIXL_ERR_NOT_FOUND (a second bounds check
  behind ours); posting to a dead peer fails at once with NIXL_ERR_REMOTE_DISCONNECT;
* ``add_remote_agent`` takes ~30 ms, creating an agent ~0.5 s: both happen once, not per move;
* over cma (two processes of one host) UCX copies inside ``transfer()``: `read`/`write` return an
  already finished Transfer after the copy (30-40 ms for 128 MiB here), with the GIL released
  (another Python thread kept 97% of its rate). With an RDMA NIC the post returns at once and
  the NIC moves the bytes, so callers must not rely on either: poll or wait the Transfer;
* releasing an unfinished transfer handle cancels it; if cancelling fails nixl keeps the handle
  in its leak list (released when the agent is destroyed) and the bytes may still land. Not
  exercised here: over cma nothing is ever unfinished after the post.
The agent is shared by engine worker threads and Ray's transport-group threads; every agent call
runs under one lock (the agent's own sync mode is NONE without a listener thread). The UCX
progress thread needs no such lock: UCX runs its worker in multi-thread mode when NIXL starts
the thread (checked: six threads posting and polling 1200 transfers against it, no error).

RDMA hardware mapping
---------------------
* UCX selects IB or RoCE verbs (``rc``/``dc``, GPUDirect RDMA for CUDA memory) when an RDMA NIC
  is present and falls back to TCP, shared memory and cma otherwise (as on the CPU-only CI
  machines). ``UCX_TLS`` restricts the transports (``rc,cuda_copy`` on IB, ``tcp`` to force
  sockets); ``UCX_NET_DEVICES`` picks the NIC port (``mlx5_0:1``): bind each engine to the
  compute NIC next to its GPU.
* Traffic isolation (paper section 5) keeps KV traffic from slowing model collectives:
  ``UCX_IB_SL`` sets the InfiniBand service level (0-15, mapped to a virtual lane by the subnet
  manager's SL2VL table); ``UCX_IB_TRAFFIC_CLASS`` sets the GRH traffic class (0-255) that RoCE
  switches read as DSCP (upper 6 bits) for PFC/ETS priority queues. Put KV on an SL/TC different
  from NCCL's (``NCCL_IB_SL`` / ``NCCL_IB_TC``). `make_transport(service_level=...,
  traffic_class=..., ucx_tls=..., ucx_net_devices=...)` sets these for the whole process before
  the agent exists (UCX reads them when the agent's UCX context is created). They are not
  testable without RDMA hardware; gloo (TCP) ignores them.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from dualpath_ray.runtime.transport.base import Transport
from dualpath_ray.runtime.transport.moves import Move, Transfer, TransportError

_UCX_SERVICE_LEVELS = range(16)
_UCX_TRAFFIC_CLASSES = range(256)
_NIXL_OPS = {"read": "READ", "write": "WRITE"}
_MISSING = "runtime.transport: nixl is not installed; pip install '.[nixl]' or use gloo"


def ucx_environment(
    *,
    service_level: int | None = None,
    traffic_class: int | None = None,
    tls: str | None = None,
    net_devices: str | None = None,
) -> dict[str, str]:
    """The UCX variables that place KV traffic on its own IB service level / RoCE class."""
    env: dict[str, str] = {}
    if service_level is not None:
        if service_level not in _UCX_SERVICE_LEVELS:
            raise TransportError(f"service_level must be an IB SL in 0..15 (got {service_level})")
        env["UCX_IB_SL"] = str(service_level)
    if traffic_class is not None:
        if traffic_class not in _UCX_TRAFFIC_CLASSES:
            raise TransportError(f"traffic_class must be in 0..255 (DSCP << 2 on RoCE; got {traffic_class})")
        env["UCX_IB_TRAFFIC_CLASS"] = str(traffic_class)
    if tls is not None:
        if not tls.strip():
            raise TransportError("ucx_tls must name transports, e.g. 'rc,cuda_copy' or 'tcp'")
        env["UCX_TLS"] = tls
    if net_devices is not None:
        if not net_devices.strip():
            raise TransportError("ucx_net_devices must name devices, e.g. 'mlx5_0:1'")
        env["UCX_NET_DEVICES"] = net_devices
    return env


def apply_ucx_environment(env: dict[str, str]) -> None:
    """Set UCX variables for this process; refuses to silently override a different value."""
    for name, value in env.items():
        existing = os.environ.get(name)
        if existing is not None and existing != value:
            raise TransportError(
                f"{name} is already {existing!r} in this process; refusing to change it to "
                f"{value!r} (UCX reads it once, when the NIXL agent starts)"
            )
    os.environ.update(env)


# Longest sleep of the UCX backend's progress thread (microseconds; NIXL's ``pthrDelay``). The
# thread sleeps in poll() on its worker's event fd and UCX events wake it at once (a wire-up
# request, an active message of emulated RMA, a completion), so no transfer waits for this
# period. It only bounds (a) how long an event that poll() misses can wait: NIXL keeps the
# timeout as a workaround for a UCX bug where poll() does not wake on some fds (comment in
# nixlUcxSharedThread, ucx_backend.cpp; never seen here in 4000 transfers over tcp and cma), and
# (b) how often UCX timers such as keepalive run. 1 s: an idle process wakes once a second (no
# measurable CPU; nixl rounds the value up to whole ms, 0 spins a core), and a missed wake-up
# costs at most 1 s, well inside any transfer timeout.
PROGRESS_FALLBACK_US = 1_000_000


@dataclass(frozen=True)

class NixlPool:
    """Where one registered pool lives in its process, as NIXL descriptors address it."""

    name: str
    base: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM"


@dataclass(frozen=True)
class NixlEndpoint:
    """`EndpointInfo.backend` of a NIXL endpoint."""

    agent_name: str
    metadata: bytes
    pools: tuple[NixlPool, ...]


def nixl_pool(name: str, pool: torch.Tensor) -> NixlPool:
    if pool.device.type == "cpu":
        return NixlPool(name, pool.data_ptr(), 0, "DRAM")
    return NixlPool(name, pool.data_ptr(), pool.get_device(), "VRAM")


def descriptor_groups(
    moves: Sequence[Move], local: Mapping[str, NixlPool], remote: Mapping[str, NixlPool]
) -> dict[tuple[str, str], tuple[np.ndarray, np.ndarray]]:
    """Nx3 uint64 (address, length, device id) arrays per (local, remote) memory type pair.

    A NIXL descriptor list has one memory type, so moves mixing host and device pools become
    one posted transfer per pair of types."""
    rows: dict[tuple[str, str], tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]] = {}
    for here, there in moves:
        mine, theirs = local[here.pool], remote[there.pool]
        own, peer = rows.setdefault((mine.mem_type, theirs.mem_type), ([], []))
        own.append((mine.base + here.offset, here.nbytes, mine.device_id))
        peer.append((theirs.base + there.offset, there.nbytes, theirs.device_id))
    return {key: (np.array(a, dtype=np.uint64), np.array(b, dtype=np.uint64)) for key, (a, b) in rows.items()}


def _load_nixl() -> Any:
    """The ``nixl._api`` module (nixl_agent, nixl_agent_config and its ``nixlBind`` bindings)."""
    # nixl logs every agent's creation at INFO; Ray forwards actor output to the driver's
    # stdout, where it would break `--json` output. NIXL_LOG_LEVEL set by the user still wins.
    os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")
    try:
        import nixl._api as api
    except Exception as exc:  # a broken install counts as missing, whatever it raises
        raise TransportError(f"{_MISSING} ({type(exc).__name__}: {exc})") from exc
    return api


class _AgentFactory:
    """Creates nixl agents whose UCX progress thread sleeps up to a given delay (not 0)."""

    # nixl_agent.__init__ builds its nixlAgentConfig itself and hard-codes pthrDelay = 0, then
    # calls nixlBind.nixlAgent(name, config); wrapping that one call for the duration of the
    # constructor is the only way in that leaves the rest of nixl's set-up untouched. The wrap is
    # a process-wide attribute swap, so creations are serialised to restore it reliably.
    _creating = threading.Lock()

    @classmethod
    def create(cls, agent_name: str, progress_delay_us: int) -> Any:
        api = _load_nixl()
        bindings = api.nixlBind
        config = api.nixl_agent_config(enable_prog_thread=True, backends=["UCX"])
        with cls._creating:
            original = bindings.nixlAgent
            delays: list[int] = []  # what the wrapper set: proof nixl created the agent through it

            def with_delay(name: str, agent_config: Any) -> Any:
                agent_config.pthrDelay = progress_delay_us
                delays.append(agent_config.pthrDelay)
                return original(name, agent_config)

            bindings.nixlAgent = with_delay
            try:
                agent = api.nixl_agent(agent_name, config)
            finally:
                bindings.nixlAgent = original
        if delays != [progress_delay_us]:
            # nixl changed how it builds the agent: its progress thread may now spin a core.
            del agent
            raise TransportError(
                f"creating the NIXL agent {agent_name}: nixl {getattr(api, '__version__', '?')} no longer "
                "creates agents through nixlBind.nixlAgent, so the progress thread delay could not be set; "
                "update transport_nixl._AgentFactory"
            )
        return agent


def new_nixl_agent(agent_name: str, progress_delay_us: int = PROGRESS_FALLBACK_US) -> Any:
    """A nixl agent with the UCX backend and its event-driven progress thread (module docstring)."""
    if progress_delay_us < 1000:
        raise TransportError(f"progress_delay_us must be >= 1000 (nixl rounds it to ms; 0 spins): {progress_delay_us}")
    return _AgentFactory.create(agent_name, progress_delay_us)


class NixlTransfer(Transfer):
    """Posted NIXL handles (one per memory-type pair); done when every one reports DONE."""

    def __init__(
        self,
        op: str,
        peer: str,
        nbytes: int,
        deadline: float,
        on_done: Callable[[Transfer], None],
        transport: NixlTransport,
        handles: list[Any],
    ) -> None:
        super().__init__(op, peer, nbytes, deadline, on_done)
        self._transport = transport
        self._handles = handles

    def _poll(self) -> bool:
        pending = []
        for handle in self._handles:
            try:
                state = self._transport._agent_call(self._transport._agent.check_xfer_state, handle)
            except Exception as exc:  # noqa: BLE001 - nixl's error types share no base below Exception
                state = f"ERR ({type(exc).__name__}: {exc})"
            if state == "PROC":
                pending.append(handle)
            elif state == "DONE":
                self._transport._release([handle])
            else:
                self._transport._release(self._handles)
                self._handles = []
                raise self._transport._failure(self.peer, f"NIXL {self.op} with {self.peer} failed: {state}")
        self._handles = pending
        return not pending

    def _abort(self, reason: str) -> TransportError:
        cancelled = self._transport._release(self._handles)
        self._handles = []
        landing = "cancelled" if cancelled else "could not be cancelled: bytes may still land"
        return TransportError(f"NIXL {self.op} with {self.peer}: {reason}; the posted transfer was {landing}")


class NixlTransport(Transport):
    kind = "nixl"

    def __init__(self, endpoint_name: str, namespace: str, timeout_s: float) -> None:
        super().__init__(endpoint_name, namespace, timeout_s)
        self._agent_lock = threading.Lock()
        self.agent_name = f"{endpoint_name}#{self.incarnation}"
        try:
            # The agent's own progress thread serves this endpoint as a passive peer; it sleeps
            # until UCX has work (PROGRESS_FALLBACK_US at most), so an idle process costs no CPU.
            self._agent = new_nixl_agent(self.agent_name)
        except TransportError:
            raise
        except Exception as exc:
            raise TransportError(f"creating the NIXL agent {self.agent_name} failed: {exc}") from exc
        if "UCX" not in self._agent.backends:
            raise TransportError(f"NIXL has no UCX plugin here (plugins: {self._agent.get_plugin_list()})")
        self._registrations: dict[str, Any] = {}  # pool name -> its NIXL registration
        self._local: dict[str, NixlPool] = {}
        self._remote_agents: dict[str, Any] = {}  # peer agent name -> name add_remote_agent returned

    def _agent_call(self, method: Callable[..., Any], *args: Any) -> Any:
        with self._agent_lock:
            return method(*args)

    def _register_backend(self, name: str, pool: torch.Tensor) -> None:
        try:
            registration = self._agent_call(self._agent.register_memory, pool)
        except Exception as exc:
            raise TransportError(f"register {name!r}: NIXL register_memory failed: {exc}") from exc
        self._registrations[name] = registration
        self._local[name] = nixl_pool(name, pool)

    def _deregister_backend(self, name: str) -> None:
        registration = self._registrations.pop(name, None)
        if registration is not None:
            self._agent_call(self._agent.deregister_memory, registration)

    def _seal_backend(self) -> object:
        metadata = self._agent_call(self._agent.get_agent_metadata)
        return NixlEndpoint(self.agent_name, metadata, tuple(self._local.values()))

    def _remote_agent(self, backend: NixlEndpoint) -> Any:
        """Load the peer's agent metadata once per incarnation (the check-then-add is atomic)."""
        with self._agent_lock:
            loaded = self._remote_agents.get(backend.agent_name)
            if loaded is None:
                loaded = self._agent.add_remote_agent(backend.metadata)
                self._remote_agents[backend.agent_name] = loaded
        return loaded

    def _post(self, op: str, peer: str, moves: Sequence[Move]) -> Transfer:
        backend = self._peer_info(peer).backend
        if not isinstance(backend, NixlEndpoint):
            raise TransportError(f"{peer} published {type(backend).__name__}, not NIXL addressing")
        remote_pools = {p.name: p for p in backend.pools}
        handles: list[Any] = []
        try:
            remote_agent = self._remote_agent(backend)
            for (local_mem, remote_mem), (local, remote) in descriptor_groups(moves, self._local, remote_pools).items():
                handles.append(self._post_one(op, local_mem, local, remote_mem, remote, remote_agent))
        except Exception as exc:  # nixl raises its own types; classify every failure with a probe
            self._release(handles)
            raise self._failure(peer, f"posting NIXL {op} with {peer} failed: {type(exc).__name__}: {exc}") from exc
        return self._new_transfer(NixlTransfer, op, peer, moves, self, handles)

    def _post_one(
        self, op: str, local_mem: str, local: np.ndarray, remote_mem: str, remote: np.ndarray, remote_agent: Any
    ) -> Any:
        with self._agent_lock:
            local_descs = self._agent.get_xfer_descs(local, local_mem)
            remote_descs = self._agent.get_xfer_descs(remote, remote_mem)
            handle = self._agent.initialize_xfer(_NIXL_OPS[op], local_descs, remote_descs, remote_agent)
            try:
                state = self._agent.transfer(handle)
            except Exception:
                handle.release()
                raise
        if state == "ERR":
            self._release([handle])
            raise TransportError(f"NIXL refused to post the {op}")
        return handle

    def _release(self, handles: Sequence[Any]) -> bool:
        """Release (and so cancel, if still running) handles; False if one could not be."""
        released = True
        for handle in handles:
            try:
                self._agent_call(handle.release)
            except Exception:  # noqa: BLE001 - any failure means "not cancelled"; nixl keeps the handle
                released = False
        return released

    def _forget_backend_peer(self, info: Any) -> None:
        backend = info.backend
        if not isinstance(backend, NixlEndpoint):
            return
        with self._agent_lock:
            loaded = self._remote_agents.pop(backend.agent_name, None)
            if loaded is not None:
                try:
                    self._agent.remove_remote_agent(loaded)
                except Exception:  # noqa: BLE001, S110 - already disconnected: nothing left to drop
                    pass

    def _close_backend(self) -> None:
        # The agent (and its progress thread, idle at one wake-up per PROGRESS_FALLBACK_US) lives
        # until the process ends: a transfer polled by another thread may still use it.
        with self._agent_lock:
            registrations, self._registrations = self._registrations, {}
            for registration in registrations.values():
                try:
                    self._agent.deregister_memory(registration)
                except Exception:  # noqa: BLE001, S110 - closing anyway; the agent goes with the process
                    pass
            self._remote_agents = {}
