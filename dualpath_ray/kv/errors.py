"""The errors every block store raises; no torch, so the prefix index can import them cheaply."""

from __future__ import annotations


class BlockNotFoundError(KeyError):
    """No block is stored under this key (a miss)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "block not found"


class BlockCorruptedError(Exception):
    """A stored block failed verification (header or payload checksum, length, key)."""


class IncompatibleBlockError(ValueError):
    """A block was written with another format version or KV layout than this store's."""
