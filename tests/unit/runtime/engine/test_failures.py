"""Failure kinds and the scheduler's retry decisions, without Ray: what is retried, what a
repair removes, and that a late result of an earlier attempt never finishes the current one."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from dualpath_ray.config import DualPathConfig
from dualpath_ray.kv.errors import BadBlockError
from dualpath_ray.kv.index import block_keys
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.runtime.engine.failures import KVMismatchError, classify
from dualpath_ray.protocol.messages import ErrorKind, GroupReport, Holding, RequestSpec, SamplingParams, failed_result
from dualpath_ray.runtime.control.scheduler_core import build_core
from dualpath_ray.scheduling.scheduler import SchedulerCore
from dualpath_ray.runtime.transport.moves import PeerDiedError, TransportError
from dualpath_ray.scheduling import EngineLoad


def core_with_chain(tmp_path: Path, **runtime: object) -> tuple[SchedulerCore, list[str], RequestSpec]:
    cfg = DualPathConfig().with_overrides(store={"root": str(tmp_path)}, runtime=dict(runtime))
    core = build_core(cfg, str(tmp_path), "dualpath")
    layout = KVLayout.from_model(cfg.model, cfg.store.block_size)
    size = layout.block_size
    prompt = np.arange(4 * size + 3) % cfg.model.vocab_size
    namespace = cfg.model.kv_namespace(block_size=cfg.store.block_size)
    keys = block_keys(prompt[: 4 * size], size, namespace)
    parent = None
    for i, key in enumerate(keys):
        core.store.put(key, torch.full(layout.full_block_shape, i, dtype=torch.uint8), parent=parent)
        core.index.insert_block(key, parent)
        parent = key
    spec = RequestSpec("r1", 0, prompt, SamplingParams(max_new_tokens=4), namespace, 0.0)
    return core, keys, spec


@pytest.mark.parametrize(
    ("error", "kind"),
    [
        (BadBlockError("corrupt", "k", "payload checksum mismatch"), ErrorKind.KV_CORRUPT),
        (BadBlockError("missing", "k", "no file"), ErrorKind.KV_MISSING),
        (KVMismatchError("differs"), ErrorKind.KV_MISMATCH),
        (PeerDiedError("reader/d0 died"), ErrorKind.PEER_DIED),
        (TransportError("timed out"), ErrorKind.TRANSFER),
        (ZeroDivisionError("bug"), ErrorKind.INTERNAL),
    ],
)
def test_every_failure_has_a_kind(error: BaseException, kind: ErrorKind) -> None:
    assert classify(error)[0] is kind, f"{type(error).__name__} is {kind.value}"


def test_a_corrupt_hit_block_is_unindexed_with_its_successors_deleted_and_retried(tmp_path: Path) -> None:
    core, keys, spec = core_with_chain(tmp_path)
    core.submit(spec)
    assert core.lookup(spec)[1] == 4 * core.settings.block_size, "before the failure all 4 blocks hit"
    failed = failed_result(spec, "prefill/p0/g0", "bad", ErrorKind.KV_CORRUPT, (keys[2],))
    assert core.should_retry(failed), "a corrupt block is recomputed under the default policy"
    core.finish(failed)
    assert core.repair(failed) == 2, "the bad block and the one after it leave the index"
    assert not core.store.contains(keys[2]), "the corrupt file is deleted so the retry republishes it"
    assert core.store.contains(keys[3]), "a valid block after it stays stored (only unindexed)"
    retry = RequestSpec(spec.request_id, 1, spec.prompt, spec.sampling, spec.namespace, 0.0)
    core.submit(retry)
    assert core.lookup(retry)[1] == 2 * core.settings.block_size, "the retry hits the longest valid prefix"


def test_policy_fail_and_the_attempt_limit_end_retries(tmp_path: Path) -> None:
    core, keys, spec = core_with_chain(tmp_path, kv_failure_policy="fail", max_attempts=2)
    corrupt = failed_result(spec, "e", "bad", ErrorKind.KV_CORRUPT, (keys[0],))
    assert not core.should_retry(corrupt), "kv_failure_policy=fail returns the typed error"
    died = failed_result(spec, "e", "gone", ErrorKind.PEER_DIED)
    assert core.should_retry(died), "attempt 0 of 2 may be retried"
    last = failed_result(RequestSpec("r1", 1, spec.prompt, spec.sampling, spec.namespace, 0.0), "e", "gone",
                         ErrorKind.PEER_DIED)
    assert not core.should_retry(last), "attempt 1 is the last of max_attempts=2"
    assert not core.should_retry(failed_result(spec, "e", "bug", ErrorKind.INTERNAL)), "bugs are not retried"


def test_a_late_result_of_an_earlier_attempt_never_finishes_the_current_one(tmp_path: Path) -> None:
    core, keys, spec = core_with_chain(tmp_path)
    retry = RequestSpec(spec.request_id, 1, spec.prompt, spec.sampling, spec.namespace, 0.0)
    core.submit(retry)
    late = failed_result(spec, "e", "old", ErrorKind.PEER_DIED)
    assert not core.is_current(late), "attempt 0's result is stale once attempt 1 is queued"
    core.finish(late)
    assert spec.request_id in core.dispatcher.requests, "the current attempt is still queued after a stale result"
    assert core.abandon(spec.request_id) == () and spec.request_id not in core.dispatcher.requests, (
        "abandoning (deadline) removes the request; it held no engine yet"
    )


def test_attempts_an_engine_still_holds_after_they_ended_are_named_for_cancelling(tmp_path: Path) -> None:
    core, keys, spec = core_with_chain(tmp_path)
    retry = RequestSpec(spec.request_id, 1, spec.prompt, spec.sampling, spec.namespace, 0.0)
    core.submit(retry)
    held = {
        "decode/d0/g0": {spec.request_id: Holding(0, False), "gone": Holding(0, False)},
        "decode/d0/g1": {spec.request_id: Holding(1, False), "old-epoch": Holding(1, False, epoch=7)},
        "decode/d0/g2": {"finished-and-decoding": Holding(0, True)},
    }
    assert sorted(core.stale_holdings(held)) == [
        ("decode/d0/g0", "gone#0"), ("decode/d0/g0", f"{spec.request_id}#0"), ("decode/d0/g1", "old-epoch#1@7"),
    ], "an earlier attempt, an ended request and a dead incarnation's attempt are stale; the current one and one decoding are not"


def test_a_silent_engine_is_readmitted_when_its_leader_reaches_it_and_a_confirmed_death_is_not(tmp_path: Path) -> None:
    core, _, spec = core_with_chain(tmp_path)
    free = 1 << 20

    def report(*engines: str) -> GroupReport:
        return GroupReport("decode/d0", "d0", tuple(EngineLoad(e, "d0", 0, 0, free) for e in engines), 0)

    core.engine_died("decode/d0/g0", confirmed=False)
    core.engine_died("decode/d0/g1", confirmed=True)
    assert core.out_of_service() == {"decode/d0/g0", "decode/d0/g1"}, "neither takes work while out"
    core.submit(spec)
    placed = core.fetch_decode(report("decode/d0/g0", "decode/d0/g1"))
    assert [r.decode_engine for r in placed] == ["decode/d0/g0"], (
        "the silent engine its leader reached takes work again; the dead one never does"
    )
    assert core.out_of_service() == {"decode/d0/g1"} and core.readmitted == 1, "one readmission, counted"
