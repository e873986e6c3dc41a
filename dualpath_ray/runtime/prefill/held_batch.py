"""A prefill batch on a compute that keeps the batch's KV in its own pages (PrefillKV,
runtime/compute/prefill_kv.py: vLLM's): what each chunk tells the compute, and what the engine
counts from what it moved.

The chunk's KV comes from and goes to the same extents, in the same token ranges, as the layer
pipeline's (runtime/prefill/pipeline.py `past_sources`, `sent_parts`): the first chunk's past
from the side(s) its hits were read on, a later chunk's from the decode node's extent; the new
tokens, and on the PE path's first chunk the hits, to the decode node's extent. So the scheduler,
the readers and the decode engine see exactly what they see with the native model.
"""

from __future__ import annotations

from dataclasses import replace

from dualpath_ray.protocol.counters import NodeCounters
from dualpath_ray.protocol.names import Pool
from dualpath_ray.runtime.compute.engine_compute import ChunkSpec
from dualpath_ray.runtime.compute.prefill_kv import ChunkKV, KVSpan, PrefillMoved
from dualpath_ray.runtime.prefill.job import PrefillJob
from dualpath_ray.runtime.prefill.pipeline import LayerPipeline, PipelineStats, loaded_end


def with_kv(job: PrefillJob, chunk: ChunkSpec, full_block_bytes: int) -> ChunkSpec:
    """The chunk naming where its KV lies and goes (ChunkSpec.kv): its extents' Full Block
    slots as byte offsets in the readers' buffers."""
    if job.task.oracle:
        return replace(chunk, kv=ChunkKV(oracle=job.oracle_kv))
    de = job.de
    assert de is not None, f"request {job.request_id}: no decode-side extent to send to"
    # A compute that keeps the KV lands whole blocks before the chunk's first token only: no
    # partial-block hit reaches it (scheduler.partial_block_hits resolves to off for vLLM).
    end = loaded_end(job, chunk)
    assert end == chunk.start, f"request {job.request_id}: a partial-block hit [{chunk.start}, {end}) on a compute that keeps its KV"
    past = []
    for grant, lo, hi, side in LayerPipeline.past_sources(job, chunk, end):
        assert grant is not None, f"request {job.request_id}: no extent holds its past KV [{lo}, {hi})"
        past.append(KVSpan(grant.reader, Pool.BUFFER, _offsets(grant.slots, full_block_bytes), lo, hi, side))
    sent = [
        KVSpan(de.reader, Pool.BUFFER, _offsets(de.slots, full_block_bytes), lo, hi, side)
        for lo, hi, side in LayerPipeline.sent_parts(job, chunk)
    ]
    return replace(chunk, kv=ChunkKV(tuple(past), tuple(sent), job.digests))


def count_moved(moved: PrefillMoved, stats: PipelineStats, counters: NodeCounters) -> None:
    """The batch's transfers into the engine's statistics and its node's CNIC counters."""
    stats.layers += moved.layers
    stats.reads += moved.reads
    stats.writes += moved.writes
    stats.bytes_in += moved.bytes_in
    stats.bytes_out += moved.bytes_out
    stats.digest_mismatches += moved.digest_mismatches
    stats.digest_rereads += moved.digest_rereads
    stats.wait_in_s += moved.wait_in_s
    stats.wait_out_s += moved.wait_out_s
    stats.max_transfers_per_layer_peer = max(stats.max_transfers_per_layer_peer, moved.max_transfers_per_layer_peer)
    for side, nbytes in moved.cnic_in.items():
        counters.cnic_in[side] += nbytes
    for side, nbytes in moved.cnic_out.items():
        counters.cnic_out[side] += nbytes


def _offsets(slots: tuple[int, ...], full_block_bytes: int) -> tuple[int, ...]:
    return tuple(slot * full_block_bytes for slot in slots)
