"""The reader's memory of bad blocks is bounded (issue 31 item 9): runtime/reader/recent_keys.py,
and the reader core's damaged / corrupt / unreadable keys built on it."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dualpath_ray.kv.errors import BadBlockError
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.runtime.reader.core import ReaderCore
from dualpath_ray.runtime.reader.recent_keys import DEFAULT_KEY_CAP, RecentKeys
from dualpath_ray.protocol.types import ReadPath
from tests.unit.runtime.reader.test_reader_core import reader_core


def test_recent_keys_keep_the_newest_up_to_the_cap_and_count_every_one() -> None:
    keys = RecentKeys(cap=2)
    for key in ("a", "b", "a", "c"):
        keys.add(key)
    assert list(keys) == ["b", "c"], "the oldest key is dropped once the cap is passed; a repeat is not new"
    assert (keys.total, keys.dropped) == (3, 1), "every distinct key is counted, and each one dropped"
    assert "a" not in keys and "c" in keys and len(keys) == 2, "membership follows what is held"
    with pytest.raises(ValueError, match="cap"):
        RecentKeys(cap=0)


def small_cap_core(root: Path, cap: int) -> ReaderCore:
    core = reader_core(root)
    settings = dataclasses.replace(core.settings, bad_key_cap=cap)
    return ReaderCore(settings, core.layout, core.store, (core.snic_read, core.snic_write), core.faults)


def test_the_readers_bad_block_keys_are_bounded_and_its_count_goes_on(tmp_path: Path) -> None:
    core = small_cap_core(tmp_path, cap=2)
    layout = core.layout
    keys = block_keys(list(range(3 * layout.block_size)), layout.block_size, namespace_for("bounded", 0))
    for key in keys:
        core.store.put(key, torch.full(layout.full_block_shape, 1, dtype=torch.uint8))
        path = core.store.path_of(key)
        raw = bytearray(path.read_bytes())
        raw[-1] ^= 0xFF
        path.write_bytes(bytes(raw))
    for key in keys:
        with pytest.raises(BadBlockError):
            core.read_blocks("r#0", [key], 1, ReadPath.PE)
    damaged, corrupt = core.integrity_keys()
    assert corrupt == sorted(keys[1:]) and not damaged, "only the newest `bad_key_cap` corrupt keys are remembered"
    assert core.corrupt_found() == 3, "the count of corrupt blocks found goes on past the cap (its metric too)"
    assert core.pool.check_integrity().free == core.pool.capacity, "every failed read freed its extent"
    core.store.close()


def test_a_reader_remembers_65536_keys_of_each_kind_by_default(tmp_path: Path) -> None:
    core = reader_core(tmp_path)
    assert core.settings.bad_key_cap == DEFAULT_KEY_CAP == 65536, (
        "far above what a chaos run damages (hundreds), so its damaged == corrupt comparison holds"
    )
    assert all(keys.cap == DEFAULT_KEY_CAP for keys in (core.damaged_keys, core.corrupt_keys, core.unreadable_keys)), (
        "each of the three sets is bounded"
    )
    core.store.close()
