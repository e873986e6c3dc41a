"""A put never reports a block it did not write: False only when a valid block of the store's
layout and key is already there; anything else under the key is replaced atomically. And
`store.fsync` reaches every store `open_store` opens."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from dualpath_ray.config import StoreConfig
from dualpath_ray.kv import local_store
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import HEADER_SIZE, IncompatibleBlockError, LocalDirStore, open_store

FLOAT32 = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=4, dtype="float32")
BFLOAT16 = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=4, dtype="bfloat16")
# The same key under both layouts: what a store saw before the layout joined the namespace.
KEY = block_keys(list(range(4)), 4, namespace_for("m", 0))[0]


def block_of(layout: KVLayout, value: int) -> torch.Tensor:
    return torch.full(layout.full_block_shape, value, dtype=torch.uint8)


def test_a_block_of_another_layout_under_the_key_is_replaced_not_reported(tmp_path: Path) -> None:
    old = LocalDirStore(tmp_path, FLOAT32)
    assert old.put(KEY, block_of(FLOAT32, 1)), "the first put writes"
    new = LocalDirStore(tmp_path, BFLOAT16)
    assert new.put(KEY, block_of(BFLOAT16, 2)), (
        "a put that finds a block of another layout must write its own, not report it persisted"
    )
    assert torch.equal(new.get(KEY), block_of(BFLOAT16, 2)), "the new layout's read gets the new block"
    with pytest.raises(IncompatibleBlockError):
        old.get(KEY)
    assert not new.put(KEY, block_of(BFLOAT16, 2)), "a valid block of this layout and key is reported as there"


@pytest.mark.parametrize(
    "damage",
    ["truncated payload", "truncated header", "flipped header byte", "foreign bytes", "empty file"],
)
def test_a_damaged_file_under_the_key_is_replaced(tmp_path: Path, damage: str) -> None:
    store = LocalDirStore(tmp_path, FLOAT32)
    store.put(KEY, block_of(FLOAT32, 3))
    path = store.path_of(KEY)
    raw = bytearray(path.read_bytes())
    damaged = {
        "truncated payload": raw[:-1],
        "truncated header": raw[: HEADER_SIZE // 2],
        "flipped header byte": raw[:40] + bytes([raw[40] ^ 0xFF]) + raw[41:],
        "foreign bytes": bytearray(b"x" * len(raw)),
        "empty file": bytearray(),
    }[damage]
    path.write_bytes(bytes(damaged))
    assert store.put(KEY, block_of(FLOAT32, 4)), f"a put over a file with a {damage} must write the block"
    assert torch.equal(store.get(KEY), block_of(FLOAT32, 4)), f"after a {damage} the key reads back the new block"
    assert [p.name for p in path.parent.iterdir()] == [path.name], "the replacement leaves no temporary behind"


def test_a_valid_block_is_kept_not_rewritten_and_its_time_refreshed(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, FLOAT32)
    store.put(KEY, block_of(FLOAT32, 5))
    path = store.path_of(KEY)
    os.utime(path, (1_000_000, 1_000_000))  # published long ago
    before = os.stat(path)
    assert not store.put(KEY, block_of(FLOAT32, 5)), "a second put of a stored valid block returns False"
    after = os.stat(path)
    assert before.st_ino == after.st_ino, "a put that finds a valid block must not rewrite it"
    assert after.st_mtime > before.st_mtime, (
        "but it refreshes its time, so a delete decided before this put keeps it (LocalDirStore.discard)"
    )


@pytest.mark.parametrize("fsync", [False, True])
def test_store_fsync_reaches_the_opened_store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, fsync: bool) -> None:
    synced: list[int] = []
    real_fsync = os.fsync

    def counting_fsync(fd: int) -> None:
        synced.append(fd)
        real_fsync(fd)

    monkeypatch.setattr(local_store.os, "fsync", counting_fsync)
    store = open_store(StoreConfig(root=tmp_path, block_size=FLOAT32.block_size, fsync=fsync), FLOAT32)
    assert store.put(KEY, block_of(FLOAT32, 6)), "the put writes"
    assert len(synced) == (2 if fsync else 0), (
        f"store.fsync={fsync}: a put flushes its file and its directory only when the config says so"
    )
    assert torch.equal(store.get(KEY), block_of(FLOAT32, 6)), "both modes store the same bytes"


def test_store_fsync_is_off_by_default() -> None:
    assert StoreConfig().fsync is False, "durable puts cost a flush each: opt in with store.fsync"


def test_the_first_of_two_concurrent_puts_of_a_key_wins_and_its_bytes_never_change(tmp_path: Path) -> None:
    """Two attempts that compute one prompt in different batches put one key with bytes that
    differ in the last bits, both having found it absent: the later publish must not replace
    the bytes a reader may have read already (runtime.verify_kv found a hit's bytes changed)."""
    store = LocalDirStore(tmp_path, FLOAT32)
    answers: list[bool] = []

    def racing_put(_block: torch.Tensor) -> None:  # runs between this put's check and its publish
        answers.append(store.put(KEY, block_of(FLOAT32, 2)))

    assert not store.put(KEY, block_of(FLOAT32, 1), verify=racing_put), "the later publish is 'already stored'"
    assert answers == [True], "the concurrent put published first"
    assert torch.equal(store.get(KEY), block_of(FLOAT32, 2)), "the key keeps the first published bytes"
    assert not [p for p in tmp_path.rglob("*") if p.is_file() and p.name.startswith(".")], "no temporary is left"
