"""Simulated prefill engines: staging through the readers, compute-quota batches, layerwise rounds.

A job follows the runtime's PrefillCore (runtime/prefill/core.py): staged at accept (a buffer
extent leased on the side(s) it reads from, its hit blocks read through that node's SNIC, and an
extent on the decode node for the KV it sends), then ready; ready jobs are packed in FIFO order
with `pack_prefill_batch` (the compute quota with the engine-time model as predictor, the layer
window's capacity); a chunk that does not end its prompt goes back to the queue in its place.

A `PrefillUnit` is what steps its layers together: one engine (independent engines), or every
engine of a node when the model runs data-parallel attention with expert-parallel MoE (the
paper's DeepSeek deployments): then each engine packs its own batch, the round's layer takes as
long as the slowest engine's, and the round records Max/Avg of the engines' layer times (the
paper's attention balance across data-parallel peers). A round's length is the layerwise
pipeline in closed form (sim/pipeline.py) over the per-layer load, compute and send times of
its engines' exclusive CNICs; links shared with other engines (decode engines' CNICs, DRAM) are
taken for the round's bytes, and the round ends no earlier than they have carried them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from dualpath_ray.protocol.messages import PrefillTask
from dualpath_ray.scheduling import EngineLoad, pack_lockstep_round, pack_prefill_batch, prefill_tokens
from dualpath_ray.sim.events import EventLoop
from dualpath_ray.sim.links import SimLink
from dualpath_ray.sim.nodes import EngineLinks, SimNode
from dualpath_ray.sim.pipeline import batch_seconds
from dualpath_ray.sim.settings import SimSettings


@dataclass(eq=False)
class SimPrefillJob:
    """One request on a prefill engine, from accept to handoff. pe_blocks / de_blocks: its hit
    blocks read through the prefill node / the decode node (one of them 0 unless split)."""

    task: PrefillTask
    prompt: int
    computed: int
    pe_blocks: int
    de_blocks: int
    decode_engine: object  # the SimDecodeEngine its KV goes to (sim/decode.py)
    decode_node: SimNode
    decode_links: EngineLinks
    owner: str = ""  # the attempt's name (request#attempt), what the engine keys it by
    pending: int = 0  # staging steps not done yet
    ready: bool = False
    chunks: int = 0
    # When it got its decode reservation, its prefill engine, its staged KV; its first token.
    reserved_at: float = 0.0
    assigned_at: float = 0.0
    staged_at: float = 0.0
    first_token_at: float = 0.0

    def __post_init__(self) -> None:
        self.owner = self.task.request.owner

    @property
    def request_id(self) -> str:
        return self.task.request.request_id

    @property
    def load_tokens(self) -> int:
        """What it adds to its engine's tok while it is there (scheduling/loads.py)."""
        return prefill_tokens(self.prompt, self.task.hit_tokens)


@dataclass
class SimPrefillStats:
    rounds: int = 0
    batches: int = 0
    chunks: int = 0
    busy_s: float = 0.0
    # (start, length, Max/Avg of the engines' layer times, fill) of every round of a multi-engine
    # unit; fill = the engines' summed layer time over what a round of full quotas would hold.
    balance: list[tuple[float, float, float, float]] = field(default_factory=list)
    # engine id -> window index (options.snic_window_s) -> summed layer ms of its batches there
    engine_ms: dict[str, dict[int, float]] = field(default_factory=dict)


class SimPrefillEngine:
    def __init__(self, engine_id: str, node: SimNode, settings: SimSettings) -> None:
        self.engine_id = engine_id
        self.node = node
        self.settings = settings
        self.links = EngineLinks(engine_id, settings)
        self.jobs: dict[str, SimPrefillJob] = {}
        self.tok = 0
        self.unit: PrefillUnit | None = None
        self._load: EngineLoad | None = None  # the report, kept until the load changes

    def load(self) -> EngineLoad:
        if self._load is None:
            self._load = EngineLoad(self.engine_id, self.node.node_id, len(self.jobs), self.tok)
        return self._load

    def queue(self) -> list[tuple[str, int, int]]:
        return [(j.owner, j.computed, j.prompt - j.computed) for j in self.jobs.values() if j.ready]

    def add(self, job: SimPrefillJob) -> None:
        self.jobs[job.owner] = job
        self.tok += job.load_tokens
        self._load = None

    def remove(self, job: SimPrefillJob) -> None:
        del self.jobs[job.owner]
        self.tok -= job.load_tokens
        self._load = None


HandOff = Callable[[SimPrefillJob, SimPrefillEngine, float], None]


class PrefillUnit:
    """Engines that step their layers together (one engine, or a whole EP node)."""

    def __init__(
        self, engines: list[SimPrefillEngine], loop: EventLoop, settings: SimSettings, hand_off: HandOff,
        stats: SimPrefillStats,
    ) -> None:
        self.engines = engines
        self.loop = loop
        self.settings = settings
        self.hand_off = hand_off
        self.stats = stats
        self.running = False
        self.predict = settings.cost.prefill_layer_ms
        layers = settings.n_layer if settings.options.quota_scope == "forward" else 1
        self.quota_predict = self.predict if layers == 1 else (lambda pairs: layers * self.predict(pairs))
        self.quota_layer_ms = settings.quota_ms / layers
        for engine in engines:
            engine.unit = self

    def kick(self, now: float) -> None:
        """Start a round if idle and some engine has a ready job."""
        if self.running:
            return
        batches = [(engine, batch) for engine, batch in zip(self.engines, self._pack()) if batch]
        if not batches:
            return
        for _, batch in batches:
            for job, _, _ in batch:
                job.ready = False
        self.running = True
        end = self._round_end(now, batches)
        self.stats.rounds += 1
        self.stats.batches += len(batches)
        self.stats.busy_s += end - now
        self.loop.at(end, self._finish, batches)

    def _pack(self) -> list[list[tuple[SimPrefillJob, int, int]]]:
        """Every engine's batch for the next round. A lockstep unit binds at the round
        (`pack_lockstep_round`): an engine short of the quota runs ready jobs its peers cannot fit,
        which then move to it (their staged KV is in node DRAM or a decode buffer, which every
        engine of the node reaches)."""
        queues = [engine.queue() for engine in self.engines]
        if len(self.engines) == 1 or self.settings.options.lockstep_binding == "placement":
            packed = [pack_prefill_batch(q, self.quota_predict, self.settings.quota_ms, self.settings.window_tokens)
                      if q else [] for q in queues]
        else:
            entries = [[(owner, cached, bsz, engine.jobs[owner].chunks == 0) for owner, cached, bsz in queue]
                       for engine, queue in zip(self.engines, queues)]
            packed = pack_lockstep_round(entries, self.quota_predict, self.settings.quota_ms, self.settings.window_tokens)
        batches = []
        for engine, batch in zip(self.engines, packed):
            jobs = []
            for owner, cached, bsz in batch:
                job = engine.jobs.get(owner) or self._move(owner, engine)
                jobs.append((job, cached, bsz))
            batches.append(jobs)
        return batches

    def _move(self, owner: str, engine: SimPrefillEngine) -> SimPrefillJob:
        """Rebind a peer's job to `engine` (its tok goes with it, so the next report shows it)."""
        source = next(peer for peer in self.engines if owner in peer.jobs)
        job = source.jobs[owner]
        source.remove(job)
        engine.add(job)
        return job

    def _round_end(self, now: float, batches: list[tuple[SimPrefillEngine, list]]) -> float:
        settings = self.settings
        layers = settings.n_layer
        per_layer = settings.kv_bytes_per_token_per_layer
        load = compute = send = 0.0
        shared_loads: dict[SimLink, int] = {}
        shared_sends: dict[SimLink, int] = {}
        layer_ms = []
        for engine, batch in batches:
            in_bytes = out_bytes = 0
            for job, cached, bsz in batch:
                de_tokens = pe_tokens = 0
                if not job.task.oracle:
                    pe_tokens = job.pe_blocks * settings.block_size if job.chunks == 0 else 0
                    de_tokens = cached - pe_tokens
                    sent = bsz + (pe_tokens if job.chunks == 0 else 0)
                    in_bytes += cached * per_layer
                    out_bytes += sent * per_layer
                    _add(shared_loads, engine.node.dram, pe_tokens * per_layer)
                    for link in (job.decode_links.cnic_out, job.decode_node.dram):
                        _add(shared_loads, link, de_tokens * per_layer)
                    for link in (job.decode_links.cnic_in, job.decode_node.dram):
                        _add(shared_sends, link, sent * per_layer)
            ms = self.predict([(cached, bsz) for _, cached, bsz in batch])
            layer_ms.append(ms)
            self._record_engine_ms(now, engine, ms)
            load = max(load, engine.links.cnic_in.take(now, layers * in_bytes) - now) if in_bytes else load
            send = max(send, engine.links.cnic_out.take(now, layers * out_bytes) - now) if out_bytes else send
            compute = max(compute, ms / 1000.0)
        end = now + batch_seconds(layers, load / layers, compute, send / layers, settings.options.layerwise)
        for link, nbytes in shared_loads.items():
            end = max(end, link.take(now, layers * nbytes) + compute + send / layers)
        for link, nbytes in shared_sends.items():
            end = max(end, link.take(now, layers * nbytes))
        self._record_balance(now, layer_ms, end - now)
        return end

    def _record_balance(self, now: float, layer_ms: list[float], length: float) -> None:
        """Max/Avg of the layer times of the unit's engines in this round (an idle engine: 0)."""
        if len(self.engines) < 2 or length <= 0:
            return
        mean = sum(layer_ms) / len(self.engines)
        if mean > 0:
            self.stats.balance.append((now, length, max(layer_ms) / mean, mean / self.quota_layer_ms))

    def _record_engine_ms(self, now: float, engine: SimPrefillEngine, ms: float) -> None:
        if len(self.engines) < 2:
            return
        by_window = self.stats.engine_ms.setdefault(engine.engine_id, {})
        window = int(now / self.settings.options.snic_window_s)
        by_window[window] = by_window.get(window, 0.0) + ms

    def _finish(self, batches: list[tuple[SimPrefillEngine, list]]) -> None:
        now = self.loop.now
        self.running = False
        for engine, batch in batches:
            self.stats.chunks += len(batch)
            for job, cached, bsz in batch:
                job.computed = cached + bsz
                job.chunks += 1
                if job.computed < job.prompt:
                    job.ready = True
                    continue
                job.first_token_at = now
                engine.remove(job)
                self.hand_off(job, engine, now)
        self.kick(now)


def _add(totals: dict[SimLink, int], link: SimLink, nbytes: int) -> None:
    if nbytes:
        totals[link] = totals.get(link, 0) + nbytes
