"""The store's direct I/O path: where O_DIRECT is refused the store falls back (or refuses to
open when direct is demanded), version 1 files are still read, pool slots are aligned for
zero-copy reads, and the device's errors (EIO, a full disk) surface as they do buffered."""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path

import pytest
import torch

from dualpath_ray.config import StoreConfig
from dualpath_ray.kv.block_format import (
    HEADER_FIELDS_SIZE,
    HEADER_SIZE,
    LEGACY_VERSION,
    BlockHeader,
    checksum,
    encode_header,
)
from dualpath_ray.kv.direct_io import ALIGNMENT, O_DIRECT, is_aligned, probe
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.pool import BufferPool
from dualpath_ray.kv.store import (
    BlockCorruptedError,
    IncompatibleBlockError,
    LocalDirStore,
    open_store,
)

# 64 KiB blocks: a whole number of ALIGNMENT units, so pool slots are aligned and read with no copy.
LAYOUT = KVLayout(n_layer=2, block_size=16, n_kv_head=8, head_dim=64, dtype="bfloat16")
# 64-byte blocks: the payload is read and written through the bounce buffer.
TINY = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=2)
KEYS = block_keys(list(range(8 * LAYOUT.block_size)), LAYOUT.block_size, namespace_for("direct", 0))


def random_block(seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, layout.full_block_shape, dtype=torch.uint8, generator=generator)


def version_1_file(layout: KVLayout, key: str, block: torch.Tensor) -> bytes:
    """A block file as the code before direct I/O wrote it: 128 header bytes, then the payload."""
    payload = block.numpy().tobytes()
    fields = bytearray(encode_header(BlockHeader.for_block(layout, key, None, checksum(payload)))[:HEADER_FIELDS_SIZE])
    struct.pack_into("<H", fields, 8, LEGACY_VERSION)
    struct.pack_into("<Q", fields, HEADER_FIELDS_SIZE - 8, checksum(bytes(fields[: HEADER_FIELDS_SIZE - 8])))
    return bytes(fields) + payload


def test_a_file_system_that_refuses_o_direct_gets_buffered_io_or_a_clear_error(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # tmpfs refused O_DIRECT at open before Linux 6.6 (EINVAL), as some FUSE mounts still do;
    # this machine's tmpfs accepts it, so the refusal is played by os.open.
    real_open = os.open

    def refusing_open(path: str | os.PathLike[str], flags: int, *args: int) -> int:
        if flags & O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument")
        return real_open(path, flags, *args)

    monkeypatch.setattr(os, "open", refusing_open)
    store = LocalDirStore(tmp_path, LAYOUT)
    assert not store.direct and "refused" in store.io_detail, "auto falls back to buffered where O_DIRECT is refused"
    store.put(KEYS[0], random_block(1))
    out = LAYOUT.empty_full_block()
    store.get_into(KEYS[0], out)
    assert torch.equal(out, random_block(1)), "the buffered fallback round-trips"
    with pytest.raises(ValueError, match="refuses it"):
        LocalDirStore(tmp_path, LAYOUT, io="direct")


def test_a_disk_directory_gets_direct_io_by_default(tmp_path: Path) -> None:
    if probe(tmp_path) is not None:
        pytest.skip(f"the test directory refuses O_DIRECT: {probe(tmp_path)}")
    assert LocalDirStore(tmp_path, LAYOUT).direct, "auto picks direct I/O where the probe succeeds"
    assert not LocalDirStore(tmp_path, LAYOUT, io="buffered").direct, "buffered is honoured"
    assert [p.name for p in tmp_path.iterdir()] == [], "the probe leaves no file behind"


def test_pool_slots_are_aligned_for_o_direct() -> None:
    pool = BufferPool(5, LAYOUT, pin=False)
    assert LAYOUT.full_block_bytes % ALIGNMENT == 0, "test layout"
    assert all(is_aligned(pool.full_block(i)) for i in range(5)), "every slot starts on an ALIGNMENT boundary"


@pytest.mark.parametrize("io", ["direct", "buffered"])
@pytest.mark.parametrize("layout", [LAYOUT, TINY], ids=["aligned", "tiny"])
def test_pool_slots_and_unaligned_tensors_round_trip(tmp_path: Path, io: str, layout: KVLayout) -> None:
    store = LocalDirStore(tmp_path, layout, io=io)  # type: ignore[arg-type]
    pool = BufferPool(4, layout, pin=False)
    keys = block_keys(list(range(3 * layout.block_size)), layout.block_size, namespace_for("rt", 0))
    blocks = [random_block(i, layout) for i in range(3)]
    # Sources: an aligned slot, an unaligned view of a bigger tensor, a plain tensor.
    unaligned = torch.empty(layout.full_block_bytes + 1, dtype=torch.uint8)[1:].view(layout.full_block_shape)
    sources = [pool.full_block(3), unaligned, blocks[2].clone()]
    for key, block, source in zip(keys, blocks, sources):
        source.copy_(block)
        store.put(key, source)
        assert os.path.getsize(store.path_of(key)) == HEADER_SIZE + layout.full_block_bytes, "file = header + payload"
    outs = [pool.full_block(0), unaligned, pool.full_block(1)]
    for key, block, out in zip(keys, blocks, outs):
        store.get_into(key, out)
        assert torch.equal(out, block), f"{io}: a block reads back exactly, into an aligned slot or not"
    store.get_many_into(keys[:2], [pool.full_block(0), pool.full_block(1)])
    assert torch.equal(pool.full_block(1), blocks[1]), f"{io}: get_many_into fills the slots"


@pytest.mark.parametrize("io", ["direct", "buffered"])
def test_version_1_files_are_read_and_replaced_by_a_put(tmp_path: Path, io: str) -> None:
    store = LocalDirStore(tmp_path, LAYOUT, io=io)  # type: ignore[arg-type]
    block = random_block(5)
    path = store.path_of(KEYS[0])
    path.parent.mkdir(parents=True)
    path.write_bytes(version_1_file(LAYOUT, KEYS[0], block))
    out = BufferPool(1, LAYOUT, pin=False).full_block(0)
    store.get_into(KEYS[0], out)
    assert torch.equal(out, block), f"{io}: a version 1 block is read from its payload offset"
    assert store.parent_of(KEYS[0]) is None, "a version 1 header is decoded"
    assert store.put(KEYS[0], block), "a put over a version 1 file rewrites it (stored blocks move to version 2)"
    assert os.path.getsize(path) == HEADER_SIZE + LAYOUT.full_block_bytes, "the rewritten file is version 2"
    path.write_bytes(version_1_file(LAYOUT, KEYS[0], block)[:-1])
    with pytest.raises(BlockCorruptedError, match="truncated payload"):
        store.get_into(KEYS[0], out)


def test_an_unknown_format_version_is_refused_clearly(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, LAYOUT)
    store.put(KEYS[0], random_block(6))
    data = bytearray(store.path_of(KEYS[0]).read_bytes())
    struct.pack_into("<H", data, 8, 9)
    struct.pack_into("<Q", data, HEADER_FIELDS_SIZE - 8, checksum(bytes(data[: HEADER_FIELDS_SIZE - 8])))
    store.path_of(KEYS[0]).write_bytes(bytes(data))
    with pytest.raises(IncompatibleBlockError, match="format version 9, this code reads versions 1 and 2"):
        store.get_into(KEYS[0], LAYOUT.empty_full_block())


def test_a_direct_read_error_is_raised_and_no_unverified_bytes_are_left(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirStore(tmp_path, LAYOUT, io="direct", read_threads=0)
    pool = BufferPool(2, LAYOUT, pin=False)
    for i, key in enumerate(KEYS[:2]):
        store.put(key, random_block(i))
    real = os.preadv
    calls = [0]

    def failing_preadv(fd: int, buffers: list[memoryview], offset: int) -> int:
        calls[0] += 1
        if calls[0] == 2:
            real(fd, buffers, offset)  # the bytes land, then the device reports an error
            raise OSError(errno.EIO, "Input/output error")
        return real(fd, buffers, offset)

    monkeypatch.setattr(os, "preadv", failing_preadv)
    with pytest.raises(OSError, match="Input/output"):
        store.get_many_into(KEYS[:2], [pool.full_block(0), pool.full_block(1)])
    assert torch.equal(pool.full_block(0), random_block(0)), "the block verified before the error is kept"
    assert not pool.full_block(1).any(), "the out of the failed block is zeroed, never unverified bytes"


def test_a_full_disk_under_a_direct_write_leaves_a_miss_and_no_temporary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    store = LocalDirStore(tmp_path, LAYOUT, io="direct")

    def full(fd: int, buffers: list[memoryview], offset: int) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "pwritev", full)
    with pytest.raises(OSError, match="No space"):
        store.put(KEYS[0], BufferPool(1, LAYOUT, pin=False).full_block(0))
    assert not store.contains(KEYS[0]), "a refused write publishes nothing"
    assert [p for p in tmp_path.rglob("*") if p.is_file()] == [], "and leaves no temporary"


def test_the_config_names_the_io_and_the_queue_depth(tmp_path: Path) -> None:
    assert StoreConfig().io == "auto" and StoreConfig().read_queue_depth is None, "defaults: probe, derived depth"
    store = open_store(StoreConfig(root=tmp_path, block_size=LAYOUT.block_size, io="buffered", read_queue_depth=3), LAYOUT)
    assert isinstance(store, LocalDirStore) and not store.direct, "store.io reaches the opened store"
    assert store.helpers.size == 2, "read_queue_depth counts the reading thread: depth 3 = 2 helpers"
    with pytest.raises(ValueError):
        StoreConfig(read_queue_depth=0)
