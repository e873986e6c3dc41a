"""Block stores: where Full Blocks persist between turns (paper: "Persistence during decode").

This module is the one import for store users: the contract (BlockStore, validate_key, the
errors; kv/block_store.py), the backends (LocalDirStore, kv/local_store.py; MemoryStore,
kv/memory_store.py) and `open_store`, which picks a backend from the config's store section.
`open_store` reads that section through `StoreSettings`, the fields it needs, so kv/ stays below
config/ (which builds KV layouts from the model section) with no arrow back up.
"""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Literal, Protocol

from dualpath_ray.kv.block_format import FORMAT_VERSION, HEADER_SIZE, BlockHeader
from dualpath_ray.kv.block_store import (
    BlockCorruptedError,
    BlockNotFoundError,
    BlockStore,
    IncompatibleBlockError,
    validate_key,
)
from dualpath_ray.kv.layout import KVLayout
from dualpath_ray.kv.local_store import LocalDirStore
from dualpath_ray.kv.memory_store import InjectedPutError, MemoryStore

__all__ = [
    "FORMAT_VERSION",
    "HEADER_SIZE",
    "BlockCorruptedError",
    "BlockHeader",
    "BlockNotFoundError",
    "BlockStore",
    "IncompatibleBlockError",
    "InjectedPutError",
    "LocalDirStore",
    "MemoryStore",
    "open_store",
    "validate_key",
]


class StoreSettings(Protocol):
    """What `open_store` reads of the config's store section (config/sections.py StoreConfig,
    whose field docs say what each means)."""

    @property
    def backend(self) -> Literal["local_dir", "memory"]: ...
    @property
    def root(self) -> Path | None: ...
    @property
    def block_size(self) -> int: ...
    @property
    def fsync(self) -> bool: ...
    @property
    def io(self) -> Literal["auto", "direct", "buffered"]: ...
    @property
    def read_queue_depth(self) -> int | None: ...


def open_store(cfg: StoreSettings, layout: KVLayout, root: str | Path | None = None) -> BlockStore:
    """The store `cfg` names, at `root` if given (else cfg.root); local_dir with neither gets a
    fresh temporary directory (`.root`). Every process opens its store here, so `cfg.fsync`
    (durable puts), `cfg.io` and `cfg.read_queue_depth` hold for every reader and writer of a
    deployment."""
    if cfg.block_size != layout.block_size:
        raise ValueError(
            f"store.block_size ({cfg.block_size}) differs from the KV layout's block_size "
            f"({layout.block_size}); build the layout with KVLayout.from_model(model, store.block_size)"
        )
    if cfg.backend == "memory":
        return MemoryStore(layout)
    if root is None:
        root = cfg.root if cfg.root is not None else tempfile.mkdtemp(prefix="dualpath-store-")
    read_threads = None if cfg.read_queue_depth is None else cfg.read_queue_depth - 1
    return LocalDirStore(Path(root), layout, fsync=cfg.fsync, read_threads=read_threads, io=cfg.io)
