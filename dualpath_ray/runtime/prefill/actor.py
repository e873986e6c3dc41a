"""PrefillEngine (`prefill/<node>/<gpu>`): the actor shell around PrefillCore.

It owns the layer window (registered with the transport as "window", on the engine's device),
the worker thread that runs the core, and the Ray ports; everything else is in runtime/prefill/core.py.
A compute that keeps the batches' KV itself (runtime/compute/prefill_kv.py: vLLM's pages) leaves
the window its capacity only: the compute's KV memory is registered instead ("compute_kv").
"""

from __future__ import annotations

import ray

from dualpath_ray.kv.window import LayerWindow
from dualpath_ray.model.profile import attention_predictor
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.engine.base import EngineBase
from dualpath_ray.runtime.engine.faulty_ports import with_faults
from dualpath_ray.protocol.messages import PrefillTask
from dualpath_ray.runtime.prefill.core import PrefillCore
from dualpath_ray.runtime.prefill.job import PrefillPorts, PrefillSettings
from dualpath_ray.runtime.engine.ray_ports import RayDecodeTargets, RayReaders, SystemClock
from dualpath_ray.runtime.transport.endpoint import endpoint_actor_options
from dualpath_ray.protocol.types import Role


@ray.remote(**endpoint_actor_options(extra_concurrency_groups={"control": 4}))
class PrefillEngine(EngineBase):
    role = Role.PREFILL

    def _build_core(self) -> PrefillCore:
        cfg = self.cfg
        held = self.compute.prefill_kv
        window = LayerWindow(cfg.cluster.prefill_hbm_tokens, self.layout, self.device, storage=held is None)
        if held is None:
            self.hbm.register(Pool.WINDOW, window.tensor)
        else:
            # The batches' KV lives in the compute's pages (vLLM's): it moves between the
            # readers' extents and them through the transport, paced by this engine's CNIC.
            self.hbm.register(Pool.COMPUTE_KV, held.kv_buffer, owned=False)
            held.bind_links(self.links[0].take, self.links[1].take)
        settings = PrefillSettings(
            self.id.engine_id, self.id.node_id, self.id.reader, cfg.scheduler.compute_quota_ms,
            cfg.runtime.transfer_timeout_s, cfg.runtime.kv_digests, cfg.runtime.request_timeout_s,
        )
        ports = PrefillPorts(
            RayReaders(self.directory, self.id.engine_id, self.wake, self.sent), self.hbm.transport_port(),
            self.scheduler_port,
            RayDecodeTargets(self.directory, self.sent), SystemClock(), self.weights,
        )
        if self.faults.active:
            ports = with_faults(ports, self.faults, self.hbm.view)
        if held is not None:
            # The core's transport port, faults and all: the plan's transfer faults hit the
            # compute's moves as they hit the layer pipeline's.
            held.bind(ports.transport, Pool.COMPUTE_KV)
        if self.compute.continuous_prefill is not None:
            # The compute's own loop wakes the worker when a chunk can be collected.
            self.compute.continuous_prefill.bind_wake(self.wake.set)
        return PrefillCore(
            settings, self.layout, self.compute, window, attention_predictor(cfg), ports, self.store, self.links
        )

    @ray.method(concurrency_group="control")
    def kv_memory(self) -> dict[str, int]:
        """Bytes of KV memory this engine allocated, by what holds it: its layer window (none
        when the compute keeps the batches' KV), the compute's pages, and the pools it registered
        with the transport (`pool:<name>`, as the decode actor's kv_memory counts them)."""
        held = self.compute.prefill_kv
        registered = {f"pool:{pool.name}": pool.nbytes for pool in self.transport.info().pools}
        return {
            "window": self.core.window.tensor.numel(),
            "compute_pages": held.kv_buffer.numel() if held is not None else 0,
            **registered,
        }

    @ray.method(concurrency_group="control")
    def accept(self, tasks: list[PrefillTask]) -> str:
        """The scheduler's push of this engine's tasks (decided in one of its rounds); returns
        the incarnation that took them (a new one proves the engine restarted)."""
        for task in tasks:
            self._addressed(task.prefill_engine)
        self.core.accept(tasks)
        self.wake.set()
        return self.incarnation
