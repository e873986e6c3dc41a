"""LocalDirStore: one file per Full Block in a directory tree (also a shared NFS/3FS mount)."""

from __future__ import annotations

import os
import queue
import secrets
import threading
import time
import weakref
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from dualpath_ray.kv.block_format import (
    HEADER_SIZE,
    BlockHeader,
    check_header,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from dualpath_ray.kv.block_store import (
    KEY_PATTERN,
    BlockCorruptedError,
    BlockNotFoundError,
    BlockStore,
    byte_view,
    check_host_block,
    validate_key,
)
from dualpath_ray.kv.layout import KVLayout

BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"


class LocalDirStore(BlockStore):
    """One file per Full Block at root/ab/cd/<key>.kvb.

    Publishing is a rename of a uniquely named temporary file in the block's own directory, the
    one operation shared file systems make atomic; no locks are taken, and two writers racing
    on one key publish identical bytes (a key names its content). Directories are never
    removed, so a put never races a cleanup of its directory.
    """

    def __init__(self, root: str | Path, layout: KVLayout, fsync: bool = False) -> None:
        self._root = Path(root)
        if self._root.exists() and not self._root.is_dir():
            raise ValueError(f"store root {self._root} exists and is not a directory")
        self._root.mkdir(parents=True, exist_ok=True)
        self.layout = layout
        self.fsync = fsync
        self._worker_lock = threading.Lock()
        self._worker: _ChecksumWorker | None = None

    @property
    def root(self) -> Path:
        return self._root

    def path_of(self, key: str) -> Path:
        key = validate_key(key)
        return self._root / key[:2] / key[2:4] / f"{key}{BLOCK_SUFFIX}"

    def put(self, key: str, block: torch.Tensor, parent: str | None = None) -> bool:
        path = self.path_of(key)
        if parent is not None:
            validate_key(parent)
        check_host_block(self.layout, block, "block")
        if path.exists():
            return False
        payload = byte_view(block)
        header = encode_header(BlockHeader.for_block(self.layout, key, parent, checksum(payload)))
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".{key}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            fd = os.open(temp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o644)
            try:
                _write_fully(fd, [header, payload])
                if self.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(temp, path)
        except BaseException:
            temp.unlink(missing_ok=True)
            raise
        if self.fsync:
            _fsync_directory(path.parent)
        return True

    def get_into(self, key: str, out: torch.Tensor) -> None:
        header, payload, where = self._read_unverified(key, out)
        verify_payload(payload, header, where)

    def get_many_into(self, keys: Sequence[str], outs: Sequence[torch.Tensor]) -> None:
        """Like get_into per block, verifying block i's checksum while block i+1 is read."""
        if len(keys) != len(outs):
            raise ValueError(f"got {len(keys)} keys but {len(outs)} output blocks")
        if len(keys) < 2:
            super().get_many_into(keys, outs)
            return
        worker = self._checksum_worker()
        results: queue.SimpleQueue[BlockCorruptedError | None] = queue.SimpleQueue()
        submitted = 0
        try:
            for key, out in zip(keys, outs):
                header, payload, where = self._read_unverified(key, out)
                worker.submit(payload, header, where, results)
                submitted += 1
        finally:
            # Wait for every submitted check even when a read failed: the worker must not be
            # left hashing a buffer the caller is about to reuse.
            errors = [e for e in (results.get() for _ in range(submitted)) if e is not None]
        if errors:
            raise errors[0]

    def contains(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def delete(self, key: str) -> bool:
        try:
            self.path_of(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def parent_of(self, key: str) -> str | None:
        fd, path = self._open(key)
        try:
            raw = os.pread(fd, HEADER_SIZE, 0)
        finally:
            os.close(fd)
        header = decode_header(raw, str(path))
        check_header(header, self.layout, key, str(path))
        return header.parent

    def keys(self) -> Iterator[str]:
        for path in self._files():
            name = path.name
            if not name.endswith(BLOCK_SUFFIX):
                continue
            key = name[: -len(BLOCK_SUFFIX)]
            if KEY_PATTERN.fullmatch(key) and self.path_of(key) == path:
                yield key

    def remove_stale_temporaries(self, max_age_s: float = 3600.0) -> int:
        """Delete temporaries of puts that crashed over `max_age_s` ago; returns the count.

        Younger ones may belong to a put still running on another node of a shared mount.
        """
        cutoff = time.time() - max_age_s
        removed = 0
        for path in self._files():
            if path.name.startswith(".") and path.name.endswith(TEMP_SUFFIX):
                try:
                    if path.stat().st_mtime < cutoff:
                        path.unlink()
                        removed += 1
                except FileNotFoundError:
                    continue
        return removed

    def close(self) -> None:
        with self._worker_lock:
            if self._worker is not None:
                self._worker.stop()
                self._worker = None

    def _open(self, key: str) -> tuple[int, Path]:
        path = self.path_of(key)
        try:
            return os.open(path, os.O_RDONLY | os.O_CLOEXEC), path
        except FileNotFoundError:
            raise BlockNotFoundError(f"block {key} is not in store {self._root}") from None

    def _read_unverified(self, key: str, out: torch.Tensor) -> tuple[BlockHeader, memoryview, str]:
        """Read header and payload with one readv into `out`; checks the header, not the payload."""
        check_host_block(self.layout, out, "out")
        payload = byte_view(out)
        raw = bytearray(HEADER_SIZE)
        fd, path = self._open(key)
        try:
            got = _read_fully(fd, [memoryview(raw), payload])
        finally:
            os.close(fd)
        where = str(path)
        header = decode_header(raw[:got] if got < HEADER_SIZE else raw, where)
        check_header(header, self.layout, key, where)
        if got != HEADER_SIZE + header.payload_length:
            raise BlockCorruptedError(
                f"{where}: truncated payload ({got - HEADER_SIZE} of {header.payload_length} bytes)"
            )
        return header, payload, where

    def _checksum_worker(self) -> _ChecksumWorker:
        with self._worker_lock:
            if self._worker is None:
                self._worker = _ChecksumWorker()
                weakref.finalize(self, self._worker.request_stop)
            return self._worker

    def _files(self) -> Iterator[Path]:
        for first in _fan_out_directories(self._root):
            for second in _fan_out_directories(first):
                try:
                    with os.scandir(second) as entries:
                        files = [Path(e.path) for e in entries if e.is_file(follow_symlinks=False)]
                except FileNotFoundError:
                    continue
                yield from files


def _fan_out_directories(directory: Path) -> list[Path]:
    try:
        with os.scandir(directory) as entries:
            return [Path(e.path) for e in entries if len(e.name) == 2 and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _read_fully(fd: int, buffers: list[memoryview]) -> int:
    """readv until every buffer is full or end of file; returns the bytes read.

    A local file fills in one call; the loop is for network file systems that read short.
    """
    total = 0
    pending = [b for b in buffers if len(b)]
    while pending:
        got = os.readv(fd, pending)
        if got == 0:
            break
        total += got
        while pending and got >= len(pending[0]):
            got -= len(pending.pop(0))
        if got:
            pending[0] = pending[0][got:]
    return total


def _write_fully(fd: int, buffers: list[memoryview | bytes]) -> None:
    pending = [memoryview(b) for b in buffers if len(b)]
    while pending:
        wrote = os.writev(fd, pending)
        while pending and wrote >= len(pending[0]):
            wrote -= len(pending.pop(0))
        if wrote:
            pending[0] = pending[0][wrote:]


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


_Job = tuple[memoryview, BlockHeader, str, "queue.SimpleQueue[BlockCorruptedError | None]"]


class _ChecksumWorker:
    """A thread verifying payload checksums; xxhash releases the GIL while it hashes."""

    def __init__(self) -> None:
        self._jobs: queue.SimpleQueue[_Job | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name="block-checksum", daemon=True)
        self._thread.start()

    def submit(
        self,
        payload: memoryview,
        header: BlockHeader,
        where: str,
        results: queue.SimpleQueue[BlockCorruptedError | None],
    ) -> None:
        self._jobs.put((payload, header, where, results))

    def request_stop(self) -> None:
        self._jobs.put(None)

    def stop(self) -> None:
        self.request_stop()
        self._thread.join()

    def _run(self) -> None:
        while (job := self._jobs.get()) is not None:
            payload, header, where, results = job
            try:
                verify_payload(payload, header, where)
            except BlockCorruptedError as error:
                results.put(error)
            else:
                results.put(None)
