"""The overlapped multi-block read: exact bytes, verified before use, errors named, threads stopped."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import DIRECT_QUEUE_DEPTH, HELPED_BLOCK_BYTES
from dualpath_ray.kv.read_helpers import BatchRead, HelperState, ReadHelpers
from dualpath_ray.kv.store import (
    HEADER_SIZE,
    BlockCorruptedError,
    BlockNotFoundError,
    LocalDirStore,
    MemoryStore,
)

# 128 KiB blocks: above python-xxhash's 64 KiB threshold, so the helpers hash without the GIL
# (below HELPED_BLOCK_BYTES, so the fixture asks for its helper explicitly).
LAYOUT = KVLayout(n_layer=4, block_size=32, n_kv_head=4, head_dim=64, dtype="bfloat16")
N_BLOCKS = 10
KEYS = block_keys(list(range((N_BLOCKS + 2) * LAYOUT.block_size)), LAYOUT.block_size, namespace_for("pipe", 0))


def random_block(seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, LAYOUT.full_block_shape, dtype=torch.uint8, generator=generator)


BLOCKS = [random_block(100 + i) for i in range(N_BLOCKS)]


@pytest.fixture(params=["direct", "buffered"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalDirStore]:
    backend = LocalDirStore(tmp_path / "store", LAYOUT, read_threads=1, io=request.param)
    for parent, key, block in zip([None, *KEYS], KEYS[:N_BLOCKS], BLOCKS):
        backend.put(key, block, parent=parent)
    yield backend
    backend.close()


def fresh_outs(n: int = N_BLOCKS) -> list[torch.Tensor]:
    return [torch.full(LAYOUT.full_block_shape, 0x5A, dtype=torch.uint8) for _ in range(n)]


def flip_payload_byte(store: LocalDirStore, key: str, offset: int) -> None:
    path = store.path_of(key)
    data = bytearray(path.read_bytes())
    data[HEADER_SIZE + offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_get_many_into_is_byte_identical(store: LocalDirStore) -> None:
    for n in (0, 1, 2, N_BLOCKS):
        outs = fresh_outs(n)
        store.get_many_into(KEYS[:n], outs)
        assert all(torch.equal(o, b) for o, b in zip(outs, BLOCKS)), f"a batch of {n} must read back exactly"
    assert store.helpers.state is HelperState.RUNNING, "a batch must start the store's helper threads"


def test_blocks_are_reported_in_order_only_once_verified(store: LocalDirStore) -> None:
    outs = fresh_outs()
    reads: list[int] = []
    verified: list[int] = []

    def on_verified(i: int) -> None:
        assert torch.equal(outs[i], BLOCKS[i]), f"block {i} must hold its verified bytes when reported"
        verified.append(i)

    store.get_many_into(KEYS[:N_BLOCKS], outs, before_read=reads.append, on_verified=on_verified)
    assert sorted(reads) == list(range(N_BLOCKS)), "before_read must run once per block"
    assert verified == list(range(N_BLOCKS)), "on_verified must report every block once, in block order"


@pytest.mark.parametrize("bad", [0, 4, N_BLOCKS - 1])
def test_corrupted_block_in_a_batch_raises_naming_its_key(store: LocalDirStore, bad: int) -> None:
    flip_payload_byte(store, KEYS[bad], LAYOUT.full_block_bytes // 3)
    outs = fresh_outs()
    verified: list[int] = []
    with pytest.raises(BlockCorruptedError, match="payload checksum") as raised:
        store.get_many_into(KEYS[:N_BLOCKS], outs, on_verified=verified.append)
    assert KEYS[bad] in str(raised.value), "the error must name the corrupted block's key"
    assert verified == list(range(bad)), "only the blocks before the corrupted one may be reported verified"
    assert all(torch.equal(outs[i], BLOCKS[i]) for i in range(bad)), "blocks reported verified must be exact"
    assert int(outs[bad].count_nonzero()) == 0, "the corrupted block's bytes must not be left in its out"
    for i in range(bad + 1, N_BLOCKS):
        assert not torch.equal(outs[i], BLOCKS[i]), f"unreported block {i} must not be left looking like data"
    good = (bad + 1) % N_BLOCKS
    again = fresh_outs(1)
    store.get_many_into([KEYS[good]], again)
    assert torch.equal(again[0], BLOCKS[good]), "the store must keep reading exactly after a failed batch"


def test_truncated_block_in_a_batch_is_detected_and_scrubbed(store: LocalDirStore) -> None:
    path = store.path_of(KEYS[3])
    path.write_bytes(path.read_bytes()[: HEADER_SIZE + 100])
    outs = fresh_outs()
    with pytest.raises(BlockCorruptedError, match="truncated") as raised:
        store.get_many_into(KEYS[:N_BLOCKS], outs)
    assert KEYS[3] in str(raised.value), "the error must name the truncated block's key"
    assert int(outs[3].count_nonzero()) == 0, "a truncated block's partial bytes must not be left in its out"


def test_missing_key_in_a_batch_raises_block_not_found(store: LocalDirStore) -> None:
    keys = [*KEYS[:3], KEYS[N_BLOCKS + 1], *KEYS[3:5]]
    verified: list[int] = []
    with pytest.raises(BlockNotFoundError) as raised:
        store.get_many_into(keys, fresh_outs(len(keys)), on_verified=verified.append)
    assert KEYS[N_BLOCKS + 1] in str(raised.value), "the error must name the missing key"
    assert verified == [0, 1, 2], "the blocks before the miss must be verified and reported"


def test_first_failing_block_wins(store: LocalDirStore) -> None:
    flip_payload_byte(store, KEYS[2], 0)
    store.delete(KEYS[6])
    with pytest.raises(BlockCorruptedError) as raised:
        store.get_many_into(KEYS[:N_BLOCKS], fresh_outs())
    assert KEYS[2] in str(raised.value), "the first failing block in key order must be the one raised"


def test_bad_arguments_are_rejected_before_any_read(store: LocalDirStore) -> None:
    reads: list[int] = []
    with pytest.raises(ValueError, match="2 keys but 1 output"):
        store.get_many_into(KEYS[:2], fresh_outs(1), before_read=reads.append)
    with pytest.raises(ValueError, match="invalid block key"):
        store.get_many_into([KEYS[0], "../etc"], fresh_outs(2), before_read=reads.append)
    with pytest.raises(ValueError, match="uint8 Full Block"):
        store.get_many_into(KEYS[:2], [fresh_outs(1)[0], torch.zeros(3, dtype=torch.uint8)], before_read=reads.append)
    assert reads == [], "a batch with a bad key or out must fail before reading anything"


def test_a_raising_hook_propagates_and_leaves_the_store_usable(store: LocalDirStore) -> None:
    def on_verified(i: int) -> None:
        if i == 2:
            raise RuntimeError("hook failed")

    with pytest.raises(RuntimeError, match="hook failed"):
        store.get_many_into(KEYS[:N_BLOCKS], fresh_outs(), on_verified=on_verified)
    outs = fresh_outs()
    store.get_many_into(KEYS[:N_BLOCKS], outs)
    assert all(torch.equal(o, b) for o, b in zip(outs, BLOCKS)), "the next batch must read exactly"


def test_concurrent_batches_share_the_helpers(store: LocalDirStore) -> None:
    results: dict[int, bool] = {}

    def read(worker: int) -> None:
        outs = fresh_outs()
        order = list(range(N_BLOCKS))[worker:] + list(range(N_BLOCKS))[:worker]
        store.get_many_into([KEYS[i] for i in order], outs)
        results[worker] = all(torch.equal(o, BLOCKS[i]) for o, i in zip(outs, order))

    threads = [threading.Thread(target=read, args=(w,)) for w in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert results == {w: True for w in range(4)}, "concurrent batches must each read their blocks exactly"


def test_helpers_read_blocks_beside_the_caller(store: LocalDirStore) -> None:
    gate = threading.Event()
    readers: dict[int, str] = {}

    def before_read(i: int) -> None:
        readers[i] = threading.current_thread().name
        if i == 0:
            assert gate.wait(timeout=30), "another thread must read a block while block 0's reader waits"
        else:
            gate.set()

    outs = fresh_outs()
    store.get_many_into(KEYS[:N_BLOCKS], outs, before_read=before_read)
    assert all(torch.equal(o, b) for o, b in zip(outs, BLOCKS)), "an overlapped batch must read exactly"
    assert readers[1] != readers[0], "another thread must read block 1 while block 0's reader is held"
    assert threading.current_thread().name in readers.values(), "the caller must read blocks itself too"


def test_close_stops_the_threads_and_reads_still_verify(store: LocalDirStore) -> None:
    store.get_many_into(KEYS[:N_BLOCKS], fresh_outs())
    threads = store.helpers.threads()
    assert threads and all(t.is_alive() for t in threads), "a batch must leave the helper threads running"
    store.close()
    for thread in threads:
        thread.join(timeout=10)
    assert not any(t.is_alive() for t in threads), "close() must stop every helper thread"
    assert store.helpers.state is HelperState.CLOSED, "close() must move the helpers to CLOSED"
    store.close()
    outs = fresh_outs()
    store.get_many_into(KEYS[:N_BLOCKS], outs)
    assert all(torch.equal(o, b) for o, b in zip(outs, BLOCKS)), "a closed store must still read exactly"
    assert store.helpers.threads() == threads, "a closed store must not start new threads"
    flip_payload_byte(store, KEYS[1], 7)
    with pytest.raises(BlockCorruptedError, match=KEYS[1]):
        store.get_many_into(KEYS[:N_BLOCKS], fresh_outs())


def test_zero_read_threads_reads_on_the_caller(tmp_path: Path) -> None:
    serial = LocalDirStore(tmp_path, LAYOUT, read_threads=0)
    for key, block in zip(KEYS, BLOCKS):
        serial.put(key, block)
    outs = fresh_outs()
    readers: set[str] = set()
    serial.get_many_into(KEYS[:N_BLOCKS], outs, before_read=lambda i: readers.add(threading.current_thread().name))
    assert all(torch.equal(o, b) for o, b in zip(outs, BLOCKS)), "a serial batch must read exactly"
    assert readers == {threading.current_thread().name}, "read_threads=0 must read every block on the caller"
    assert serial.helpers.threads() == [], "read_threads=0 must never start a thread"
    with pytest.raises(ValueError, match="read_threads"):
        LocalDirStore(tmp_path, LAYOUT, read_threads=-1)


def test_buffered_helpers_by_default_only_for_blocks_they_speed_up(tmp_path: Path) -> None:
    small = LocalDirStore(tmp_path / "small", LAYOUT, io="buffered")
    big_layout = KVLayout(n_layer=8, block_size=64, n_kv_head=4, head_dim=64, dtype="bfloat16")
    big = LocalDirStore(tmp_path / "big", big_layout, io="buffered")
    assert big_layout.full_block_bytes >= HELPED_BLOCK_BYTES > LAYOUT.full_block_bytes, "test layouts"
    assert small.helpers.size == 0, "blocks under HELPED_BLOCK_BYTES must be read by the caller alone"
    assert big.helpers.size == 1, "blocks of HELPED_BLOCK_BYTES or more must get one helper by default"


def test_direct_reads_keep_the_default_queue_depth_in_flight(tmp_path: Path) -> None:
    store = LocalDirStore(tmp_path, LAYOUT, io="direct")
    assert store.helpers.size == DIRECT_QUEUE_DEPTH - 1, "direct reads: the caller plus depth - 1 helpers"


def test_busy_helpers_cannot_stall_a_batch() -> None:
    helpers = ReadHelpers(1, "test")
    release = threading.Event()
    assert helpers.offer(lambda: release.wait(timeout=30) and None, 1) == 1, "an idle helper must take a job"
    done: list[int] = []
    verified: list[int] = []
    batch = BatchRead(N_BLOCKS, done.append, verified.append)
    batch.run(helpers)
    assert verified == list(range(N_BLOCKS)), "a batch must finish on its caller while every helper is busy"
    assert done == list(range(N_BLOCKS)), "the caller must read every block, in order, when no helper is free"
    assert helpers.offer(lambda: None, 5) == 0, "no job may be queued for a helper that is not idle"
    release.set()
    helpers.close()
    assert not any(t.is_alive() for t in helpers.threads()), "close() must stop a helper once its job ends"


def test_default_batch_read_scrubs_a_corrupted_block() -> None:
    memory = MemoryStore(LAYOUT)
    for key, block in zip(KEYS, BLOCKS[:4]):
        memory.put(key, block)
    memory.corrupt(KEYS[2], offset=5)
    outs = fresh_outs(4)
    verified: list[int] = []
    with pytest.raises(BlockCorruptedError, match=KEYS[2]):
        memory.get_many_into(KEYS[:4], outs, on_verified=verified.append)
    assert verified == [0, 1], "the default batch read must report only the blocks before the bad one"
    assert int(outs[2].count_nonzero()) == 0, "the default batch read must not leave corrupted bytes in the out"


def test_every_bad_block_of_a_parallel_read_is_reported_not_only_the_one_raised(tmp_path: Path) -> None:
    """Several blocks read at once may all be bad: the read raises for the first in key order, and
    on_failed names each of them (the reader counts and repairs every one)."""
    store = LocalDirStore(tmp_path / "store", LAYOUT, read_threads=3)
    for i, key in enumerate(KEYS[:6]):
        store.put(key, torch.full(LAYOUT.full_block_shape, i + 1, dtype=torch.uint8))
    for key in (KEYS[1], KEYS[4]):
        path = store.path_of(key)
        data = bytearray(path.read_bytes())
        data[-1] ^= 0x01
        path.write_bytes(bytes(data))
    failed: list[int] = []
    outs = [LAYOUT.empty_full_block() for _ in range(6)]
    with pytest.raises(BlockCorruptedError):
        # Block 1's read is slow, so another thread reads (bad) block 4 before block 1 fails.
        store.get_many_into(list(KEYS[:6]), outs, before_read=lambda i: time.sleep(0.2 * (i == 1)),
                            on_failed=lambda i, _: failed.append(i))
    assert failed == [1, 4], f"both bad blocks are reported, in key order, and no good one: {failed}"
    store.close()
