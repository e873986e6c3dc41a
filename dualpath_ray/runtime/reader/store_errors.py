"""What a storage reader makes of the store's errors: which kind of bad block a failed read
names (or none: then the failure says nothing about the block), and the block writes the store
refused, counted and logged once per run of refusals rather than once per block."""

from __future__ import annotations

import errno
import logging
import threading

from dualpath_ray.kv.errors import BlockCorruptedError, BlockNotFoundError, IncompatibleBlockError

LOG = logging.getLogger("dualpath_ray.reader")

# The errors a file system raises for one file whose bytes it cannot read (a bad sector; a
# checksum failure of the file system itself: ext4's EFSBADCRC is EBADMSG, XFS's and ext4's
# EFSCORRUPTED is EUCLEAN). Such a block is repaired like a corrupt one. Any other OSError (a
# stale or disconnected network mount, no memory) says nothing about the block and stays a
# STORE_IO failure, whose retry reads the block again.
BLOCK_READ_ERRNOS = frozenset({errno.EIO, errno.EBADMSG, errno.EUCLEAN})


def bad_block_kind(error: BaseException) -> str | None:
    """The BadBlockError kind a failed read of one block means, or None if it names no block."""
    if isinstance(error, BlockNotFoundError):
        return "missing"
    if isinstance(error, (BlockCorruptedError, IncompatibleBlockError)):
        # A block of another layout or format version is as unusable as a corrupt one:
        # deleted, unindexed and recomputed, never an INTERNAL failure.
        return "corrupt"
    if isinstance(error, OSError) and error.errno in BLOCK_READ_ERRNOS:
        return "unreadable"
    return None


class WriteRefusals:
    """Block writes the store refused (a full disk, an I/O error, a read-only file system):
    `count` is exported as dualpath_store_write_failures. The first refusal after a write that
    succeeded (or after the start) is logged, with what it costs; the ones after it are only
    counted until a write succeeds again, which is logged too. Thread-safe."""

    def __init__(self, node_id: str) -> None:
        self.node_id = node_id
        self.count = 0
        self._refusing = False
        self._lock = threading.Lock()

    def refused(self, key: str, error: OSError) -> None:
        with self._lock:
            self.count += 1
            first, self._refusing = not self._refusing, True
        if first:
            LOG.warning(
                "node %s: the store refused the write of block %s (%s); a refused block and the blocks "
                "after it in its chain are not published (a later turn misses and recomputes them), "
                "its turn is served all the same; counted in dualpath_store_write_failures, logged "
                "again when writes succeed", self.node_id, key, error,
            )

    def succeeded(self) -> None:
        with self._lock:
            recovered, self._refusing = self._refusing, False
            count = self.count
        if recovered:
            LOG.warning("node %s: the store takes block writes again (%d refused so far)", self.node_id, count)
