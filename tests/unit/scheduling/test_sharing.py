"""In-flight sharing in the scheduler core (scheduling/sharing.py): requests whose prefix a
producer in flight is computing wait for it when that ends them sooner, read what it published
when its turn ends, and compute at once when it fails or is abandoned."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.kv.promised import PromisedBlocks
from dualpath_ray.protocol.messages import GroupReport, PersistedBlock, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.requests import RequestState
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import Mode, ReadPath

BLOCK = 16
NAMESPACE = "model@0"
PROMPT = np.random.default_rng(3).integers(0, 512, 8 * BLOCK + 5)  # 8 full blocks, then 5 tokens
ENGINE = "prefill/p0/g0"
# Reads at 10,000 tokens/s, an engine computes 1,000 tokens/s: a 133-token prefill takes 0.133 s,
# reading its 128 shared tokens 0.0128 s.
MODEL = ComputePathModel(10_000.0, 1_000.0, lambda cached, new: new / 1_000)


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def core(share: bool = True, early_publish: bool = False, model: ComputePathModel = MODEL) -> tuple[SchedulerCore, Clock]:
    clock = Clock()
    settings = CoreSettings(Mode.DUALPATH, BLOCK, Constants(10_000, 100_000), share_in_flight=model if share else None,
                            early_prompt_publish=early_publish)
    return SchedulerCore(settings, PrefixIndex(BLOCK), clock=clock), clock


def spec(rid: str) -> RequestSpec:
    return RequestSpec(rid, 0, PROMPT, SamplingParams(max_new_tokens=8), NAMESPACE, 0.0)


def decode() -> GroupReport:
    return GroupReport("decode/d0", "d0", (EngineLoad("decode/d0/g0", "d0", 0, 0, 100_000),), 0)


def prefill() -> GroupReport:
    return GroupReport("prefill/p0", "p0", (EngineLoad(ENGINE, "p0", 0, 0),), 0)


def result(s: RequestSpec, error: str | None = None) -> TurnResult:
    keys = block_keys(s.prompt, BLOCK, NAMESPACE)
    persisted = () if error else tuple(PersistedBlock(k, p) for k, p in zip(keys, [None, *keys[:-1]]))
    return TurnResult(s.request_id, s.attempt, (1,), (0.0,), "length", len(s.prompt), 0, ReadPath.PE,
                      ENGINE, "decode/d0/g0", 0.1, 0.01, persisted=persisted, error=error)


def three_samples(c: SchedulerCore) -> list[str]:
    """Three samples of one prompt arrive together; returns the ids placed at once."""
    for rid in ("s0", "s1", "s2"):
        c.submit(spec(rid))
    c.fetch_decode(decode())
    return [t.request_id for t in c.fetch_prefill(prefill())]


def test_samples_of_one_prompt_wait_for_the_one_that_computes_it() -> None:
    c, clock = core()
    assert three_samples(c) == ["s0"], "s1 and s2 wait for s0's prefix: 0.17 s against 0.27 s computing it again"
    assert [c.requests[r].state for r in ("s1", "s2")] == [RequestState.WAITING_PREFIX] * 2
    c.dispatcher.check_integrity()
    clock.now = 0.2
    c.finish(result(spec("s0")))
    assert [c.requests[r].state for r in ("s1", "s2")] == [RequestState.QUEUED_PREFILL] * 2, "released when s0 ends"
    assert list(c.dispatcher.prefill_queue) == ["s1", "s2"], "back at the head of the queue, in the order they were held"
    tasks = c.fetch_prefill(prefill())
    assert [(t.request_id, t.hit_tokens) for t in tasks] == [("s1", 128), ("s2", 128)], (
        "looked up again, both read the 8 blocks s0 published and compute 5 tokens"
    )
    stats = c.dispatcher.sharing.stats if c.dispatcher.sharing else None
    assert stats is not None and stats.shared_tokens == {ENGINE: 256} and stats.waits == {ENGINE: 2}, (
        "2 x 128 prefix tokens shared in flight, 2 waits, counted for the engine they were placed on"
    )
    assert abs(stats.wait_s[ENGINE] - 0.4) < 1e-9, "each waited 0.2 s"
    c.dispatcher.check_integrity()


def test_without_sharing_every_sample_computes_the_prompt() -> None:
    c, _ = core(share=False)
    assert three_samples(c) == ["s0", "s1", "s2"], "scheduler.share_in_flight off: all three are placed at once"


def test_a_failed_producer_releases_its_waiters_at_once_and_they_compute() -> None:
    c, _ = core()
    three_samples(c)
    c.finish(result(spec("s0"), error="its prefill engine died"))
    assert [c.requests[r].state for r in ("s1", "s2")] == [RequestState.QUEUED_PREFILL] * 2, "released at once"
    tasks = c.fetch_prefill(prefill())
    assert [(t.request_id, t.hit_tokens) for t in tasks] == [("s1", 0), ("s2", 0)], (
        "nothing was published; neither waits again (s2 does not wait for s1): both compute"
    )
    sharing = c.dispatcher.sharing
    assert sharing is not None and sharing.stats.released_on_failure == 2
    c.dispatcher.check_integrity()


def test_an_abandoned_producer_releases_its_waiters_and_an_abandoned_waiter_leaves_its_hold() -> None:
    c, _ = core()
    three_samples(c)
    c.abandon("s1")  # a waiter's deadline passed
    c.dispatcher.check_integrity()
    c.abandon("s0")  # the producer is aborted
    assert c.requests["s2"].state is RequestState.QUEUED_PREFILL and not c.requests["s2"].may_wait
    assert [t.request_id for t in c.fetch_prefill(prefill())] == ["s2"], "it computes"
    c.dispatcher.check_integrity()


def test_a_promise_is_a_run_of_blocks_no_one_else_promised() -> None:
    book = PromisedBlocks()
    first = book.promise("a", ("k0", "k1", "k2"), 1.0)
    assert first.blocks == 3
    second = book.promise("b", ("k0", "k1", "k2", "k3", "k4"), 2.0)
    assert second.keys == ("k3", "k4"), "b promises only what a does not"
    found = book.run(("k0", "k1", "k2", "k3"), 1, 4)
    assert found is not None and found[0].producer == "a" and found[1] == 2, "from k1, a covers k1 and k2"
    book.withdraw("a")
    assert book.run(("k0",), 0, 1) is None, "a withdrawn promise covers nothing"
    assert len(book) == 2, "b's blocks stay promised"


def test_prompt_blocks_stored_before_the_turn_ends_release_the_waiters_then() -> None:
    """Where the driver reports a producer's prompt blocks stored (the simulator), they are
    published then, and its waiters read them while it still decodes."""
    c, clock = core(early_publish=True)
    three_samples(c)
    c.handed_off("s0")
    clock.now = 0.1
    assert c.prompt_persisted("s0") == 8, "the 8 prompt blocks s0 computed are indexed"
    assert c.requests["s0"].state is RequestState.DECODING, "s0 still decodes"
    tasks = c.fetch_prefill(prefill())
    assert [(t.request_id, t.hit_tokens) for t in tasks] == [("s1", 128), ("s2", 128)], "both read them now"
    c.finish(result(spec("s0")))  # its turn's result publishes the same blocks again: nothing changes
    assert len(c.index) == 8
    c.dispatcher.check_integrity()


# A slow SNIC (100 tokens/s: reading the 128 shared tokens takes 1.28 s, computing them again
# 0.13 s) and a fast CNIC (100,000 tokens/s) from the producer's decode-node buffer.
SLOW_SNIC = ComputePathModel(100.0, 1_000.0, lambda cached, new: new / 1_000, buffer_read_tokens_per_s=100_000.0)


def test_behind_a_slow_snic_samples_wait_for_the_producers_decode_buffer_and_read_it_there() -> None:
    """With a decode-buffer source (the runtime's readers keep a producer's fresh prompt in
    memory), samples decoding on the producer's node wait for it where the store alone would make
    them compute; they are released when its prompt reaches that node (prompt_persisted) and read
    it on that node's DE path, whatever the read queues say, until its turn ends."""
    c, clock = core(early_publish=True, model=SLOW_SNIC)
    sharing = c.dispatcher.sharing
    assert sharing is not None
    assert three_samples(c) == ["s0"], "s1 and s2 wait: 0.14 s from the buffer against 0.27 s computing"
    assert sharing.counts()["buffer_waits"] == 2, "both chose the producer's decode-node buffer as their source"
    promise = sharing.promises.get("s0")
    assert promise is not None and promise.node == "d0", "the promise names the producer's decode node"
    clock.now = 0.14
    assert c.prompt_persisted("s0") == 8, "s0's 8 prompt blocks are published once they are on its decode node"
    tasks = c.fetch_prefill(prefill())
    assert [(t.request_id, t.hit_tokens, t.path) for t in tasks] == [("s1", 128, ReadPath.DE), ("s2", 128, ReadPath.DE)], (
        "both read the buffered blocks on d0's DE path (s2's read queues alone would have picked PE)"
    )
    assert all(t.pe_hit_blocks == 0 for t in tasks), "the prefill node's reader reads none of them"
    c.finish(result(spec("s0")))
    assert not sharing.in_buffer(c.requests["s1"]), "once the producer's turn ended its blocks are stored: any path"
    c.dispatcher.check_integrity()


def test_without_a_decode_buffer_source_the_same_samples_compute_behind_a_slow_snic() -> None:
    slow_store = ComputePathModel(100.0, 1_000.0, lambda cached, new: new / 1_000)
    c, _ = core(early_publish=True, model=slow_store)
    assert three_samples(c) == ["s0", "s1", "s2"], "reading through a 100 tokens/s SNIC loses: all three compute"


def test_without_early_publish_a_prompt_on_its_decode_node_publishes_nothing() -> None:
    """Basic mode, or no hot tier: the runtime's readers may still report a prompt in memory,
    but its blocks are published only with the turn's result (no reader but that node's has them)."""
    c, _ = core(early_publish=False, model=SLOW_SNIC)
    three_samples(c)
    assert c.prompt_persisted("s0") == 0 and len(c.index) == 0, "nothing published before the turn ends"


def test_the_decode_buffer_source_is_one_cnic_and_only_in_dualpath_mode() -> None:
    """The buffer's rate is alpha's SNIC rate scaled by cnic_gbps / snic_gbps (both are the NIC's
    bytes per second over the KV bytes per token): bench-1p1d's 8 Gbit/s CNIC against its
    16 Mbit/s SNIC is 500x. Basic mode reads only on the prefill side: no buffer source there."""
    from dualpath_ray.config import parse_config

    data = {"cluster": {"snic_gbps": 0.016, "cnic_gbps": 8.0}, "scheduler": {"share_in_flight": True}}
    cfg = parse_config(data, source="<tests>")
    constants = Constants(3_000, 100_000)
    dual = CoreSettings.of(cfg, "dualpath", constants, prefill_s=lambda cached, new: new / 1_000)
    assert dual.share_in_flight is not None and dual.early_prompt_publish, "dualpath: published from the buffer"
    read_rate = 3_000 / cfg.scheduler.alpha_seconds
    assert dual.share_in_flight.buffer_read_tokens_per_s == pytest.approx(read_rate * 500), "one CNIC, 500x the SNIC"
    basic = CoreSettings.of(cfg, "basic", constants, prefill_s=lambda cached, new: new / 1_000)
    assert basic.share_in_flight is not None and basic.share_in_flight.buffer_read_tokens_per_s == 0
    assert not basic.early_prompt_publish, "basic mode publishes with the turn's result"
    data["scheduler"]["share_buffer_blocks"] = 0
    off = CoreSettings.of(parse_config(data, source="<tests>"), "dualpath", constants, prefill_s=lambda c, n: n / 1_000)
    assert off.share_in_flight is not None and off.share_in_flight.buffer_read_tokens_per_s == 0, "0 blocks: off"
    assert not off.early_prompt_publish
