"""What prefill and decode engine actors share: identity, device, compute, NIC links, transport,
the worker thread that runs the core, and the control methods.

An engine actor is a shell: its core (runtime/prefill/core.py, runtime/decode/core.py) makes
every decision; the actor owns the threads, the Ray calls (runtime/engine/ray_ports.py) and the
transport, and answers the scheduler (`holds`, `accept`, `cancel`, `abort`) on its control
group while the worker computes. The worker sleeps while there is nothing to do: whatever gives
it work (a task, a handoff, a reply to one of its calls) wakes it, and it polls only while a
transfer that signals nothing is in flight (`core.polling()`).
"""

from __future__ import annotations

import logging
import os
import threading
from collections import Counter
from dataclasses import dataclass
from typing import Any

import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.faults.injector import FaultCount, FaultInjector
from dualpath_ray.faults.plan import FaultSite
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.runtime.telemetry.actor_metrics import EngineMetrics
from dualpath_ray.runtime.telemetry.engine_stats import EngineStats, HbmMoveCounts
from dualpath_ray.runtime.emulation import make_link
from dualpath_ray.runtime.engine.compute_choice import make_compute
from dualpath_ray.runtime.engine.directory import ActorDirectory
from dualpath_ray.protocol.messages import EngineHoldings
from dualpath_ray.model.weights import read_checkpoint, weights_fingerprint
from dualpath_ray.protocol.weights import TensorSpec, WeightsId
from dualpath_ray.runtime.placement.topology import plan_nodes
from dualpath_ray.runtime.weights.ledger import WeightLedger, check_version_reuse
from dualpath_ray.runtime.engine.held_weights import HeldWeights
from dualpath_ray.runtime.engine.weights_catch_up import CatchUpPorts, WeightsCatchUp, peers_of
from dualpath_ray.runtime.engine.hbm_moves import HbmMoves
from dualpath_ray.runtime.placement.qos import kv_transport_knobs
from dualpath_ray.runtime.engine.ray_ports import RayScheduler
from dualpath_ray.runtime.restarts.incarnations import TransportKeeper, was_restarted
from dualpath_ray.runtime.transport.endpoint import TransportEndpoint
from dualpath_ray.runtime.transport.factory import make_transport
from dualpath_ray.runtime.weights.sync import WeightGroup
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.protocol.types import Role

LOG = logging.getLogger("dualpath_ray.engine")
# While a transfer that signals nothing is in flight (a decode engine's prompt load), the worker
# looks again this often; NIXL moves of a few MiB land within it.
POLL_S = 0.002
# With nothing in flight the worker sleeps until woken; it also looks once a second, so that a
# wake-up lost to a bug costs a second, never a hang.
IDLE_S = 1.0
# Between rollouts, how long sleep and a weight update wait for the replies to this engine's last
# handoffs and reports (the receivers have them; only the acknowledgement may be on the wire).
DRAIN_S = 2.0


@dataclass
class EngineIdentity:
    engine_id: str
    node_id: str
    gpu: int
    reader: str = ""  # its node's storage reader


def engine_device(cfg: DualPathConfig) -> torch.device:
    """The GPU Ray gave this actor (CUDA_VISIBLE_DEVICES holds only it: cuda:0), else the CPU."""
    choice = cfg.runtime.device
    has_gpu = torch.cuda.is_available() and bool(ray.get_gpu_ids())
    if choice == "cuda" and not has_gpu:
        raise RuntimeError(
            "runtime.device is cuda but this engine has no CUDA device (is torch a CUDA build, and "
            "does the node offer GPUs to Ray?); use runtime.device: auto or cpu"
        )
    return torch.device("cuda:0") if choice != "cpu" and has_gpu else torch.device("cpu")


class EngineBase(TransportEndpoint):
    """Base of the engine actor classes; subclasses build `self.core` in `_build_core`."""

    role: Role

    def __init__(self, cfg: DualPathConfig, identity: EngineIdentity, store_root: str | None) -> None:
        torch.set_num_threads(cfg.runtime.compute_threads)
        self.cfg = cfg
        self.id = identity
        self.device = engine_device(cfg)
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.compute = make_compute(cfg, self.layout, self.device, self.role)
        self.links = (
            make_link(cfg, f"cnic-in/{identity.engine_id}", cfg.cluster.cnic_gbps),
            make_link(cfg, f"cnic-out/{identity.engine_id}", cfg.cluster.cnic_gbps),
        )
        self.transport = self.attach_transport(
            make_transport(
                cfg.runtime.transport, identity.engine_id, namespace=cfg.runtime.namespace,
                timeout_s=cfg.runtime.transfer_timeout_s, verbs_settings=cfg.verbs,
                verbs_device=cfg.verbs.device_for(identity.gpu), **kv_transport_knobs(cfg.qos),
            )
        )
        self.incarnation = self.transport.incarnation
        self.restarted = was_restarted()
        self.directory = ActorDirectory(cfg.runtime.namespace)
        self.faults = FaultInjector(cfg.faults, identity.engine_id, self.restarted)
        self.store = open_store(cfg.store, self.layout, root=store_root)
        # The config's weights; a restarted engine is not ready until it holds the published ones.
        self.weights = HeldWeights.of_config(cfg)
        self.ledger = WeightLedger(cfg.runtime.namespace)
        published = self.ledger.current() if self.restarted else None
        if published is not None and not self.weights.is_current(published.weights):
            self.weights.awaiting()
        self.wake = threading.Event()
        self.hbm = HbmMoves(cfg.runtime.hbm_moves, self.transport)
        self.sent: Counter[str] = Counter()  # actor calls this engine made, by method (its ports count them)
        self.scheduler_port = RayScheduler(
            self.directory, identity.engine_id, lambda: self.incarnation, self.sent, ready=self.weights.ready
        )
        self.core = self._build_core()
        self.transport.seal()
        self.metrics = EngineMetrics.start(cfg, identity.engine_id, identity.node_id, self.role, self.core)
        self.compute_lock = threading.Lock()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.loops = 0  # the worker's wake-ups (an idle engine's grow by one a second at most)
        self.started = False
        self.asleep = False
        self.weight_group: WeightGroup | None = None
        self.keeper = TransportKeeper(self.transport, cfg.runtime.namespace, cfg.runtime.request_timeout_s)
        self.catch_up: WeightsCatchUp | None = None
        if not self.weights.ready():
            self._start_catch_up()
        if self.restarted:
            # Tell the scheduler this incarnation now, not only once the rejoin below is done (a
            # new gloo world can take long): what the dead process held is reclaimed at once.
            self.scheduler_port.report({}, (), ())
            # No driver calls start() on a restarted incarnation: it rejoins the transport and
            # starts itself once this __init__ has returned (the rejoin needs this actor to serve).
            self.keeper.heal(then=self.start)

    def _start_catch_up(self) -> None:
        """Load the published weights on a thread of its own (runtime/engine/weights_catch_up.py);
        until then every request is refused and the scheduler routes around this engine."""
        by_node = {spec.node_id: spec.engine_names() for spec in plan_nodes(self.cfg)}
        ports = CatchUpPorts(self.ledger.current, self._peer_weights, self._load_caught_up)
        self.catch_up = WeightsCatchUp(
            self.id.engine_id, peers_of(self.id.engine_id, self.id.node_id, by_node), self.weights, ports, self.stopped,
        )
        threading.Thread(target=self.catch_up.run, name=f"weights-{self.id.engine_id}", daemon=True).start()

    def _peer_weights(self, peer: str, weights: WeightsId) -> dict[str, torch.Tensor] | None:
        state: dict[str, torch.Tensor] | None = ray.get(
            self.directory.get(peer).export_weights.remote(weights), timeout=self.cfg.runtime.request_timeout_s
        )
        return state

    def _load_caught_up(self, weights: WeightsId, state: dict[str, torch.Tensor]) -> None:
        with self.compute_lock:
            if self.weights.is_current(weights) and self.weights.ready():
                return  # an update loaded them meanwhile
            self.compute.load_weights(state)
            self.weights.now_holds(weights)
        self.scheduler_port.report({}, (), ())  # ready: the scheduler places work here again
        self.wake.set()

    def _addressed(self, engine: str) -> None:
        if engine != self.id.engine_id:
            raise ValueError(f"{self.id.engine_id}: a message for {engine} was routed here")

    def __repr__(self) -> str:
        # Ray prefixes this actor's log lines with it and shows it as the dashboard's repr name.
        return getattr(getattr(self, "id", None), "engine_id", type(self).__name__)

    def _build_core(self) -> Any:
        raise NotImplementedError

    def start(self) -> bool:
        """Start the worker once every actor exists (once)."""
        with self.compute_lock:
            if self.started:
                return True
            self.started = True
        threading.Thread(target=self._work, name=f"{self.role}-{self.id.engine_id}", daemon=True).start()
        # An empty report tells the scheduler this incarnation at once: a restarted engine's new
        # process may have nothing else to say for a long time (a decode engine is never called
        # by the scheduler, and heartbeats run only while turns are in flight).
        self.scheduler_port.report({}, (), ())
        return True

    def _work(self) -> None:
        try:
            while not self.stopped.is_set():
                self.loops += 1
                # Cleared before the step, so a wake-up that comes during it is not lost.
                self.wake.clear()
                with self.compute_lock:
                    busy = self.core.step()
                if not busy:
                    self.wake.wait(POLL_S if self.core.polling() else IDLE_S)
        except BaseException as exc:  # noqa: BLE001 - reported by health(), its requests failed
            LOG.exception("%s: worker loop died", self.id.engine_id)
            self.error = exc  # from now on load() and holds() fail: the heartbeat drops this engine
            try:
                self.core.fail_all(exc)
            except Exception:  # noqa: BLE001 - what could not be failed here, the heartbeat fails
                LOG.exception("%s: failing the requests of a dead worker loop failed", self.id.engine_id)

    # --- control ------------------------------------------------------------------------

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        self.stopped.set()
        self.wake.set()
        self.metrics.close()  # export what was counted up to now

    @ray.method(concurrency_group="control")
    def load(self) -> EngineLoad:
        if self.error is not None:
            # A dead worker loop must not look like an idle engine, or it would be given work
            # it never runs; failing here makes the scheduler's heartbeat drop it.
            raise RuntimeError(f"{self.id.engine_id}: worker loop died: {self.error!r}")
        return self.core.load()

    @ray.method(concurrency_group="control")
    def holds(self, engine: str) -> EngineHoldings:
        """The scheduler's heartbeat: the attempts this engine holds (see the cores' holds) and
        which incarnation holds them; fails like `load` once the worker loop died. `engine` is
        the addressee (a heartbeat routed to the wrong engine is a bug, not an answer)."""
        self._addressed(engine)
        self.load()
        if self.faults.active and self.faults.decide(FaultSite.HEARTBEAT) is not None:
            raise TimeoutError(f"{self.id.engine_id}: heartbeat dropped by the fault plan")
        return EngineHoldings(self.incarnation, self.core.holds(), self.weights.ready())

    @ray.method(concurrency_group="control")
    def fault_counts(self) -> dict[str, FaultCount]:
        return self.faults.counts()

    @ray.method(concurrency_group="control")
    def cancel(self, owner: str) -> None:
        """The scheduler gave up on an attempt ("request#attempt"): drop what it holds here
        that has not started (see the cores' cancel)."""
        self.core.cancel(owner)

    @ray.method(concurrency_group="control")
    def abort(self, owner: str) -> None:
        """The caller aborted this attempt: drop it here even if it started (see the cores' abort)."""
        self.core.abort(owner)
        self.wake.set()

    @ray.method(concurrency_group="control")
    def health(self) -> str | None:
        return repr(self.error) if self.error is not None else None

    @ray.method(concurrency_group="control")
    def stats(self) -> NodeCounters:
        return self.core.counters

    @ray.method(concurrency_group="control")
    def engine_stats(self) -> EngineStats[Any]:
        """The core's figures and the transport's, for benchmarks and `dualpath status`."""
        copies = self.hbm.stats
        return EngineStats(
            self.core.stats, self.transport.stats(), str(self.device),
            HbmMoveCounts(self.hbm.mode, copies.h2d_bytes, copies.d2h_bytes, copies.copies, self.hbm.mirrors_pinned()),
            self.incarnation, dict(self.sent), self.loops, self.compute.stats(),
        )

    @ray.method(concurrency_group="control")
    def node_labels(self) -> dict[str, str]:
        return dict(ray.get_runtime_context().get_node_labels())

    @ray.method(concurrency_group="control")
    def env(self, keys: list[str]) -> dict[str, str | None]:
        """These variables of this process's environment (None: unset), e.g. to check the
        traffic classes its runtime_env gave it."""
        return {key: os.environ.get(key) for key in keys}

    @ray.method(concurrency_group="control")
    def sleep(self) -> int:
        """Release this engine's memory between rollouts: its KV memory (decode pages, the
        prefill layer window) is freed and the weights leave the accelerator. Refused while it
        holds a request. Returns the bytes freed."""
        with self.compute_lock:  # the worker steps under it: no step is half-way
            if self.asleep:
                return 0
            self.core.outbox.drain(DRAIN_S)
            if self.core.busy():
                raise RuntimeError(f"{self.id.engine_id}: sleep while requests are in flight; abort them or wait")
            freed = self.hbm.release_memory() + self.compute.offload()
            self.asleep = True
        return freed

    @ray.method(concurrency_group="control")
    def wake_up(self) -> str:
        """Allocate the KV memory again and bring the weights back; returns the incarnation
        under which its memory is now addressed (peers fetch it again)."""
        with self.compute_lock:
            if self.asleep:
                self.compute.restore()
                self.hbm.restore_memory()
                self.incarnation = self.transport.incarnation
                self.asleep = False
        return self.incarnation

    @ray.method(concurrency_group="control")
    def forget_peers(self) -> None:
        """A peer woke with new memory addresses: fetch every peer's addressing again."""
        self.transport.forget_peers()

    @ray.method(concurrency_group="control")
    def join_weight_group(self, host: str, port: int, world_size: int, rank: int, group_name: str, timeout_s: float) -> int:
        """Join a trainer's weight broadcast group (rank 0 is the trainer); blocks until every
        member joined. Returns this engine's rank."""
        self.weight_group = WeightGroup.join(
            host, port, world_size, rank, group_name, timeout_s, self.device, ray.util.get_node_ip_address()
        )
        return rank

    @ray.method(concurrency_group="control")
    def receive_weights(self, version: int, manifest: list[TensorSpec], expected: str | None = None) -> str:
        """Receive the trainer's broadcast of `manifest` (in order) through the joined group and
        load it as weight version `version` (see update_weights); returns its fingerprint."""
        if self.weight_group is None:
            raise RuntimeError(f"{self.id.engine_id}: receive_weights before join_weight_group")
        state = self.weight_group.receive(manifest)
        return self._load_weights(version, dict(state), expected)

    @ray.method(concurrency_group="control")
    def update_weights(self, version: int, source: Any, expected: str | None = None) -> str:
        """Swap the model's weights between rollouts (source: a safetensors directory, or a state
        dict passed through the object store) and serve them as weight version `version`: later
        requests must name that version's key namespace. `expected`: the fingerprint the
        version was published with before (runtime/weights/ledger.py), if it was; other
        weights under it are refused before anything is loaded. Returns their fingerprint."""
        state = read_checkpoint(os.fspath(source)) if isinstance(source, (str, os.PathLike)) else dict(source)
        return self._load_weights(version, state, expected)

    def _load_weights(self, version: int, state: dict[str, torch.Tensor], expected: str | None) -> str:
        fingerprint = weights_fingerprint(state)
        weights = WeightsId(version, fingerprint)
        if expected is not None:
            check_version_reuse({version: expected}, weights)
        with self.compute_lock:
            self.core.outbox.drain(DRAIN_S)
            if self.core.busy():
                raise RuntimeError(
                    f"{self.id.engine_id}: update_weights while requests are in flight; call it between rollouts"
                )
            was_ready = self.weights.ready()
            self.compute.load_weights(state)
            self.weights.now_holds(weights)
        if not was_ready:
            self.scheduler_port.report({}, (), ())  # a restarted engine the update caught up: ready
        return fingerprint

    @ray.method(concurrency_group="control")
    def export_weights(self, weights: WeightsId) -> dict[str, torch.Tensor] | None:
        """These weights as a host state dict, for a restarted peer catching up
        (runtime/engine/weights_catch_up.py); None unless this engine is ready and holds them."""
        with self.compute_lock:
            if not (self.weights.ready() and self.weights.is_current(weights)):
                return None
            return self.compute.export_weights()

    @ray.method(concurrency_group="control")
    def held_weights(self) -> tuple[WeightsId, bool]:
        """The weights this engine holds and whether it is ready (for `status` and tests)."""
        return self.weights.held, self.weights.ready()
