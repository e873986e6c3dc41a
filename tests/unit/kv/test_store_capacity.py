"""The store's capacity without store.capacity_bytes: a share of what its file system can hold
when the scheduler starts, so eviction runs before the disk is full."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from dualpath_ray.kv.block_format import HEADER_SIZE
from dualpath_ray.kv.eviction import capacity_from_free_space, store_capacity_bytes
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import LocalDirStore, MemoryStore

LAYOUT = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=2)
PAGE = 4096


def test_the_capacity_is_a_share_of_the_indexed_blocks_plus_the_block_files_that_fit() -> None:
    block = LAYOUT.full_block_bytes
    assert PAGE < HEADER_SIZE + block <= 2 * PAGE, "this layout's block file takes two allocation units"
    capacity = capacity_from_free_space(20 * PAGE + PAGE - 1, PAGE, 10, block, 0.9)
    assert capacity == 18 * block, "0.9 of (10 indexed + 10 whole files of free space), in payload bytes"
    assert capacity_from_free_space(0, PAGE, 0, block, 0.9) == block, "never less than one block"
    big = 3 * PAGE + 1  # a payload of 3 units and a byte, after a header of one unit: 5 units
    assert capacity_from_free_space(10 * PAGE, PAGE, 0, big, 1.0) == 2 * big, "files are rounded up to the unit"
    with pytest.raises(ValueError, match="capacity_free_fraction"):
        capacity_from_free_space(PAGE, PAGE, 0, block, 0.0)


class FakeStatvfs:
    f_frsize = PAGE
    f_bavail = 200  # 100 block files of LAYOUT: a page of header and a page holding the payload


def test_a_directory_store_without_a_configured_capacity_is_bounded_by_its_file_system(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = LocalDirStore(tmp_path, LAYOUT)
    seen: list[str] = []

    def statvfs(path: os.PathLike[str] | str) -> FakeStatvfs:
        seen.append(str(path))
        return FakeStatvfs()

    monkeypatch.setattr(os, "statvfs", statvfs)
    block = LAYOUT.full_block_bytes
    assert store_capacity_bytes(None, 0.5, store, 20) == 60 * block, "half of 20 indexed + 100 free files"
    assert seen == [str(tmp_path)], "the free space is the store's own file system's"
    assert store_capacity_bytes(7 * block, 0.5, store, 20) == 7 * block, "a configured capacity is used as is"
    assert store_capacity_bytes(None, 0.5, MemoryStore(LAYOUT), 20) is None, "a memory store has no file system to fill"
    store.close()


def test_a_real_file_system_gives_whole_blocks_within_its_free_space(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, LAYOUT)
    capacity = store_capacity_bytes(None, 0.9, store, 0)
    stats = os.statvfs(tmp_path)
    assert capacity is not None and capacity % LAYOUT.full_block_bytes == 0, "the capacity is whole blocks"
    assert capacity <= max(LAYOUT.full_block_bytes, stats.f_bavail * stats.f_frsize), "it fits the free space"
    store.close()
