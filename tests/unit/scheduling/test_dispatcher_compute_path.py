"""The compute path at placement (scheduling/dispatcher.py with a ComputePathModel): a request
behind a long read queue reads only a prefix of its hit, and every book the dispatcher keeps
counts what it reads and computes."""

from __future__ import annotations

from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.dispatcher import Constants, Dispatcher
from dualpath_ray.scheduling.loads import EngineLoad, prefill_tokens
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.protocol.types import Mode

DECODE = (EngineLoad("d0/g0", "d0", 0, 0, free_hbm_tokens=100_000),)
PREFILL = (EngineLoad("p0/g0", "p0", 0, 0),)
BLOCK = 64


def placed(model: ComputePathModel | None, read_q: dict[str, int]) -> tuple[Dispatcher, Request]:
    dispatcher = Dispatcher(Constants(alpha_tokens=4096, beta_tokens=100_000), mode=Mode.BASIC, compute_path=model)
    keys = tuple(f"k{i}" for i in range(20))
    dispatcher.submit(Request("r", 20 * BLOCK + 64, 20 * BLOCK, 2048, keys))
    dispatcher.fetch_decode("d0", DECODE)
    for node, tokens in read_q.items():
        dispatcher.report_read_q(node, tokens)
    (request,) = dispatcher.fetch_prefill(PREFILL)
    return dispatcher, request


def compute_bound_s(cached: int, new: int) -> float:
    return new / 50_000  # an engine 50x faster than the 1,000 tokens/s SNIC


def test_behind_a_long_read_queue_part_of_the_hit_is_computed_and_booked() -> None:
    model = ComputePathModel(read_tokens_per_s=1_000.0, compute_tokens_per_s=50_000.0, prefill_s=compute_bound_s)
    dispatcher, request = placed(model, {"p0": 5_000})  # 5 s of reads queued on the prefill node
    assert request.read_blocks == 0 and request.read_keys == (), "5 s behind the queue, computing 1,344 tokens wins"
    assert request.recomputed_hit_tokens == 20 * BLOCK == dispatcher.recomputed_hit_tokens, "the whole hit is computed"
    assert request.prefill_tokens == prefill_tokens(20 * BLOCK + 64, 0), "its engine is booked for every token it computes"
    assert dispatcher.read_q["p0"] == 5_000, "nothing joins the read queue"
    dispatcher.check_integrity()  # the books equal what the live requests add up to


def test_with_an_idle_reader_every_hit_block_is_read() -> None:
    model = ComputePathModel(read_tokens_per_s=1_000_000.0, compute_tokens_per_s=5_000.0, prefill_s=lambda c, n: n / 5_000)
    dispatcher, request = placed(model, {"p0": 0})
    assert request.read_blocks == 20 and request.read_keys == request.hit_keys, "cheap reads: the whole hit is read"
    assert dispatcher.read_q["p0"] == 20 * BLOCK, "its blocks join the prefill node's read queue"
    dispatcher.check_integrity()


def test_off_reads_everything_as_before() -> None:
    dispatcher, request = placed(None, {"p0": 5_000})
    assert request.read_blocks is None and request.read_tokens == request.hit_tokens, "no model: every hit block is read"
    assert dispatcher.recomputed_hit_tokens == 0, "nothing is counted as recomputed"
