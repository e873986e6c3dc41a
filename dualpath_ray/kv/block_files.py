"""BlockFiles: whole block files read and written, with O_DIRECT or through the page cache.

LocalDirStore (kv/local_store.py) decides what to read and publish; this module moves the bytes.
Which I/O a store directory gets is decided once, when the store opens (`choose_io`):
- "direct": O_DIRECT (kv/direct_io.py); reads land in the caller's buffer with no copy when it
  is aligned, and neither reads nor persists fill the page cache;
- "buffered": plain readv/writev, for file systems that refuse O_DIRECT (tmpfs, some FUSE
  mounts) or when the config asks for it;
- "auto" (the default): direct where the directory's probe succeeds, else buffered, logged once.

Both read the two formats (kv/block_format.py): version 2 files through the chosen I/O, version 1
files (written before direct I/O) buffered from their payload offset, which O_DIRECT cannot read
from. Both write version 2 only.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from dualpath_ray.kv.block_format import (
    HEADER_SIZE,
    LEGACY_HEADER_SIZE,
    HeaderVerifier,
    decode_header,
)
from dualpath_ray.kv.block_store import BlockCorruptedError, BlockNotFoundError
from dualpath_ray.kv.direct_io import (
    O_DIRECT,
    Scratch,
    is_aligned,
    probe,
    read_direct,
    write_direct,
)

if TYPE_CHECKING:
    import torch

LOG = logging.getLogger("dualpath_ray.store")

IoMode = Literal["auto", "direct", "buffered"]


def choose_io(root: Path, asked: IoMode) -> tuple[bool, str]:
    """(whether `root` gets O_DIRECT, why): probed unless buffered is asked for; `direct` on a
    file system that refuses it raises, `auto` falls back to buffered and logs it (once per
    store opened, which is once per process and directory)."""
    if asked == "buffered":
        return False, "buffered (store.io: buffered)"
    refused = probe(root)
    if refused is None:
        return True, "direct (O_DIRECT)"
    if asked == "direct":
        raise ValueError(
            f"store.io is direct but the file system of {root} refuses it ({refused}); "
            "set store.io to auto or buffered"
        )
    LOG.info("store %s: %s; reading and writing blocks through the page cache", root, refused)
    return False, f"buffered ({refused})"


class BlockFiles:
    """Reads and writes of one store's block files, by path, with the I/O chosen for it.

    Safe from several threads at once: each thread has its own bounce buffers."""

    def __init__(self, root: str, direct: bool, headers: HeaderVerifier) -> None:
        self._root = root
        self.direct = direct
        self._headers = headers
        self._payload_bytes = headers.layout.full_block_bytes
        self._scratch = Scratch()

    def read(self, path: str, key: str, out: torch.Tensor, payload: memoryview) -> int:
        """Fill `payload` (the bytes of `out`) with the payload of block `key` at `path`, its
        header checked; returns the checksum the header promises (the payload is not verified)."""
        flags = os.O_RDONLY | os.O_CLOEXEC | (O_DIRECT if self.direct else 0)
        try:
            fd = os.open(path, flags)
        except FileNotFoundError:
            raise BlockNotFoundError(f"block {key} is not in store {self._root}") from None
        try:
            if self.direct:
                head, got = read_direct(fd, payload, is_aligned(out), self._scratch)
            else:
                head, got = self._read_buffered(fd, payload)
        finally:
            os.close(fd)
        if len(head) < HEADER_SIZE:
            decode_header(head, path)  # raises, naming the fault, unless a short version 1 file
        expected, offset = self._headers.payload_checksum(head, key, path)
        if offset == LEGACY_HEADER_SIZE:
            got = _read_payload_at(path, payload, LEGACY_HEADER_SIZE)
        if got != self._payload_bytes:
            raise BlockCorruptedError(f"{path}: truncated payload ({got} of {self._payload_bytes} bytes)")
        return expected

    def _read_buffered(self, fd: int, payload: memoryview) -> tuple[memoryview, int]:
        head = self._scratch.get(HEADER_SIZE)[:HEADER_SIZE]
        got = _read_fully(fd, [head, payload], HEADER_SIZE + len(payload))
        return head[: min(got, HEADER_SIZE)], max(got - HEADER_SIZE, 0)

    def read_header(self, path: str) -> tuple[int, bytes]:
        """(file size, its first HEADER_SIZE bytes or all of a shorter file); FileNotFoundError.

        Buffered even for a direct store: one page, and the version 1 files it may meet have no
        aligned length."""
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            return os.fstat(fd).st_size, os.pread(fd, HEADER_SIZE, 0)
        finally:
            os.close(fd)

    def write(self, path: Path, header: bytes, block: torch.Tensor, payload: memoryview, fsync: bool) -> None:
        """Create `path` (it must not exist) holding `header` (HEADER_SIZE bytes) and `payload`
        (the bytes of `block`); fsync it if asked."""
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | (O_DIRECT if self.direct else 0)
        fd = os.open(path, flags, 0o644)
        try:
            if self.direct:
                write_direct(fd, header, payload, is_aligned(block), self._scratch)
            else:
                _write_fully(fd, [header, payload])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)


def _read_payload_at(path: str, payload: memoryview, offset: int) -> int:
    """A version 1 file's payload, read buffered from `offset`; returns the bytes read."""
    fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    try:
        got = 0
        while got < len(payload):
            n = os.preadv(fd, [payload[got:]], offset + got)
            if n == 0:
                break
            got += n
        return got
    finally:
        os.close(fd)


def _read_fully(fd: int, buffers: list[memoryview], size: int) -> int:
    """readv until the `size` bytes of `buffers` are full or end of file; returns the bytes read.

    A local file fills in one call; the loop is for network file systems that read short.
    """
    total = os.readv(fd, buffers)
    if total in (0, size):
        return total
    got = total
    pending = [b for b in buffers if len(b)]
    while pending and got >= len(pending[0]):
        got -= len(pending.pop(0))
    if got:
        pending[0] = pending[0][got:]
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
