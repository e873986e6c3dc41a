"""A 1P1D engine pair in one process: real cores, readers, store, pools and compute; fake ports.

`EngineHarness` builds one prefill core on node p0 and one decode core on node d0 (one engine
each), both nodes' ReaderCores over one local-directory store, and a FakeTransport per engine
over a shared Fabric. `serve` schedules requests the way the scheduler would (hit lookup in a
prefix index that leaves one token to compute, the task; the decode core reserves its pages when
the handoff arrives; partial-block hits as the config resolves them) and steps both cores until every result is in; persisted blocks enter the
index when a result arrives, as in the Scheduler actor.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import numpy as np
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import PrefixIndex
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.paged import PagedKVPool
from dualpath_ray.kv.store import open_store
from dualpath_ray.kv.window import LayerWindow
from dualpath_ray.model.profile import attention_predictor
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.compute.engine_compute import EngineCompute
from dualpath_ray.runtime.engine.held_weights import HeldWeights
from dualpath_ray.runtime.decode.core import DecodeCore
from dualpath_ray.runtime.decode.filled_blocks import FilledBlocks, HeldPulls, PagePulls
from dualpath_ray.runtime.decode.job import DecodePorts, DecodeSettings
from dualpath_ray.runtime.emulation import make_link
from dualpath_ray.runtime.engine.compute_choice import make_compute
from dualpath_ray.protocol.messages import PrefillTask, RequestSpec, SamplingParams, TurnResult, attempt_owner
from dualpath_ray.runtime.prefill.core import PrefillCore
from dualpath_ray.runtime.prefill.job import PrefillPorts, PrefillSettings
from dualpath_ray.runtime.reader.actor import build_core as build_reader_core
from dualpath_ray.scheduling.binding import HitBinder
from tests.fakes import Collector, DirectHandoff, Fabric, FakeClock, FakeReaders, FakeTransport

PE, DE = "prefill/p0/g0", "decode/d0/g0"


@dataclass
class Request:
    request_id: str
    prompt: Sequence[int]
    path: str = "pe"
    max_new_tokens: int = 4
    pe_hit_blocks: int | None = None  # split path: hit blocks the prefill side reads (default: half)
    stop_token_ids: tuple[int, ...] = ()


class EngineHarness:
    def __init__(
        self, cfg: DualPathConfig, root: Path, *, lazy: bool = False, slow_writes_s: float = 0.0,
        compute: EngineCompute | None = None, device: str = "cpu", decode_compute: EngineCompute | None = None,
    ) -> None:
        """`compute`: the prefill engine's (and the decode engine's, unless `decode_compute` gives
        that engine one of its own: two engines, as a deployment has them)."""
        self.cfg = cfg
        self.layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
        self.store = open_store(cfg.store, self.layout, root=root)
        self.namespace = cfg.kv_namespace()  # the engine backend marks it (HeldWeights.of_config holds the same)
        self.index = PrefixIndex(cfg.store.block_size)
        self.binder = HitBinder(self.index, cfg.store.block_size, partial=cfg.partial_block_hits)
        self.fabric = Fabric()
        cores = {node: build_reader_core(cfg, node, str(root)) for node in ("p0", "d0")}
        self.readers = FakeReaders(cores, self.fabric, slow_writes_s)
        self.collector = Collector(on_result=self._index_blocks)
        self.handoff = DirectHandoff(readers=self.readers)
        self.clock = FakeClock()
        self.weights = HeldWeights.of_config(cfg)  # both engines hold the config's weights
        self.device = torch.device(device)
        self.compute = compute or make_compute(cfg, self.layout, self.device)
        self.decode_compute = decode_compute or self.compute
        self.pe_transport = FakeTransport(self.fabric, PE, lazy=lazy)
        self.de_transport = FakeTransport(self.fabric, DE)
        self.window = LayerWindow(cfg.cluster.prefill_hbm_tokens, self.layout, self.device)
        self.fabric.register(PE, Pool.WINDOW, self.window.tensor)
        prefill_held = self.compute.prefill_kv
        if prefill_held is not None and self.decode_compute is not self.compute:
            # A prefill engine of its own keeps its batches' KV in its compute's pages (vLLM's),
            # wired as the prefill actor wires it.
            self.fabric.register(PE, Pool.COMPUTE_KV, prefill_held.kv_buffer)
            prefill_held.bind(self.pe_transport, Pool.COMPUTE_KV)
        self.prefill = PrefillCore(
            PrefillSettings(PE, "p0", "reader/p0", cfg.scheduler.compute_quota_ms, cfg.runtime.transfer_timeout_s,
                            cfg.runtime.kv_digests),
            self.layout, self.compute, self.window, attention_predictor(cfg),
            PrefillPorts(self.readers, self.pe_transport, self.collector, self.handoff, self.clock, self.weights),
            self.store, self._links("pe"),
        )
        held = self.decode_compute.held_kv
        n_pages = cfg.cluster.hbm_tokens_per_engine // self.layout.block_size
        self.pages = PagedKVPool(n_pages, self.layout, self.device, storage=held is None)
        filled: FilledBlocks = PagePulls(self.pages)
        if held is None:
            self.fabric.register(DE, Pool.HBM, self.pages.tensor)
        else:
            # As the decode actor wires a compute that keeps the KV (vLLM's pages): prompts land
            # in them and the reader pulls filled blocks from them.
            self.fabric.register(DE, Pool.COMPUTE_KV, held.kv_buffer)
            held.bind(self.de_transport, Pool.COMPUTE_KV)
            filled = HeldPulls(held, Pool.COMPUTE_KV)
            if filled.paged is None:
                # Its pages are Full Blocks (tests/held_compute.py): pulled as Pool.HBM pages are.
                self.fabric.register(DE, Pool.HBM, held.kv_buffer)
        self.decode = DecodeCore(
            DecodeSettings(DE, "d0", cfg.model.max_context, cfg.runtime.max_persists_in_flight,
                           cfg.runtime.transfer_timeout_s, cfg.runtime.verify_kv, cfg.runtime.kv_digests),
            self.layout, self.decode_compute, self.pages,
            DecodePorts(self.readers, self.de_transport, self.collector, self.clock, self.weights), self.store,
            self._links("de"), filled,
        )
        self.handoff.cores[DE] = self.decode

    def _links(self, name: str) -> tuple[Any, Any]:
        return (make_link(self.cfg, f"cnic-in/{name}", self.cfg.cluster.cnic_gbps),
                make_link(self.cfg, f"cnic-out/{name}", self.cfg.cluster.cnic_gbps))

    def _index_blocks(self, result: TurnResult) -> None:
        if result.error is not None:
            # As the Scheduler actor does: a handoff of a failed attempt still on its way is dropped.
            self.decode.cancel(attempt_owner(result.request_id, result.attempt))
        for block in result.persisted:
            assert self.store.contains(block.key), f"{result.request_id}: block {block.key} reported before it was stored"
            self.index.insert_block(block.key, block.parent)

    # --- scheduling, as the Scheduler actor does it ---------------------------------------

    def task(self, request: Request, oracle: bool = False) -> PrefillTask:
        """The scheduler's lookup (scheduling/binding.py, partial-block hits as the config
        resolves them) and the task it hands the prefill engine."""
        prompt = np.asarray(request.prompt, dtype=np.int64)
        spec = RequestSpec(request.request_id, 0, prompt, SamplingParams(max_new_tokens=request.max_new_tokens,
                                                                         stop_token_ids=request.stop_token_ids),
                           self.namespace, self.clock.now())
        keys, hit_tokens = self.binder.lookup(spec)
        usable = len(keys)
        pe_blocks = request.pe_hit_blocks if request.pe_hit_blocks is not None else usable // 2
        return PrefillTask(spec, keys, hit_tokens, request.path, oracle, PE, "p0", DE, "d0",
                           pe_blocks if request.path == "split" else 0,
                           partial_hit=usable * self.layout.block_size > hit_tokens)

    def serve(self, requests: Sequence[Request], oracle: bool = False, timeout_s: float = 60.0) -> list[TurnResult]:
        """Run requests to completion (all submitted at once); results in request order."""
        first = len(self.collector.results)
        self.prefill.accept([self.task(r, oracle) for r in requests])
        deadline = time.monotonic() + timeout_s
        while len(self.collector.results) - first < len(requests):
            progressed = self.prefill.step() | self.decode.step()
            if not progressed:
                time.sleep(0.0005)
            if time.monotonic() > deadline:
                raise TimeoutError(f"only {len(self.collector.results) - first} of {len(requests)} requests finished")
        by_id = {r.request_id: r for r in self.collector.results[first:]}
        return [by_id[r.request_id] for r in requests]

    def assert_idle(self) -> None:
        """Every buffer slot and page is free again and nothing is left in either core."""
        for node, core in self.readers.cores.items():
            counts = core.pool.check_integrity()
            assert counts.free == counts.capacity, f"reader {node}: buffer slots still leased ({counts})"
            assert core.read_q() == 0, f"reader {node}: read queue not empty"
        pages = self.pages.check_integrity()
        assert pages.free == pages.capacity and pages.reserved == 0, f"decode pages still held ({pages})"
        assert not self.prefill.jobs and not self.decode.jobs, "no request may linger in a core"
        assert self.window.all_free(), "every window slot is free between batches"

    def close(self) -> None:
        self.readers.close()


def served_alone(cfg: DualPathConfig, root: Path, request: Request) -> TurnResult:
    """The request's result on a harness of its own under `root`, closed afterwards: the
    reference a fault-injected run's output is compared with."""
    reference = EngineHarness(cfg, root)
    try:
        (result,) = reference.serve([request])
    finally:
        reference.close()
    return result
