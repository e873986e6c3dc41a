"""The errors every block store raises; no torch, so the prefix index can import them cheaply."""

from __future__ import annotations


class BlockNotFoundError(KeyError):
    """No block is stored under this key (a miss)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "block not found"


class BlockCorruptedError(Exception):
    """A stored block failed verification (header or payload checksum, length, key)."""


class BadBlockError(Exception):
    """A read of hit blocks failed at one block: `key` is missing (`kind` "missing"), failed
    verification ("corrupt") or could not be read at all ("unreadable": the file system raised
    an I/O error for it, a bad sector). Raised by the storage readers so the scheduler can
    repair exactly that block (drop it and what follows it from the index, delete a corrupt or
    unreadable file) and retry."""

    KINDS = ("missing", "corrupt", "unreadable")

    def __init__(self, kind: str, key: str, detail: str) -> None:
        if kind not in self.KINDS:
            raise ValueError(f"BadBlockError kind must be one of {self.KINDS}, got {kind!r}")
        super().__init__(kind, key, detail)
        self.kind, self.key, self.detail = kind, key, detail

    def __str__(self) -> str:
        return f"block {self.key} is {self.kind}: {self.detail}"


class IncompatibleBlockError(ValueError):
    """A block was written with another format version or KV layout than this store's."""


class PersistDigestError(Exception):
    """A block on its way to the store differs from the digest of the KV its engine computed
    (runtime.kv_digests): the store publishes nothing under its key (see BlockStore.put)."""
