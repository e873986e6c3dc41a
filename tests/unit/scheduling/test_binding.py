"""Late binding (scheduling/binding.py): a request's hits are looked up again when it is placed
on a prefill engine, and every choice made then (its prefill tokens, the read queue it joins,
its read path, the compute path's split, the task's hit keys) uses that late answer."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.kv.eviction import LRUEviction
from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.protocol.messages import GroupReport, PersistedBlock, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.protocol.types import Mode, ReadPath
from dualpath_ray.sim.round_robin import RoundRobinPaths

BLOCK = 16
NAMESPACE = "model@0"
PROMPT = np.random.default_rng(7).integers(0, 512, 8 * BLOCK + 5)  # 8 full blocks, then 5 tokens


def core(bind_hits: str = "late", mode: Mode = Mode.DUALPATH, eviction: bool = False) -> SchedulerCore:
    index = PrefixIndex(BLOCK)
    lru = LRUEviction(index, None, None, 1) if eviction else None
    return SchedulerCore(CoreSettings(mode, BLOCK, Constants(10_000, 100_000), bind_hits=bind_hits), index, lru)


def spec(rid: str, prompt: np.ndarray = PROMPT) -> RequestSpec:
    return RequestSpec(rid, 0, prompt, SamplingParams(max_new_tokens=8), NAMESPACE, 0.0)


def decode(hbm: int = 100_000, read_q: int = 0) -> GroupReport:
    return GroupReport("decode/d0", "d0", (EngineLoad("decode/d0/g0", "d0", 0, 0, hbm),), read_q)


def prefill(tok: int = 0, read_q: int = 0) -> GroupReport:
    return GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, tok),), read_q)


def finished(s: RequestSpec, hit_blocks: int = 0) -> TurnResult:
    """The turn's result, persisting every full block of its prompt past its hits."""
    keys = block_keys(s.prompt, BLOCK, NAMESPACE)
    parents = [None, *keys[:-1]]
    persisted = tuple(PersistedBlock(k, p) for k, p in list(zip(keys, parents))[hit_blocks:])
    return TurnResult(s.request_id, s.attempt, (1,), (0.0,), "length", len(s.prompt), 0, ReadPath.PE,
                      "prefill/p0/g0", "decode/d0/g0", 0.1, 0.01, persisted=persisted)


def producer_and_waiter(c: SchedulerCore) -> tuple[RequestSpec, RequestSpec]:
    """`first` is placed and served; `second`, with the same prompt, arrives while `first` runs
    and waits for a decode engine's HBM until `first` has finished and published its blocks."""
    first, second = spec("first"), spec("second")
    c.submit(first)
    c.fetch_decode(decode())
    (task,) = c.fetch_prefill(prefill())
    assert task.hit_tokens == 0, "nothing is stored yet: the first computes its whole prompt"
    c.submit(second)
    assert c.requests["second"].hit_tokens == 0, "at submit nothing is stored yet"
    assert c.fetch_decode(decode(hbm=0)) == [], "no HBM: the second waits"
    c.finish(finished(first))
    c.fetch_decode(decode())
    return first, second


def test_a_request_that_waited_reads_what_was_persisted_meanwhile() -> None:
    c = core()
    _, second = producer_and_waiter(c)
    (task,) = c.fetch_prefill(prefill())
    keys = tuple(block_keys(PROMPT, BLOCK, NAMESPACE))
    assert task.hit_keys == keys and task.hit_tokens == 8 * BLOCK, (
        "looked up again at placement, the second hits all 8 blocks the first persisted while it waited"
    )
    assert c.binder.late_hit_tokens == 8 * BLOCK, "the tokens found late are counted"
    assert c.requests["second"].prefill_tokens == 5, "its prefill engine is booked for the 5 tokens it computes"
    c.dispatcher.check_integrity()


def test_early_binding_keeps_the_submit_answer() -> None:
    c = core("early")
    producer_and_waiter(c)
    (task,) = c.fetch_prefill(prefill())
    assert task.hit_tokens == 0 and task.hit_keys == (), "scheduler.bind_hits: early computes the prefix again"
    assert c.binder.late_hit_tokens == 0


@pytest.mark.parametrize(("pe_q", "de_q", "path", "node"), [(500, 0, ReadPath.DE, "d0"), (0, 500, ReadPath.PE, "p0")])
def test_the_read_path_and_read_queue_follow_the_late_answer(pe_q: int, de_q: int, path: ReadPath, node: str) -> None:
    c = core()
    first, second = spec("first"), spec("second")
    c.submit(first)
    c.fetch_decode(decode())
    c.fetch_prefill(prefill())
    c.submit(second)
    c.fetch_decode(decode(read_q=de_q))
    c.finish(finished(first))  # published after the second was queued for prefill
    (task,) = c.fetch_prefill(prefill(read_q=pe_q))
    assert task.path is path, f"the late hit is read through the shorter read queue ({path.value})"
    expected = {"p0": pe_q, "d0": de_q}
    expected[node] += 8 * BLOCK
    assert c.dispatcher.read_q == expected, f"the 8 late-found blocks join {node}'s read queue until it reports"


def test_hits_only_grow() -> None:
    c = core()
    first = spec("first")
    c.submit(first)
    c.fetch_decode(decode())
    c.fetch_prefill(prefill())
    c.finish(finished(first))
    c.submit(spec("second"))
    keys = block_keys(PROMPT, BLOCK, NAMESPACE)
    c.index.remove(keys[4])  # a repair took blocks 4..7 out while the second waited
    c.binder.published(1)  # and something else was published since, so the second looks again
    c.fetch_decode(decode())
    (task,) = c.fetch_prefill(prefill())
    assert task.hit_tokens == 8 * BLOCK, "a shorter late answer keeps the early one (its blocks are pinned or spared)"


def test_nothing_is_looked_up_again_when_nothing_was_published() -> None:
    c = core()
    c.submit(spec("a"))
    request = c.requests["a"]
    generation = c.binder.generation
    c.fetch_decode(decode())
    c.fetch_prefill(prefill())
    assert request.bound_at == generation == 0, "no publish since its submit: the early answer is the late one"


def test_the_eviction_pin_moves_to_the_late_answer() -> None:
    c = core(eviction=True)
    _, second = producer_and_waiter(c)
    keys = block_keys(PROMPT, BLOCK, NAMESPACE)
    c.fetch_prefill(prefill())
    assert c.eviction is not None and c.eviction.pinned(keys[-1]), "the deepest late hit is pinned while it is in flight"
    c.finish(finished(second, hit_blocks=8))
    assert not c.eviction.pinned(keys[-1]), "and unpinned when it leaves"


def test_round_robin_paths_advance_once_per_placement_with_the_compute_path_on() -> None:
    """The ablation alternates PE, DE request by request; before, the dispatcher asked `_path`
    twice per placement with the compute path on, and every request went DE."""
    model = ComputePathModel(1_000_000.0, 5_000.0, lambda cached, new: new / 5_000)
    c = SchedulerCore(CoreSettings(Mode.DUALPATH, BLOCK, Constants(10_000, 100_000), compute_path=model),
                      PrefixIndex(BLOCK))
    c.dispatcher = RoundRobinPaths(c.settings.constants, Mode.DUALPATH, compute_path=model, binder=c.binder)
    first = spec("first")
    c.submit(first)
    c.fetch_decode(decode())
    c.fetch_prefill(prefill())
    c.finish(finished(first))
    for rid in ("a", "b", "c"):
        c.submit(spec(rid))
    c.fetch_decode(decode())
    tasks = c.fetch_prefill(prefill())
    assert [t.hit_tokens for t in tasks] == [8 * BLOCK] * 3, "cheap reads: every hit is read"
    assert [t.path for t in tasks] == [ReadPath.PE, ReadPath.DE, ReadPath.PE], (
        "one pick per placement of a request that reads (the first placement read nothing: no pick)"
    )
