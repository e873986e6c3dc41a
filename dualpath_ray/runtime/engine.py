"""What prefill and decode engines share: identity, compute, NIC links, transport, the group
leader on g0, and the control methods the leader and the driver call."""

from __future__ import annotations

import threading
from dataclasses import dataclass, field
from typing import Any, Literal

import ray
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import open_store
from dualpath_ray.runtime.emulation import make_compute, make_link
from dualpath_ray.runtime.leader import ActorDirectory, GroupLeader, start_thread
from dualpath_ray.runtime.messages import NodeCounters
from dualpath_ray.runtime.transport import TransportEndpoint, make_transport
from dualpath_ray.scheduling import EngineLoad


@dataclass
class EngineIdentity:
    engine_id: str
    node_id: str
    gpu: int
    members: list[str] = field(default_factory=list)
    reader: str = ""


class EngineBase(TransportEndpoint):
    """Base of the engine actor classes; subclasses define `_load`, `_accept` and `_main_loop`."""

    role: Literal["prefill", "decode"]

    def __init__(self, cfg: DualPathConfig, identity: EngineIdentity, store_root: str | None) -> None:
        torch.set_num_threads(1)
        self.cfg = cfg
        self.id = identity
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.compute = make_compute(cfg, self.layout)
        self.cnic_in = make_link(cfg, f"cnic-in/{identity.engine_id}", cfg.cluster.cnic_gbps)
        self.cnic_out = make_link(cfg, f"cnic-out/{identity.engine_id}", cfg.cluster.cnic_gbps)
        self.counters = NodeCounters()
        self.transport = self.attach_transport(
            make_transport(cfg.runtime.transport, identity.engine_id, namespace=cfg.runtime.namespace)
        )
        self.directory = ActorDirectory(cfg.runtime.namespace)
        self.store = open_store(cfg.store, self.layout, root=store_root)
        self.lock = threading.Lock()
        self.stopped = threading.Event()
        self.error: BaseException | None = None
        self.leader: GroupLeader | None = None
        if identity.members and identity.members[0] == identity.engine_id:
            self.leader = GroupLeader(
                self.role, identity.node_id, identity.members, identity.reader, self.directory,
                identity.engine_id, self._load, self._accept, cfg.scheduler.fetch_interval_ms / 1000.0,
            )

    def start(self) -> bool:
        """Start the worker (and, on g0, the group's pull loop) once every actor exists."""
        start_thread(self._main_loop, f"{self.role}-{self.id.engine_id}")
        if self.leader is not None:
            start_thread(self.leader.run, f"leader-{self.id.engine_id}")
        return True

    @ray.method(concurrency_group="control")
    def stop(self) -> None:
        self.stopped.set()
        if self.leader is not None:
            self.leader.stopped.set()

    @ray.method(concurrency_group="control")
    def load(self) -> EngineLoad:
        return self._load()

    @ray.method(concurrency_group="control")
    def accept(self, items: list[Any]) -> None:
        self._accept(items)

    @ray.method(concurrency_group="control")
    def health(self) -> str | None:
        errors = [e for e in (self.error, self.leader.error if self.leader else None) if e]
        return repr(errors[0]) if errors else None

    @ray.method(concurrency_group="control")
    def stats(self) -> NodeCounters:
        return self.counters

    @ray.method(concurrency_group="control")
    def node_labels(self) -> dict[str, str]:
        return dict(ray.get_runtime_context().get_node_labels())

    def _load(self) -> EngineLoad:
        raise NotImplementedError

    def _accept(self, items: list[Any]) -> None:
        raise NotImplementedError

    def _main_loop(self) -> None:
        raise NotImplementedError
