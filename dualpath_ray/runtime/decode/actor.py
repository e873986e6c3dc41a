"""DecodeEngine (`decode/<node>/<gpu>`): the actor shell around DecodeCore.

It owns the paged KV pool ("HBM", registered with the transport as "hbm" so the node's reader can
pull filled pages to persist them), the worker thread that runs the core, and the Ray ports. A
compute that keeps the KV itself (runtime/compute/held_kv.py: vLLM's pages) leaves the pool its
books only: the compute's KV memory is registered instead, as "compute_kv": the prompts land in
it and the reader pulls filled blocks straight from it (runtime/decode/filled_blocks.py).
"""

from __future__ import annotations

import ray

from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.engine.faulty_ports import with_faults
from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.runtime.decode.core import DecodeCore
from dualpath_ray.runtime.decode.filled_blocks import FilledBlocks, HeldPulls, PagePulls
from dualpath_ray.runtime.decode.job import DecodePorts, DecodeSettings
from dualpath_ray.runtime.engine.base import EngineBase
from dualpath_ray.protocol.messages import DecodeHandoff
from dualpath_ray.runtime.engine.ray_ports import RayReaders, SystemClock
from dualpath_ray.runtime.transport.endpoint import endpoint_actor_options
from dualpath_ray.protocol.types import Role


@ray.remote(**endpoint_actor_options(extra_concurrency_groups={"control": 4, "io": 4}))
class DecodeEngine(EngineBase):
    role = Role.DECODE

    def _build_core(self) -> DecodeCore:
        cfg = self.cfg
        n_pages = cfg.cluster.hbm_tokens_per_engine // self.layout.block_size
        held = self.compute.held_kv
        pages = PagedKVPool(max(1, n_pages), self.layout, self.device, storage=held is None)
        filled: FilledBlocks
        if held is None:
            self.hbm.register(Pool.HBM, pages.tensor)
            filled = PagePulls(pages)
        else:
            # The KV lives in the compute's pages (vLLM's): prompts land there, and the reader
            # pulls filled blocks from there.
            self.hbm.register(Pool.COMPUTE_KV, held.kv_buffer, owned=False)
            held.bind(self.hbm.transport_port(), Pool.COMPUTE_KV)
            filled = HeldPulls(held, Pool.COMPUTE_KV)
        self.filled = filled
        settings = DecodeSettings(
            self.id.engine_id, self.id.node_id, cfg.model.max_context, cfg.runtime.max_persists_in_flight,
            cfg.runtime.transfer_timeout_s, cfg.runtime.verify_kv, cfg.runtime.kv_digests,
            cfg.runtime.request_timeout_s,
        )
        readers = RayReaders(self.directory, self.id.engine_id, self.wake, self.sent)
        ports = DecodePorts(
            self.hbm.readers_port(readers, self.layout.full_block_bytes, Pool.HBM), self.hbm.transport_port(),
            self.scheduler_port, SystemClock(), self.weights,
        )
        if self.faults.active:
            ports = with_faults(ports, self.faults, self.hbm.view)
        return DecodeCore(settings, self.layout, self.compute, pages, ports, self.store, self.links, filled)

    @ray.method(concurrency_group="io")
    def handoff(self, handoffs: list[DecodeHandoff]) -> None:
        """Prefill engines' handoffs (one call per prefill batch): their pages are reserved when
        the worker takes them."""
        self.core.hand_off(handoffs)
        self.wake.set()

    @ray.method(concurrency_group="control")
    def kv_memory(self) -> dict[str, int]:
        """Bytes of KV memory this engine allocated, by what holds it: its own pages (none when
        the compute keeps the KV), the compute's pages, and the pools it registered with the
        transport, which every KV move into or out of the engine goes through (`pool:<name>`,
        as the transport counts them: a vLLM engine's is its compute's pages alone)."""
        held = self.compute.held_kv
        registered = {f"pool:{pool.name}": pool.nbytes for pool in self.transport.info().pools}
        return {
            "pages": self.core.pages.tensor.numel(),
            "compute_pages": held.kv_buffer.numel() if held is not None else 0,
            **registered,
        }

    @ray.method(concurrency_group="control")
    def page_integrity(self) -> tuple[int, int, int, int]:
        counts = self.core.pages.check_integrity()
        return (counts.free, counts.allocated, counts.reserved, counts.capacity)
