"""Block store acceptance: exact round trips, corruption detected, crash leaves a miss, key checks."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dualpath_ray.config import StoreConfig
from dualpath_ray.kv.index import block_keys, namespace_for
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.store import (
    HEADER_SIZE,
    BlockCorruptedError,
    BlockNotFoundError,
    BlockStore,
    IncompatibleBlockError,
    InjectedPutError,
    LocalDirStore,
    MemoryStore,
    open_store,
    validate_key,
)

LAYOUT = KVLayout(n_layer=2, block_size=4, n_kv_head=1, head_dim=2)
KEYS = block_keys(list(range(40)), LAYOUT.block_size, namespace_for("test-model", 0))


def random_block(seed: int, layout: KVLayout = LAYOUT) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, layout.full_block_shape, dtype=torch.uint8, generator=generator)


@pytest.fixture(params=["local_dir-direct", "local_dir-buffered", "memory"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[BlockStore]:
    backend: BlockStore = (
        MemoryStore(LAYOUT) if request.param == "memory"
        else LocalDirStore(tmp_path / "store", LAYOUT, io=request.param.split("-")[1])
    )
    yield backend


@pytest.fixture(params=["direct", "buffered"])
def local(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[LocalDirStore]:
    """A directory store on each I/O path (tmp_path is on a disk: O_DIRECT works there)."""
    backend = LocalDirStore(tmp_path / "store", LAYOUT, io=request.param)
    assert backend.direct == (request.param == "direct"), "the store uses the I/O path asked for"
    yield backend


def flip_byte(path: Path, offset: int) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def visible_files(root: Path) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file()]


# Round trips and the basic contract, for both backends.


def test_round_trip_is_byte_identical(store: BlockStore) -> None:
    block = random_block(1)
    assert store.put(KEYS[0], block), "a first put of a key must report that it stored it"
    out = LAYOUT.empty_full_block()
    store.get_into(KEYS[0], out)
    assert torch.equal(out, block), "a block read back must be byte-identical to the block put"


def test_get_into_fills_a_view_of_a_bigger_pool(store: BlockStore) -> None:
    pool = torch.zeros((4, *LAYOUT.full_block_shape), dtype=torch.uint8)
    block = random_block(2)
    store.put(KEYS[0], block)
    store.get_into(KEYS[0], pool[2])
    assert torch.equal(pool[2], block), "get_into must fill a pool slot view in place"
    assert int(pool[[0, 1, 3]].sum()) == 0, "get_into must not touch the neighbouring pool slots"


def test_put_is_idempotent_and_keeps_the_first_bytes(store: BlockStore) -> None:
    first = random_block(3)
    assert store.put(KEYS[0], first), "the first put must store the block"
    assert not store.put(KEYS[0], random_block(4)), "a second put of a stored key must return False"
    assert torch.equal(store.get(KEYS[0]), first), "a repeated put must not replace the stored bytes"


def test_contains_keys_delete_and_parents(store: BlockStore) -> None:
    store.put(KEYS[0], random_block(5))
    store.put(KEYS[1], random_block(6), parent=KEYS[0])
    assert store.contains(KEYS[0]) and KEYS[1] in store, "stored keys must be reported as present"
    assert sorted(store.keys()) == sorted(KEYS[:2]), "keys() must list exactly the stored keys"
    assert store.parent_of(KEYS[0]) is None, "a first block must have no parent"
    assert store.parent_of(KEYS[1]) == KEYS[0], "parent_of must return the parent given to put"
    assert store.delete(KEYS[0]), "deleting a stored key must return True"
    assert not store.delete(KEYS[0]), "deleting a missing key must return False"
    assert not store.contains(KEYS[0]), "a deleted key must be a miss"
    assert list(store.keys()) == [KEYS[1]], "keys() must drop deleted keys"


def test_missing_key_is_a_block_not_found_key_error(store: BlockStore) -> None:
    with pytest.raises(BlockNotFoundError):
        store.get_into(KEYS[0], LAYOUT.empty_full_block())
    with pytest.raises(KeyError):
        store.parent_of(KEYS[0])


@pytest.mark.parametrize(
    "bad_key",
    ["../..", "a/b", "../" + "0" * 29, "0" * 31, "0" * 33, "A" * 32, "g" * 32, "0" * 31 + "\n", "", 7, None],
)
def test_bad_keys_raise_value_error_everywhere(store: BlockStore, bad_key: object) -> None:
    with pytest.raises(ValueError):
        validate_key(bad_key)
    block = random_block(7)
    calls = [
        lambda: store.put(bad_key, block),  # type: ignore[arg-type]
        lambda: store.get_into(bad_key, LAYOUT.empty_full_block()),  # type: ignore[arg-type]
        lambda: store.contains(bad_key),  # type: ignore[arg-type]
        lambda: store.delete(bad_key),  # type: ignore[arg-type]
        lambda: store.parent_of(bad_key),  # type: ignore[arg-type]
    ]
    if bad_key is not None:
        calls.append(lambda: store.put(KEYS[0], block, parent=bad_key))  # type: ignore[arg-type]
    for call in calls:
        with pytest.raises(ValueError):
            call()
    assert list(store.keys()) == [], "no bad key may store anything"


@pytest.mark.parametrize(
    "bad_block",
    [
        torch.zeros(LAYOUT.full_block_shape, dtype=torch.int8),
        torch.zeros((3, 4, 16), dtype=torch.uint8),
        torch.zeros((2, 16, 4), dtype=torch.uint8).transpose(1, 2),
    ],
    ids=["dtype", "shape", "non-contiguous"],
)
def test_blocks_of_the_wrong_geometry_are_rejected(store: BlockStore, bad_block: torch.Tensor) -> None:
    with pytest.raises(ValueError):
        store.put(KEYS[0], bad_block)
    store.put(KEYS[1], random_block(8))
    with pytest.raises(ValueError):
        store.get_into(KEYS[1], bad_block)


def test_get_many_into_round_trips_and_reports_the_failing_block(store: BlockStore) -> None:
    blocks = [random_block(10 + i) for i in range(5)]
    for key, block in zip(KEYS, blocks):
        store.put(key, block)
    outs = [LAYOUT.empty_full_block() for _ in blocks]
    store.get_many_into(KEYS[:5], outs)
    assert all(torch.equal(o, b) for o, b in zip(outs, blocks)), "batched reads must be exact"
    with pytest.raises(BlockNotFoundError):
        store.get_many_into([KEYS[0], KEYS[9], KEYS[1]], outs[:3])
    with pytest.raises(ValueError):
        store.get_many_into(KEYS[:2], outs[:1])


# LocalDirStore: corruption, layout, crash safety.


@pytest.mark.parametrize("offset", [0, 1, LAYOUT.full_block_bytes // 2, LAYOUT.full_block_bytes - 1])
def test_corrupted_payload_byte_is_detected(local: LocalDirStore, offset: int) -> None:
    local.put(KEYS[0], random_block(20))
    local.put(KEYS[1], random_block(21))
    flip_byte(local.path_of(KEYS[0]), HEADER_SIZE + offset)
    with pytest.raises(BlockCorruptedError, match="payload checksum"):
        local.get_into(KEYS[0], LAYOUT.empty_full_block())
    with pytest.raises(BlockCorruptedError):
        local.get_many_into([KEYS[1], KEYS[0]], [LAYOUT.empty_full_block(), LAYOUT.empty_full_block()])


@pytest.mark.parametrize("offset", [0, 8, 12, 30, 40, 60, 80, 100, 127, 128, HEADER_SIZE - 1])
def test_corrupted_header_byte_is_detected(local: LocalDirStore, offset: int) -> None:
    local.put(KEYS[0], random_block(22), parent=KEYS[5])
    flip_byte(local.path_of(KEYS[0]), offset)
    # The first 128 bytes are checksummed fields; the rest of the header must be zeros.
    with pytest.raises(BlockCorruptedError, match="header checksum" if offset < 128 else "header padding"):
        local.get_into(KEYS[0], LAYOUT.empty_full_block())
    with pytest.raises(BlockCorruptedError):
        local.parent_of(KEYS[0])


@pytest.mark.parametrize("keep", [0, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 5])
def test_truncated_file_is_detected(local: LocalDirStore, keep: int) -> None:
    local.put(KEYS[0], random_block(23))
    path = local.path_of(KEYS[0])
    path.write_bytes(path.read_bytes()[:keep])
    with pytest.raises(BlockCorruptedError, match="truncated"):
        local.get_into(KEYS[0], LAYOUT.empty_full_block())


def test_block_file_under_another_key_is_detected(local: LocalDirStore) -> None:
    local.put(KEYS[0], random_block(24))
    target = local.path_of(KEYS[1])
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_bytes(local.path_of(KEYS[0]).read_bytes())
    with pytest.raises(BlockCorruptedError, match="names block"):
        local.get_into(KEYS[1], LAYOUT.empty_full_block())


def test_block_of_another_layout_raises_a_clear_error(tmp_path: Path) -> None:
    writer = LocalDirStore(tmp_path, KVLayout(n_layer=3, block_size=4, n_kv_head=1, head_dim=2))
    writer.put(KEYS[0], random_block(25, writer.layout))
    reader = LocalDirStore(tmp_path, LAYOUT)
    with pytest.raises(IncompatibleBlockError, match="n_layer=3"):
        reader.get_into(KEYS[0], LAYOUT.empty_full_block())
    with pytest.raises(IncompatibleBlockError, match="n_layer"):
        reader.parent_of(KEYS[0])


def test_files_live_under_fan_out_directories_inside_the_root(local: LocalDirStore) -> None:
    local.put(KEYS[0], random_block(26))
    path = local.path_of(KEYS[0])
    assert path.relative_to(local.root).parts == (KEYS[0][:2], KEYS[0][2:4], f"{KEYS[0]}.kvb"), (
        "a block must live at root/ab/cd/<key>.kvb"
    )
    assert path.stat().st_size == HEADER_SIZE + LAYOUT.full_block_bytes, "file = header + payload"


def test_put_interrupted_before_publish_leaves_a_miss(local: LocalDirStore, monkeypatch: pytest.MonkeyPatch) -> None:
    def crash_on_publish(src: object, dst: object) -> None:
        raise OSError("simulated crash before publish")

    monkeypatch.setattr(os, "link", crash_on_publish)  # the publish: a hard link (LocalDirStore.put)
    with pytest.raises(OSError, match="simulated crash"):
        local.put(KEYS[0], random_block(27))
    monkeypatch.undo()
    assert not local.contains(KEYS[0]), "an unpublished put must be a miss"
    assert list(local.keys()) == [], "an unpublished put must not be listed"
    with pytest.raises(BlockNotFoundError):
        local.get_into(KEYS[0], LAYOUT.empty_full_block())
    assert visible_files(local.root) == [], "a failed put must remove its temporary file"
    assert local.put(KEYS[0], random_block(27)), "the key must be writable after a failed put"


def test_process_killed_before_publish_leaves_a_miss(local: LocalDirStore) -> None:
    child = textwrap.dedent(
        f"""
        import os, torch
        from dualpath_ray.kv.layout import KVLayout
        from dualpath_ray.kv.store import LocalDirStore
        store = LocalDirStore({str(local.root)!r}, KVLayout(2, 4, 1, 2))
        os.link = lambda src, dst: os._exit(17)
        store.put({KEYS[0]!r}, torch.ones(store.layout.full_block_shape, dtype=torch.uint8))
        """
    )
    result = subprocess.run([sys.executable, "-c", child], capture_output=True, timeout=120)
    assert result.returncode == 17, f"the child must die at publish: {result.stderr.decode()}"
    leftovers = visible_files(local.root)
    assert len(leftovers) == 1 and leftovers[0].name.endswith(".tmp"), (
        "the crash must leave only an unpublished temporary file"
    )
    assert not local.contains(KEYS[0]), "a crash before publish must leave a miss"
    assert list(local.keys()) == [], "a temporary file must never be listed as a key"
    assert local.remove_stale_temporaries(max_age_s=0) == 1, "the stale temporary must be swept"
    assert visible_files(local.root) == [], "sweeping must remove the temporary file"


def test_concurrent_puts_of_one_key_publish_one_intact_block(local: LocalDirStore) -> None:
    block = random_block(28)
    errors: list[BaseException] = []

    def writer() -> None:
        try:
            local.put(KEYS[0], block.clone())
        except BaseException as error:  # noqa: BLE001 - collected and asserted below
            errors.append(error)

    threads = [threading.Thread(target=writer) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [], f"concurrent puts of one key must all succeed: {errors}"
    assert torch.equal(local.get(KEYS[0]), block), "the published block must be intact"
    assert len(visible_files(local.root)) == 1, "racing puts must leave exactly one file"


def test_fsync_mode_round_trips(tmp_path: Path) -> None:
    durable = LocalDirStore(tmp_path, LAYOUT, fsync=True)
    block = random_block(29)
    durable.put(KEYS[0], block)
    assert torch.equal(durable.get(KEYS[0]), block), "fsync mode must store the same bytes"


# MemoryStore fault hooks.


def test_memory_store_corrupt_next_read_fails_once() -> None:
    memory = MemoryStore(LAYOUT)
    block = random_block(30)
    memory.put(KEYS[0], block)
    memory.corrupt_next_read(KEYS[0])
    with pytest.raises(BlockCorruptedError):
        memory.get_into(KEYS[0], LAYOUT.empty_full_block())
    assert torch.equal(memory.get(KEYS[0]), block), "only the next read may be corrupted"


def test_memory_store_corrupt_is_permanent() -> None:
    memory = MemoryStore(LAYOUT)
    memory.put(KEYS[0], random_block(31))
    memory.corrupt(KEYS[0], offset=7)
    for _ in range(2):
        with pytest.raises(BlockCorruptedError):
            memory.get_into(KEYS[0], LAYOUT.empty_full_block())


def test_memory_store_failing_puts_leave_a_miss() -> None:
    memory = MemoryStore(LAYOUT)
    memory.fail_next_puts(1)
    with pytest.raises(InjectedPutError):
        memory.put(KEYS[0], random_block(32))
    assert not memory.contains(KEYS[0]), "a failed put must leave a miss"
    assert memory.put(KEYS[0], random_block(32)), "only the requested number of puts may fail"


def test_memory_store_hooks_run_before_get_and_put() -> None:
    memory = MemoryStore(LAYOUT)
    seen: list[str] = []
    memory.set_before_get(seen.append)

    def refuse(key: str) -> None:
        raise OSError(f"refused {key}")

    memory.set_before_put(refuse)
    with pytest.raises(OSError, match="refused"):
        memory.put(KEYS[0], random_block(33))
    assert not memory.contains(KEYS[0]), "a put whose hook raised must leave a miss"
    memory.set_before_put(None)
    memory.put(KEYS[0], random_block(33))
    memory.get(KEYS[0])
    assert seen == [KEYS[0]], "the read hook must see every read key"
    assert (memory.reads, memory.writes) == (1, 1), "counters must count completed reads and writes"


# open_store.


def test_open_store_without_root_makes_a_temporary_directory() -> None:
    opened = open_store(StoreConfig(block_size=LAYOUT.block_size), LAYOUT)
    assert isinstance(opened, LocalDirStore), "local_dir is the default backend"
    assert opened.root is not None and opened.root.is_dir(), "a fresh root directory must exist"
    opened.put(KEYS[0], random_block(34))
    assert opened.contains(KEYS[0]), "the opened store must be usable"


def test_open_store_memory_and_root(tmp_path: Path) -> None:
    memory = open_store(StoreConfig(backend="memory", block_size=LAYOUT.block_size), LAYOUT)
    assert isinstance(memory, MemoryStore) and memory.root is None, "memory backend has no root"
    rooted = open_store(StoreConfig(root=tmp_path / "r", block_size=LAYOUT.block_size), LAYOUT)
    assert rooted.root == tmp_path / "r", "a configured root must be used as is"


def test_open_store_rejects_a_block_size_mismatch() -> None:
    with pytest.raises(ValueError, match="store.block_size"):
        open_store(StoreConfig(block_size=LAYOUT.block_size * 2), LAYOUT)
