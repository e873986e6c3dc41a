"""Block files read and written with O_DIRECT, bypassing the page cache.

Why: a node's reader pulls blocks another node wrote minutes ago, so its reads are cold; through
the page cache they cost a copy and fill the cache with blocks no one reads there again (and
persists fill it with blocks this node never reads), evicting what the node does need. O_DIRECT
moves the bytes between the device and the caller's memory, which must then be aligned: every
file offset, length and buffer address a multiple of ALIGNMENT. The block format puts the payload
at HEADER_SIZE = ALIGNMENT (kv/block_format.py), and the reader's buffer slots are allocated
aligned (kv/host_memory.py), so a slot is read into with no copy.

What is not aligned goes through a per-thread aligned bounce buffer (`Scratch`): the header, the
payload's last partial ALIGNMENT bytes, and a whole payload whose destination (or source) is not
aligned (a tensor of a test or a caller outside the pool). A write's last partial unit is written
padded and the file is then cut to its real length.

Some file systems refuse O_DIRECT (tmpfs: at open, EINVAL; some FUSE mounts: at the first read
or write); `probe` finds out per store directory, once, and the store falls back to buffered I/O.
"""

from __future__ import annotations

import mmap
import os
import threading
from pathlib import Path
from typing import TYPE_CHECKING

from dualpath_ray.kv.block_format import HEADER_SIZE

if TYPE_CHECKING:  # the scheduler imports the store without torch (tests/unit/scheduling)
    import torch

# The alignment of O_DIRECT offsets, lengths and buffers: 4096 suits devices whose logical
# blocks are 512 or 4096 bytes, and is the page size, so it also suits the kernel's checks.
ALIGNMENT = 4096
O_DIRECT = getattr(os, "O_DIRECT", 0)


def round_up(n: int) -> int:
    return -(-n // ALIGNMENT) * ALIGNMENT


def is_aligned(tensor: torch.Tensor) -> bool:
    return tensor.data_ptr() % ALIGNMENT == 0


def probe(root: Path) -> str | None:
    """None if files in `root` can be written and read with O_DIRECT; else why not.

    Writes, reads back and deletes one ALIGNMENT-byte file: a file system may accept the open
    and refuse the I/O (some FUSE mounts), or return other bytes than were written."""
    if not O_DIRECT:
        return "this platform has no O_DIRECT"
    path = root / f".direct-io-probe.{os.getpid()}.{threading.get_ident()}.tmp"
    page = mmap.mmap(-1, ALIGNMENT)
    page.write(b"dualpath direct io probe".ljust(ALIGNMENT, b"\x5a"))
    back = mmap.mmap(-1, ALIGNMENT)
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC | O_DIRECT, 0o600)
        try:
            os.pwritev(fd, [page], 0)
            got = os.preadv(fd, [back], 0)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"O_DIRECT refused: {exc.strerror or exc}"
    finally:
        path.unlink(missing_ok=True)
    if got != ALIGNMENT or back[:] != page[:]:
        return f"O_DIRECT read back {got} bytes that differ from the {ALIGNMENT} written"
    return None


class Scratch:
    """Aligned bounce buffers, one set per thread (mmap: page-aligned), grown on demand.

    A thread's buffers are used by that thread only, for one block file at a time, so a read
    or write never shares one with another thread."""

    def __init__(self) -> None:
        self._local = threading.local()

    def get(self, nbytes: int) -> memoryview:
        """An aligned writable buffer of at least `nbytes` (this thread's; contents undefined)."""
        buffer: mmap.mmap | None = getattr(self._local, "buffer", None)
        if buffer is None or len(buffer) < nbytes:
            buffer = mmap.mmap(-1, max(round_up(nbytes), 2 * ALIGNMENT))
            self._local.buffer = buffer
        return memoryview(buffer)


def read_direct(fd: int, payload: memoryview, aligned_out: bool, scratch: Scratch) -> tuple[memoryview, int]:
    """Read a version 2 block file opened with O_DIRECT: its header into scratch, its payload
    into `payload` (directly when `aligned_out`, else through scratch). Returns (the header
    bytes, HEADER_SIZE of them or fewer for a short file; payload bytes read)."""
    size = len(payload)
    whole = size - size % ALIGNMENT if aligned_out else 0
    rest = round_up(size - whole)
    buffer = scratch.get(HEADER_SIZE + rest)
    head, bounce = buffer[:HEADER_SIZE], buffer[HEADER_SIZE : HEADER_SIZE + rest]
    buffers = [head, payload[:whole], bounce] if whole else [head, bounce]
    got = _read_aligned(fd, [b for b in buffers if len(b)])
    payload_got = min(max(got - HEADER_SIZE, 0), size)
    if payload_got > whole:
        payload[whole:payload_got] = bounce[: payload_got - whole]
    return head[: min(got, HEADER_SIZE)], payload_got


def _read_aligned(fd: int, buffers: list[memoryview]) -> int:
    """preadv from offset 0 until the buffers are full or end of file. A short read that ends
    off the alignment is the end of the file (O_DIRECT could not read on from it anyway)."""
    want = sum(len(b) for b in buffers)
    total = 0
    while total < want:
        got = os.preadv(fd, _skip(buffers, total), total)
        if got == 0:
            break
        total += got
        if total % ALIGNMENT:
            break
    return total


def write_direct(fd: int, header: bytes, payload: memoryview, aligned_in: bool, scratch: Scratch) -> None:
    """Write a version 2 block file opened with O_DIRECT: `header` (HEADER_SIZE bytes), then
    `payload` (directly when `aligned_in`, else through scratch); the last partial unit is
    written padded, then the file is cut to HEADER_SIZE + len(payload)."""
    size = len(payload)
    whole = size - size % ALIGNMENT if aligned_in else 0
    rest = size - whole
    buffer = scratch.get(HEADER_SIZE + round_up(rest))
    head, bounce = buffer[:HEADER_SIZE], buffer[HEADER_SIZE : HEADER_SIZE + round_up(rest)]
    head[:] = header
    if rest:
        bounce[:rest] = payload[whole:]
        bounce[rest:] = bytes(len(bounce) - rest)
    buffers = [head, payload[:whole], bounce] if whole else [head, bounce]
    buffers = [b for b in buffers if len(b)]
    want = sum(len(b) for b in buffers)
    total = 0
    while total < want:
        total += os.pwritev(fd, _skip(buffers, total), total)
    if round_up(rest) != rest:
        os.ftruncate(fd, HEADER_SIZE + size)


def _skip(buffers: list[memoryview], done: int) -> list[memoryview]:
    """The buffers past their first `done` bytes."""
    if done == 0:
        return buffers
    rest = []
    for buffer in buffers:
        if done >= len(buffer):
            done -= len(buffer)
            continue
        rest.append(buffer[done:])
        done = 0
    return rest
