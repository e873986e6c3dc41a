"""A hit block written with another KV layout is a bad block the scheduler repairs (named,
unindexed, deleted, retried), not an INTERNAL failure that ends every turn on its prefix."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from dualpath_ray.kv.errors import BadBlockError
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.protocol.messages import ErrorKind
from dualpath_ray.runtime.engine.failures import classify
from dualpath_ray.protocol.types import ReadPath
from tests.unit.runtime.reader.test_reader_core import reader_core


def test_a_block_of_another_layout_is_named_as_corrupt_and_its_extent_freed(tmp_path: Path) -> None:
    core = reader_core(tmp_path)
    layout = core.layout
    other = replace(layout, dtype="bfloat16" if layout.dtype != "bfloat16" else "float32")
    keys = block_keys(list(range(2 * layout.block_size)), layout.block_size, namespace_for("reader", 9))
    core.store.put(keys[0], torch.zeros(layout.full_block_shape, dtype=torch.uint8))
    LocalDirStore(tmp_path, other).put(keys[1], torch.zeros(other.full_block_shape, dtype=torch.uint8), keys[0])
    free_before = core.pool.check_integrity().free
    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r1", keys, 2, ReadPath.PE)
    assert (failed.value.kind, failed.value.key) == ("corrupt", keys[1]), (
        "the block of another layout is named, so the scheduler unindexes and deletes exactly it"
    )
    assert classify(failed.value) == (ErrorKind.KV_CORRUPT, (keys[1],)), "it is repaired and retried"
    assert ErrorKind.KV_CORRUPT.retryable, "a bad block's turn is retried"
    assert core.pool.check_integrity().free == free_before, "the failed read's extent is free again"
    core.store.close()
