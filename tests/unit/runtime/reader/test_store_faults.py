"""The store's I/O errors at a node's reader: a hit block whose file cannot be read is named
(`unreadable`) and repaired as a corrupt one, an error of the mount names no block, and a block
write the store refuses (a full disk) ends a persist without failing it, counted and logged once."""

from __future__ import annotations

import errno
import logging
from pathlib import Path

import pytest
import torch

from dualpath_ray.faults.plan import FaultMode, FaultSite
from dualpath_ray.kv.errors import BadBlockError
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.block_files import IoMode
from dualpath_ray.kv.block_store import BlockCheck
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.protocol.messages import ErrorKind, PersistedBlock
from dualpath_ray.runtime.engine.failures import classify
from dualpath_ray.runtime.reader.core import ReaderCore
from dualpath_ray.runtime.telemetry.actor_metrics import ReaderMetrics
from dualpath_ray.protocol.types import ReadPath
from tests.fakes import ScriptedFaults
from tests.metric_sink import RecordingSink
from tests.unit.runtime.reader.test_reader_core import reader_core


class FaultyDiskStore(LocalDirStore):
    """A local store on a disk with faults: reading a key of `read_errors` raises that OSError
    (as readv does on a bad sector), and a put raises ENOSPC while `full` or for a key of
    `refused` (as the rename or write of a full disk does)."""

    def __init__(self, root: Path, layout: KVLayout, io: IoMode) -> None:
        super().__init__(root, layout, io=io)
        self.read_errors: dict[str, int] = {}
        self.refused: set[str] = set()
        self.full = False
        self.put_attempts: list[str] = []

    def _read_checked_out(self, key: str, out: torch.Tensor):  # type: ignore[no-untyped-def]
        if key in self.read_errors:
            code = self.read_errors[key]
            raise OSError(code, f"{errno.errorcode[code]} reading block {key}")
        return super()._read_checked_out(key, out)

    def put(self, key: str, block: torch.Tensor, parent: str | None = None, verify: BlockCheck | None = None) -> bool:
        self.put_attempts.append(key)
        if self.full or key in self.refused:
            raise OSError(errno.ENOSPC, f"No space left on device writing block {key}")
        return super().put(key, block, parent, verify)


@pytest.fixture(params=["direct", "buffered"])
def store_io(request: pytest.FixtureRequest) -> IoMode:
    """Every test here runs on both of the store's I/O paths."""
    return request.param  # type: ignore[no-any-return]


def faulty_core(
    tmp_path: Path, io: IoMode, faults: ScriptedFaults | None = None
) -> tuple[ReaderCore, FaultyDiskStore, list[str]]:
    core = reader_core(tmp_path, faults=faults)
    core.store.close()
    store = FaultyDiskStore(tmp_path, core.layout, io)
    core.store = store
    keys = block_keys(list(range(4 * core.layout.block_size)), core.layout.block_size, namespace_for("disk", 0))
    for i, key in enumerate(keys):
        store.put(key, torch.full(core.layout.full_block_shape, i + 1, dtype=torch.uint8), parent=keys[i - 1] if i else None)
    store.put_attempts.clear()
    return core, store, keys


def assert_nothing_held(core: ReaderCore) -> None:
    assert core.read_q() == 0, "a failed read leaves no token in the read queue"
    assert core.pool.check_integrity().free == core.pool.capacity, "a failed read leaves no slot leased"


def test_a_hit_block_the_disk_cannot_read_is_named_unreadable(store_io: IoMode, tmp_path: Path) -> None:
    core, store, keys = faulty_core(tmp_path, store_io)
    store.read_errors[keys[2]] = errno.EIO
    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r1#0", keys, len(keys), ReadPath.PE)
    assert (failed.value.kind, failed.value.key) == ("unreadable", keys[2]), "the block whose read failed is named"
    assert classify(failed.value) == (ErrorKind.KV_UNREADABLE, (keys[2],)), (
        "an unreadable block is named as such: read through the other side's reader first, then repaired as a "
        "corrupt one (SchedulerCore.next_attempt)"
    )
    assert core.store_faults() == ([keys[2]], 0), "the reader remembers the unreadable block"
    assert core.integrity_keys() == ([], []), "an unreadable block is not a checksum failure"
    assert core.counters.snic_read["pe"] == 2 * core.layout.full_block_bytes, "the blocks before it were read"
    assert_nothing_held(core)
    store.close()


@pytest.mark.parametrize("code", [errno.EBADMSG, errno.EUCLEAN])
def test_a_file_system_checksum_error_is_an_unreadable_block(store_io: IoMode, tmp_path: Path, code: int) -> None:
    core, store, keys = faulty_core(tmp_path, store_io)
    store.read_errors[keys[0]] = code
    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r1#0", keys[:1], 1, ReadPath.DE)
    assert (failed.value.kind, failed.value.key) == ("unreadable", keys[0]), f"{errno.errorcode[code]} names its block"
    assert_nothing_held(core)
    store.close()


def test_an_error_of_the_mount_names_no_block_and_is_retried_as_store_io(store_io: IoMode, tmp_path: Path) -> None:
    core, store, keys = faulty_core(tmp_path, store_io)
    store.read_errors[keys[1]] = errno.ESTALE
    with pytest.raises(OSError) as failed:
        core.read_blocks("r1#0", keys, len(keys), ReadPath.PE)
    assert not isinstance(failed.value, BadBlockError), "a stale mount says nothing about the block"
    assert classify(failed.value) == (ErrorKind.STORE_IO, ()), "so it is retried, reading the block again"
    assert core.store_faults() == ([], 0), "and no block is blamed"
    assert_nothing_held(core)
    store.close()


def test_an_injected_store_read_fail_takes_the_path_of_a_real_eio(store_io: IoMode, tmp_path: Path) -> None:
    core, store, keys = faulty_core(tmp_path, store_io, ScriptedFaults({FaultSite.STORE_READ: [FaultMode.FAIL]}))
    with pytest.raises(BadBlockError) as failed:
        core.read_blocks("r1#0", keys[:1], 1, ReadPath.PE)
    assert (failed.value.kind, failed.value.key) == ("unreadable", keys[0]), "the injected EIO names its block"
    assert classify(failed.value)[0] is ErrorKind.KV_UNREADABLE, "and is classified as a real one"
    assert_nothing_held(core)
    store.close()


def persisted(keys: list[str]) -> list[tuple[int, PersistedBlock]]:
    return [(i, PersistedBlock(key, keys[i - 1] if i else None)) for i, key in enumerate(keys)]


def test_a_refused_write_ends_the_persist_with_the_leading_blocks_stored(store_io: IoMode, tmp_path: Path) -> None:
    core, store, keys = faulty_core(tmp_path, store_io)
    new = block_keys(list(range(100, 100 + 3 * core.layout.block_size)), core.layout.block_size, namespace_for("disk", 0))
    store.refused.add(new[1])
    extent = core.lease("r1#0", 3)
    assert core.write_extent(extent.extent_id, persisted(new)) == 1, "one leading block is stored, the refusal does not raise"
    assert store.put_attempts == new[:2], "the blocks after a refused one are not tried: they could never be hit"
    assert store.contains(new[0]) and not store.contains(new[1]), "only the block before the refusal is stored"
    assert core.store_faults() == ([], 1), "the refusal is counted"
    assert core.pool.check_integrity().free == core.pool.capacity, "the extent is freed in any case"
    store.close()


def test_refusals_are_logged_once_until_writes_succeed_again(store_io: IoMode, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    core, store, _ = faulty_core(tmp_path, store_io)
    store.full = True
    size = core.layout.block_size
    chains = [block_keys(list(range(s, s + 2 * size)), size, namespace_for("disk", 1)) for s in range(1000, 1004)]
    with caplog.at_level(logging.WARNING, logger="dualpath_ray.reader"):
        for chain in chains[:3]:
            assert core.write_extent(core.lease("r#0", 2).extent_id, persisted(chain)) == 0, "a full disk stores nothing"
        store.full = False
        assert core.write_extent(core.lease("r#0", 2).extent_id, persisted(chains[3])) == 2, "a disk with room again stores all"
    lines = [r.getMessage() for r in caplog.records]
    assert core.store_faults()[1] == 3, "every refused write is counted"
    sink = RecordingSink()
    ReaderMetrics(sink, core, "decode").collect()
    assert sink.counters[("dualpath_store_write_failures", (("node", "n0"), ("role", "decode")))] == 3, (
        "and exported as dualpath_store_write_failures"
    )
    assert len([m for m in lines if "refused the write" in m]) == 1, f"three refusals in a row log one warning: {lines}"
    assert len([m for m in lines if "takes block writes again" in m]) == 1, f"the recovery is logged once: {lines}"
    store.close()


def test_an_injected_store_publish_fail_is_a_refused_write(store_io: IoMode, tmp_path: Path) -> None:
    core, store, _ = faulty_core(tmp_path, store_io, ScriptedFaults({FaultSite.STORE_PUBLISH: [FaultMode.FAIL]}))
    new = block_keys(list(range(200, 200 + core.layout.block_size)), core.layout.block_size, namespace_for("disk", 0))
    extent = core.lease("r1#0", 1)
    assert core.write_extent(extent.extent_id, persisted(new)) == 0, "an injected publish failure does not raise"
    assert core.store_faults() == ([], 1), "and is counted as the store's refusal is"
    assert not store.contains(new[0]), "nothing was published"
    store.close()
