"""Partial-block hits (scheduling/binding.py, scheduler.partial_block_hits): a prompt of whole
blocks whose every block is stored reads them all and computes only its last token; every book
(hit tokens, read tokens, the read queues, the prefill engine's tokens, the task's stored tokens)
counts that exactly."""

from __future__ import annotations

import numpy as np
import pytest

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.index import PrefixIndex, block_keys
from dualpath_ray.protocol.messages import GroupReport, PersistedBlock, RequestSpec, SamplingParams, TurnResult
from dualpath_ray.protocol.types import Mode, ReadPath
from dualpath_ray.scheduling import EngineLoad
from dualpath_ray.scheduling.compute_path import ComputePathModel
from dualpath_ray.scheduling.core_settings import CoreSettings
from dualpath_ray.scheduling.dispatcher import Constants
from dualpath_ray.scheduling.requests import Request
from dualpath_ray.scheduling.scheduler import SchedulerCore

BLOCK = 16
NAMESPACE = "model@0"
WHOLE = np.random.default_rng(11).integers(0, 512, 8 * BLOCK)  # exactly 8 full blocks
RAGGED = np.random.default_rng(11).integers(0, 512, 8 * BLOCK + 5)  # 8 full blocks, then 5 tokens


def core(partial: bool, compute_path: ComputePathModel | None = None, share: ComputePathModel | None = None) -> SchedulerCore:
    settings = CoreSettings(Mode.DUALPATH, BLOCK, Constants(10_000, 100_000), compute_path=compute_path,
                            share_in_flight=share, early_prompt_publish=share is not None, partial_block_hits=partial)
    return SchedulerCore(settings, PrefixIndex(BLOCK))


def spec(rid: str, prompt: np.ndarray) -> RequestSpec:
    return RequestSpec(rid, 0, prompt, SamplingParams(max_new_tokens=8), NAMESPACE, 0.0)


def decode(read_q: int = 0) -> GroupReport:
    return GroupReport("decode/d0", "d0", (EngineLoad("decode/d0/g0", "d0", 0, 0, 100_000),), read_q)


def prefill(read_q: int = 0) -> GroupReport:
    return GroupReport("prefill/p0", "p0", (EngineLoad("prefill/p0/g0", "p0", 0, 0),), read_q)


def finished(s: RequestSpec) -> TurnResult:
    keys = block_keys(s.prompt, BLOCK, NAMESPACE)
    persisted = tuple(PersistedBlock(k, p) for k, p in zip(keys, [None, *keys[:-1]]))
    return TurnResult(s.request_id, s.attempt, (1,), (0.0,), "length", len(s.prompt), 0, ReadPath.PE,
                      "prefill/p0/g0", "decode/d0/g0", 0.1, 0.01, persisted=persisted)


def stored_then_placed(c: SchedulerCore, prompt: np.ndarray, pe_q: int = 0, de_q: int = 500):
    """`first` computes and persists every full block of `prompt`; `second` then arrives and is
    placed (the decode node's read queue is the longer one unless told: the PE path)."""
    first = spec("first", prompt)
    c.submit(first)
    c.fetch_decode(decode())
    c.fetch_prefill(prefill())
    c.finish(finished(first))
    c.submit(spec("second", prompt))
    c.fetch_decode(decode(read_q=de_q))
    (task,) = c.fetch_prefill(prefill(read_q=pe_q))
    return c.requests["second"], task


@pytest.mark.parametrize(
    ("partial", "prompt", "keys", "hit", "is_partial"),
    [
        (True, WHOLE, 8, 8 * BLOCK - 1, True),  # the block holding the last token is read whole
        (False, WHOLE, 7, 7 * BLOCK, False),  # whole-block rule: the last block is computed (16 tokens)
        (True, RAGGED, 8, 8 * BLOCK, False),  # the last token is in an unstored partial block anyway
        (False, RAGGED, 8, 8 * BLOCK, False),
    ],
)
def test_the_hit_ends_one_token_short_of_the_prompt_only_with_partial_hits(
    partial: bool, prompt: np.ndarray, keys: int, hit: int, is_partial: bool,
) -> None:
    request, task = stored_then_placed(core(partial), prompt)
    assert len(request.hit_keys) == keys and request.hit_tokens == hit, f"{keys} blocks, {hit} hit tokens"
    assert request.partial_hit is is_partial and task.partial_hit is is_partial, "the task carries the partial flag"
    assert request.prefill_tokens == len(prompt) - hit, "its prefill engine is booked for the tokens it computes"
    assert task.stored_tokens == keys * BLOCK, "stored tokens: every token its stored blocks hold (none persisted again)"
    assert task.read_end == keys * BLOCK, "the read blocks hold whole blocks, the partial one too"


def test_a_partial_hit_reads_its_last_block_whole_and_computes_one_token() -> None:
    c = core(True)
    request, task = stored_then_placed(c, WHOLE)
    assert task.path is ReadPath.PE and task.pe_blocks == 8, "the shorter read queue: the prefill node's"
    assert task.pe_tokens == 8 * BLOCK, "the prefill node's extent holds all 128 tokens of the 8 blocks"
    assert request.read_tokens == 8 * BLOCK - 1 and request.recomputed_hit_tokens == 0, "the whole hit is read"
    assert c.dispatcher.read_q == {"p0": 8 * BLOCK, "d0": 500}, "the read queue counts whole blocks: 128 tokens"
    assert request.prefill_tokens == 1, "one token computed"
    c.dispatcher.check_integrity()


def test_a_partial_hit_whose_tail_is_recomputed_counts_whole_read_blocks() -> None:
    # The SNIC is slow and the engine fast: the compute path reads none of the 8 blocks.
    model = ComputePathModel(read_tokens_per_s=1.0, compute_tokens_per_s=1e6, prefill_s=lambda cached, new: new / 1e6)
    c = core(True, compute_path=model)
    request, task = stored_then_placed(c, WHOLE)
    assert request.read_blocks == 0 and task.hit_keys == () and task.hit_tokens == 0, "nothing is read"
    assert request.recomputed_hit_tokens == 8 * BLOCK - 1, "the 127 hit tokens are computed, and the last one too"
    assert task.recomputed_keys == tuple(block_keys(WHOLE, BLOCK, NAMESPACE)), "all 8 stored blocks are recomputed"
    assert task.stored_tokens == 8 * BLOCK, "and none of them is persisted again"
    assert task.read_end == 0, "no block is read"
    assert request.prefill_tokens == 8 * BLOCK, "the engine computes the whole prompt"


def test_read_tokens_of_a_partial_hit_read_in_part() -> None:
    request = Request("r", 8 * BLOCK, 8 * BLOCK - 1, 256, tuple(f"k{i}" for i in range(8)), partial_hit=True)
    assert request.hit_block_tokens == BLOCK, "127 hit tokens + the partial block's last token over 8 blocks"
    for read in range(8):
        request.read_blocks = read
        assert request.read_tokens == read * BLOCK, f"{read} whole blocks read"
        assert request.recomputed_hit_tokens == 8 * BLOCK - 1 - read * BLOCK, "the rest of the hit is computed"
    request.read_blocks = 8
    assert request.read_tokens == 8 * BLOCK - 1 and request.recomputed_hit_tokens == 0, "all 8: the whole hit"


def test_a_waiter_waits_for_the_block_holding_its_last_token_with_partial_hits() -> None:
    """Two samples of one 8-block prompt: the second waits for the first's promise. With partial
    hits the promised run it waits for covers all 8 blocks (it will compute 1 token), without
    only 7 (it computes the last block)."""
    model = ComputePathModel(1e6, 100.0, lambda cached, new: new / 100.0, buffer_read_tokens_per_s=0.0)
    for partial, covered in ((True, 8), (False, 7)):
        c = core(partial, share=model)
        c.submit(spec("first", WHOLE))
        c.submit(spec("second", WHOLE))
        c.fetch_decode(decode())
        placed = [t.request_id for t in c.fetch_prefill(prefill())]
        assert placed == ["first"], "behind the first's 128 tokens, computing them again is slower than waiting"
        chain = block_keys(WHOLE, BLOCK, NAMESPACE)
        promise, run = c.dispatcher.sharing.promises.run(chain, 0, 8 if partial else 7)
        assert promise.producer == "first" and run == covered, f"partial={partial}: it waits for {covered} blocks"
        c.prompt_persisted("first")  # its 8 prompt blocks are stored: published, its waiter released
        c.fetch_decode(decode())
        (task,) = c.fetch_prefill(prefill())
        assert task.hit_tokens == (8 * BLOCK - 1 if partial else 7 * BLOCK), "placed after the publish, it reads them"
        assert c.requests["second"].prefill_tokens == (1 if partial else BLOCK), "and computes 1 token, or the last block"


def test_the_setting_resolves_per_engine_backend_and_on_with_vllm_is_refused() -> None:
    assert DualPathConfig().partial_block_hits, "auto: the native engine takes partial hits"
    native_off = DualPathConfig().with_overrides(scheduler={"partial_block_hits": "off"})
    assert not native_off.partial_block_hits, "off is off"
    vllm = DualPathConfig().with_overrides(engine={"backend": "vllm"})
    assert not vllm.partial_block_hits, "auto: vLLM's connector takes whole-block hits only"
    yaml_off = DualPathConfig().with_overrides(scheduler={"partial_block_hits": False})  # YAML 1.1 reads `off` so
    assert yaml_off.scheduler.partial_block_hits == "off" and not yaml_off.partial_block_hits, "a bare YAML off is off"
    with pytest.raises(Exception, match="partial_block_hits"):
        DualPathConfig().with_overrides(engine={"backend": "vllm"}, scheduler={"partial_block_hits": "on"})
