"""BlockStore.discard: a block is deleted unless a put found it (or published it) at or after the
decision, whichever way a writer's put and the delete interleave, so a block a writer reports is
always on disk; nothing is left behind."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
import torch

from dualpath_ray.kv import local_store
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import LocalDirStore, MemoryStore

LAYOUT = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=2)
KEY, OTHER = block_keys(list(range(8)), LAYOUT.block_size, namespace_for("discard", 0))
LONG_AGO = 1_000_000.0


def block(value: int = 7) -> torch.Tensor:
    return torch.full(LAYOUT.full_block_shape, value, dtype=torch.uint8)


def stored_long_ago(root: Path) -> LocalDirStore:
    store = LocalDirStore(root, LAYOUT)
    store.put(KEY, block())
    os.utime(store.path_of(KEY), (LONG_AGO, LONG_AGO))
    return store


def names(root: Path) -> list[str]:
    return sorted(p.name for p in root.rglob("*") if p.is_file())


def test_an_old_block_is_deleted_a_refreshed_one_kept(tmp_path: Path) -> None:
    store = stored_long_ago(tmp_path)
    decided = time.time()
    assert not store.put(KEY, block()), "a writer finds the block stored after the decision"
    assert not store.discard(KEY, decided), "so the delete keeps it: the writer reports it to the index"
    assert torch.equal(store.get(KEY), block()), "and it reads back whole"
    os.utime(store.path_of(KEY), (LONG_AGO, LONG_AGO))
    assert store.discard(KEY, time.time()), "a block no put found since the decision is deleted"
    assert not store.contains(KEY) and names(tmp_path) == [], "no file or temporary is left"
    assert not store.discard(KEY, time.time()), "discarding an absent block is a no-op"


def test_a_put_that_refreshes_the_block_between_the_check_and_the_rename_is_honoured(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = stored_long_ago(tmp_path)
    writer = LocalDirStore(tmp_path, LAYOUT)
    rename = os.rename

    def writer_first(src: str, dst: str) -> None:
        assert not writer.put(KEY, block()), "the writer finds the block and refreshes it"
        rename(src, dst)

    monkeypatch.setattr(local_store.os, "rename", writer_first)
    assert not store.discard(KEY, time.time()), "the refreshed block is put back and kept"
    monkeypatch.undo()
    assert torch.equal(store.get(KEY), block()), "under its own name, whole"
    assert names(tmp_path) == [f"{KEY}.kvb"], "the temporary name is gone"


def test_a_copy_published_after_the_rename_is_left_in_place(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = stored_long_ago(tmp_path)
    writer = LocalDirStore(tmp_path, LAYOUT)
    rename = os.rename

    def writer_after(src: str, dst: str) -> None:
        rename(src, dst)
        assert writer.put(KEY, block()), "the writer finds nothing under the name and publishes its own copy"

    monkeypatch.setattr(local_store.os, "rename", writer_after)
    assert store.discard(KEY, time.time()), "the old file is deleted"
    monkeypatch.undo()
    assert torch.equal(store.get(KEY), block()), "the writer's copy stays: the block it reports is on disk"
    assert names(tmp_path) == [f"{KEY}.kvb"], "only the new copy is left"


def test_the_memory_store_keeps_a_block_put_again_after_the_decision() -> None:
    store = MemoryStore(LAYOUT)
    store.put(KEY, block())
    store.put(OTHER, block())
    decided = time.time()
    assert store.discard(KEY, decided), "a block published before the decision is deleted"
    assert not store.put(OTHER, block()), "a writer finds OTHER stored after the decision"
    assert not store.discard(OTHER, decided), "so it is kept"
    assert store.contains(OTHER) and not store.contains(KEY)
