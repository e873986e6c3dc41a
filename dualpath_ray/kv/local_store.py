"""LocalDirStore: one file per Full Block in a directory tree (also a shared NFS/3FS mount)."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath_ray.kv.block_files import BlockFiles, IoMode, choose_io
from dualpath_ray.kv.block_format import (
    HEADER_SIZE,
    BlockHeader,
    HeaderVerifier,
    check_header,
    checksum,
    decode_header,
    encode_header,
    verify_payload,
)
from dualpath_ray.kv.block_store import (
    KEY_PATTERN,
    BlockCheck,
    BlockCorruptedError,
    BlockFailureHook,
    BlockHook,
    BlockNotFoundError,
    BlockStore,
    IncompatibleBlockError,
    byte_view,
    check_batch,
    check_host_block,
    validate_key,
)
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.read_helpers import BatchRead, ReadHelpers

BLOCK_SUFFIX = ".kvb"
TEMP_SUFFIX = ".tmp"
# File times may come from the kernel's coarse clock, up to one tick behind the one time.time
# reads: a put just after a `discard` decision can carry a time just before it. So blocks with a
# time this close before the decision count as put after it (kept; the sweep deletes them later).
FILE_TIME_SLACK_S = 2 * time.clock_getres(5) if sys.platform == "linux" else 0.02  # 5: CLOCK_REALTIME_COARSE
# Buffered reads (from the page cache when warm): the smallest Full Block a helper thread reads
# faster than the caller alone: below it the fixed cost per block (Python, syscalls, GIL
# hand-offs; xxhash keeps the GIL up to 64 KiB) outweighs the overlap (measured: 64 KiB 0.8x,
# 256 KiB 1.0x, 512 KiB 1.2x of serial).
HELPED_BLOCK_BYTES = 512 * 1024
# Direct reads: blocks read at once (the caller and its helpers) by default. Each thread waits
# on the device for most of a block's time, so the threads are the device's queue depth; the
# depth at which the store reached fio's rate at the same depth on the project machine
# (benchmarks/README.md, "Store read, cold").
DIRECT_QUEUE_DEPTH = 8

if TYPE_CHECKING:
    import torch

# A payload read but not yet verified: its bytes, the checksum its header promises, its path.
_Check = tuple[memoryview, int, str]


def default_read_threads(direct: bool, block_bytes: int) -> int:
    """Helper threads (besides the caller) a store reads with when the config names none."""
    if direct:
        return DIRECT_QUEUE_DEPTH - 1
    return 1 if block_bytes >= HELPED_BLOCK_BYTES else 0


class LocalDirStore(BlockStore):
    """One file per Full Block at root/ab/cd/<key>.kvb.

    Publishing is a rename of a uniquely named temporary file in the block's own directory, the
    one operation shared file systems make atomic; no locks are taken, and two writers racing
    on one key publish identical bytes (a key names its content). Directories are never
    removed, so a put never races a cleanup of its directory.

    Multi-block reads overlap: in get_many_into the caller and up to `read_threads` helper
    threads each read and verify whole blocks, so one checksums block i while another reads
    block i+1 (readv and xxhash both release the GIL), and verification costs the reader little
    when a core is free. By default one helper for Full Blocks of HELPED_BLOCK_BYTES or more,
    none below. The helpers start on the first get_many_into and stop in close(); after
    close the store still reads, on the caller's thread alone. Every method is safe to call from
    several threads at once; concurrent get_many_into calls share the helpers.
    """

    def __init__(
        self, root: str | Path, layout: KVLayout, fsync: bool = False, read_threads: int | None = None,
        io: IoMode = "auto",
    ) -> None:
        self._root = Path(root)
        if self._root.exists() and not self._root.is_dir():
            raise ValueError(f"store root {self._root} exists and is not a directory")
        self._root.mkdir(parents=True, exist_ok=True)
        self._root_text = str(self._root)
        self.layout = layout
        self._headers = HeaderVerifier(layout)
        self._block_shape = tuple(layout.full_block_shape)
        self._file_bytes = HEADER_SIZE + layout.full_block_bytes
        self.fsync = fsync
        direct, self.io_detail = choose_io(self._root, io)
        self._io = BlockFiles(self._root_text, direct, self._headers)
        if read_threads is None:
            read_threads = default_read_threads(direct, layout.full_block_bytes)
        self._helpers = ReadHelpers(read_threads, name=f"store-{self._root.name}")

    @property
    def root(self) -> Path:
        return self._root

    def path_of(self, key: str) -> Path:
        return Path(self._path_text(key))

    def _path_text(self, key: str) -> str:
        key = validate_key(key)
        return f"{self._root_text}/{key[:2]}/{key[2:4]}/{key}{BLOCK_SUFFIX}"

    def put(
        self, key: str, block: torch.Tensor, parent: str | None = None, verify: BlockCheck | None = None
    ) -> bool:
        """BlockStore.put. False only when a valid block of this layout and key is already
        published (its header and size checked, not its payload: a key names its content, so it
        is this block). Anything else at the path (a block of another layout or format version,
        a torn or foreign file) is replaced by this block with the same atomic rename a first
        put uses, so a block reported persisted is always one a read of this layout accepts.

        `verify` runs on the buffer after it was written to the temporary, before the rename
        (a raise deletes the temporary): the header's checksum was taken before the write, so a
        buffer that changed under the write either fails that checksum at every read or fails
        `verify`; what is published is what `verify` accepted.

        The first put of a key wins, also against a concurrent one: the temporary is published
        with a hard link, which fails if the key appeared since the check above, and then this
        put is "already stored" unless what appeared is not a valid block. A key's bytes never
        change once published: two attempts that compute one prompt in different batches store
        KV that differs in the last bits, and a reader (or the decode node's hot tier,
        runtime/reader/hot_blocks.py) that got the first bytes must not find others later."""
        path = self.path_of(key)
        if parent is not None:
            validate_key(parent)
        check_host_block(self.layout, block, "block")
        if self._holds_valid_block(key, str(path)) and _refreshed(path):
            return False
        payload = byte_view(block)
        header = encode_header(BlockHeader.for_block(self.layout, key, parent, checksum(payload)))
        path.parent.mkdir(parents=True, exist_ok=True)
        temp = path.parent / f".{key}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            self._io.write(temp, header, block, payload, self.fsync)
            if verify is not None:
                verify(block)
            if _publish(temp, path):
                published = True
            elif self._holds_valid_block(key, str(path)) and _refreshed(path):
                published = False  # a concurrent put of the key published first
            else:
                os.replace(temp, path)  # what is there is no valid block of this layout, or left
                published = True
        finally:
            temp.unlink(missing_ok=True)
        if self.fsync:
            _fsync_directory(path.parent)
        return published

    def _holds_valid_block(self, key: str, path: str) -> bool:
        """Whether `path` holds a whole version 2 block of this layout naming `key`: one open,
        fstat and header pread, the cost of the exists() check it replaces plus two syscalls.
        A version 1 block is not: the put replaces it, so stored blocks move to version 2."""
        try:
            size, raw = self._io.read_header(path)
        except FileNotFoundError:
            return False
        if size != self._file_bytes:
            return False
        try:
            return self._headers.payload_checksum(raw, key, path)[1] == HEADER_SIZE
        except (BlockCorruptedError, IncompatibleBlockError):
            return False

    def get_into(self, key: str, out: torch.Tensor) -> None:
        verify_payload(*self._read_unverified(key, out))

    def get_many_into(
        self,
        keys: Sequence[str],
        outs: Sequence[torch.Tensor],
        before_read: BlockHook | None = None,
        on_verified: BlockHook | None = None,
        on_failed: BlockFailureHook | None = None,
    ) -> None:
        """BlockStore.get_many_into, read by the caller and the store's helper threads together.

        Each block is read and verified on one thread while the others read the next blocks;
        before_read(i) runs on the thread that reads block i, so it must be thread-safe.
        on_verified(i) runs on the caller's thread, in block order, after block i's checksum
        matched. The first failing block (in key order) raises once no store thread still
        touches any of `outs`.
        """
        check_batch(self.layout, keys, outs)

        def read_block(index: int) -> None:
            if before_read is not None:
                before_read(index)
            verify_payload(*self._read_checked_out(keys[index], outs[index]))

        batch = BatchRead(len(keys), read_block, on_verified)
        try:
            batch.run(self._helpers)
        except BaseException:
            batch.stop()
            for out in outs[batch.verified : batch.claimed]:
                out.zero_()
            if on_failed is not None:
                for index, error in batch.failures():
                    on_failed(index, error)
            raise

    def close(self) -> None:
        """Stop the helper threads (after the jobs already queued); reads still work."""
        self._helpers.close()

    @property
    def helpers(self) -> ReadHelpers:
        return self._helpers

    @property
    def direct(self) -> bool:
        """Whether this store reads and writes its block files with O_DIRECT."""
        return self._io.direct

    def contains(self, key: str) -> bool:
        return self.path_of(key).is_file()

    def delete(self, key: str) -> bool:
        try:
            self.path_of(key).unlink()
        except FileNotFoundError:
            return False
        return True

    def discard(self, key: str, published_before: float) -> bool:
        """BlockStore.discard, without a lock shared with the writers (they may be on other
        nodes of a shared mount). A put that finds the block stored refreshes its mtime before
        it reports the block, so: the block is first renamed to a temporary name (a put from now
        on finds nothing and publishes a new copy), then the renamed file's mtime is read; if a
        put refreshed it at or after `published_before`, it is put back under its name (unless a
        new copy was published meanwhile: same key, same bytes) and kept. A put that refreshed
        it before the rename shows in that mtime; one that comes after the rename writes its own
        copy. Either way the block a writer reports is on disk. A crash between the rename and
        the unlink leaves a temporary that remove_stale_temporaries deletes."""
        path = self._path_text(key)
        published_before -= FILE_TIME_SLACK_S
        try:
            if os.stat(path).st_mtime >= published_before:
                return False  # the cheap check first: most blocks kept are young ones
        except FileNotFoundError:
            return False
        temp = f"{os.path.dirname(path)}/.{key}.{os.getpid()}.{secrets.token_hex(6)}{TEMP_SUFFIX}"
        try:
            os.rename(path, temp)
            fresh = os.stat(temp).st_mtime >= published_before
        except FileNotFoundError:  # gone already (another deleter; a stale-temporary sweep)
            return False
        if fresh:
            try:
                os.link(temp, path)
            except FileExistsError:
                pass  # a writer published a new copy after the rename
            except OSError:  # a file system without hard links: same key, same bytes as any new copy
                os.replace(temp, path)
                return False
        with contextlib.suppress(FileNotFoundError):
            os.unlink(temp)
        return not fresh

    def parent_of(self, key: str) -> str | None:
        path = self._path_text(key)
        try:
            raw = self._io.read_header(path)[1]
        except FileNotFoundError:
            raise BlockNotFoundError(f"block {key} is not in store {self._root}") from None
        header = decode_header(raw, path)
        check_header(header, self.layout, key, path)
        return header.parent

    def keys(self) -> Iterator[str]:
        # Names only (no Path objects, no stat): the index rebuild and the janitor's sweep
        # (kv/janitor.py) list every block, a million of them in a big store.
        suffix = len(BLOCK_SUFFIX)
        for first in _fan_out_directories(self._root):
            for second in _fan_out_directories(first):
                fan_out = first.name + second.name
                try:
                    with os.scandir(second) as entries:
                        names = [e.name for e in entries
                                 if e.name.endswith(BLOCK_SUFFIX) and e.is_file(follow_symlinks=False)]
                except FileNotFoundError:
                    continue
                for name in names:
                    key = name[:-suffix]
                    if key.startswith(fan_out) and KEY_PATTERN.fullmatch(key):
                        yield key

    def remove_stale_temporaries(self, max_age_s: float = 600.0) -> int:
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

    def _read_unverified(self, key: str, out: torch.Tensor) -> _Check:
        """Read header and payload into `out` (one preadv); checks the header, not the payload."""
        import torch

        if not (out.dtype is torch.uint8 and out.shape == self._block_shape and out.is_cpu and out.is_contiguous()):
            check_host_block(self.layout, out, "out")
        return self._read_checked_out(key, out)

    def _read_checked_out(self, key: str, out: torch.Tensor) -> _Check:
        """_read_unverified for an `out` already known to be a host Full Block of this layout."""
        payload = byte_view(out)
        path = self._path_text(key)
        return payload, self._io.read(path, key, out, payload), path

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


def _publish(temp: Path, path: Path) -> bool:
    """Publish the temporary under `path` unless something is there already (False): a hard
    link, atomic and exclusive. A file system without hard links falls back to the rename."""
    try:
        os.link(temp, path)
    except FileExistsError:
        return False
    except OSError as exc:
        if exc.errno not in (errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK):
            raise
        os.replace(temp, path)
    return True


def _refreshed(path: Path) -> bool:
    """Set a stored block's mtime to now (a put found it: see LocalDirStore.discard); False if it
    was taken away meanwhile, and the put publishes its own copy."""
    try:
        os.utime(path)
    except FileNotFoundError:
        return False
    return True


def _fsync_directory(directory: Path) -> None:
    fd = os.open(directory, os.O_RDONLY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
