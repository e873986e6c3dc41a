"""A writer killed at a random moment of a put, 1,000 times: every later read is either the whole
verified block or a miss, never a torn block, and the leftover temporaries are swept."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch

from dualpath_ray.kv.block_files import IoMode
from dualpath_ray.kv.errors import BlockNotFoundError
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore

pytestmark = [pytest.mark.chaos, pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")]

TRIALS = 1000
# 2 MiB Full Blocks, so that a put takes long enough for kills to land inside it.
LAYOUT = KVLayout(n_layer=16, block_size=64, n_kv_head=8, head_dim=64, dtype="bfloat16")


def kill_during_put(store: LocalDirStore, key: str, block: torch.Tensor, delay_s: float) -> None:
    pid = os.fork()
    if pid == 0:  # the writer: put, then leave without running any of the parent's cleanup
        try:
            store.put(key, block)
        finally:
            os._exit(0)
    time.sleep(delay_s)
    os.kill(pid, signal.SIGKILL)
    os.waitpid(pid, 0)


def forked_put_seconds(store: LocalDirStore, tmp_key: str, block: torch.Tensor) -> float:
    """How long a forked writer takes from fork to exit on this machine, now."""
    started = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        try:
            store.put(tmp_key, block)
        finally:
            os._exit(0)
    os.waitpid(pid, 0)
    return time.perf_counter() - started


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_a_killed_writer_leaves_a_whole_block_or_none(tmp_path: Path, io: IoMode) -> None:
    store = LocalDirStore(tmp_path / "calibration", LAYOUT, io=io)
    probe = torch.zeros(LAYOUT.full_block_shape, dtype=torch.uint8)
    calibration = block_keys(list(range(5 * LAYOUT.block_size)), LAYOUT.block_size, namespace_for("probe", 0))
    span_s = sorted(forked_put_seconds(store, key, probe) for key in calibration)[2]
    store = LocalDirStore(tmp_path / "store", LAYOUT, io=io)
    tmp_path = tmp_path / "store"
    rng = random.Random(7)
    keys = block_keys(list(range(TRIALS * LAYOUT.block_size)), LAYOUT.block_size, namespace_for("torn", 0))
    out = LAYOUT.empty_full_block()
    whole = missing = 0
    for trial, key in enumerate(keys):
        block = torch.full(LAYOUT.full_block_shape, trial % 251, dtype=torch.uint8)
        # Kills spread over a whole forked put: before the write, during it, around publish.
        kill_during_put(store, key, block, rng.uniform(0.0, 1.2 * span_s))
        try:
            store.get_into(key, out)
        except BlockNotFoundError:
            missing += 1
            continue
        assert torch.equal(out, block), f"trial {trial}: a published block is whole and verified"
        whole += 1
    swept = store.remove_stale_temporaries(max_age_s=0.0)
    print(f"forked put {span_s * 1e3:.1f} ms; {TRIALS} killed writers: {whole} whole blocks, {missing} misses, 0 torn; {swept} temporaries swept")
    assert whole + missing == TRIALS, "every read is a whole block or a miss (a torn one raises and fails here)"
    assert missing > 0 and whole > 0, "kills landed both before and after publish (the test exercised both)"
    assert not any(p.name.endswith(".tmp") for p in tmp_path.rglob("*")), "no temporary is left after the sweep"
