"""The bytes of one stored Full Block: a header, then the payload.

Header fields (the first 128 bytes, little-endian): magic, format version, flags, n_layer,
block_size, bytes_per_token_per_layer, dtype, the block's own key, its parent key, payload
length, xxh3_64 of the payload, reserved zeros, and xxh3_64 of everything before it. The header
names the block it belongs to, so a file copied or renamed to another key's path is caught as
corrupted, and it names the layout, so a store never hands a block of one model to another.

Format version 2 (written since direct I/O, kv/direct_io.py) pads the header with zeros to
HEADER_SIZE = 4096 bytes, so the payload starts at an offset O_DIRECT can read from and write to
(the alignment every block device accepts) and lands in a reader's buffer slot with no copy. The
padding must be zeros: a flipped byte anywhere before the payload is caught. Version 1 (a 128-byte
header, the payload at offset 128) is still read (`payload_offset` says where its payload is) but
never written; a put over a version 1 file replaces it with version 2.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from dualpath_ray.kv.block_store import BlockCorruptedError, IncompatibleBlockError
from dualpath_ray.kv.layout import KVLayout

MAGIC = b"DPKVBLK\x00"
FORMAT_VERSION = 2
# Bytes before the payload in a version 2 file: the header fields, then zeros.
HEADER_SIZE = 4096
# The header fields (the checksummed part of the header).
HEADER_FIELDS_SIZE = 128
LEGACY_VERSION = 1
LEGACY_HEADER_SIZE = HEADER_FIELDS_SIZE  # version 1: the payload follows the fields directly
_PADDING = bytes(HEADER_SIZE - HEADER_FIELDS_SIZE)
_HAS_PARENT = 1
_FIELDS = struct.Struct("<8sHHIII16s16s16sQQ")
_CHECKSUM = struct.Struct("<Q")
_RESERVED = HEADER_FIELDS_SIZE - _FIELDS.size - _CHECKSUM.size
# Byte ranges of _FIELDS that the read hot path compares without unpacking.
_VERSION_END = struct.calcsize("<8sH")
_GEOMETRY = slice(struct.calcsize("<8sHH"), struct.calcsize("<8sHHIII16s"))
_KEY = slice(_GEOMETRY.stop, _GEOMETRY.stop + 16)
_LENGTH = slice(struct.calcsize("<8sHHIII16s16s16s"), struct.calcsize("<8sHHIII16s16s16sQ"))
_PAYLOAD_SUM = slice(_LENGTH.stop, _FIELDS.size)
_BODY_END = HEADER_FIELDS_SIZE - _CHECKSUM.size
_LAYOUT_FIELDS = ("n_layer", "block_size", "bytes_per_token_per_layer", "dtype", "payload_length")


def checksum(data: memoryview | bytes | bytearray) -> int:
    return xxhash.xxh3_64_intdigest(data)


@dataclass(frozen=True)
class BlockHeader:
    """What the header of a stored block says about it."""

    key: str
    parent: str | None
    n_layer: int
    block_size: int
    bytes_per_token_per_layer: int
    dtype: str
    payload_length: int
    payload_checksum: int
    # Where the payload starts in the file: HEADER_SIZE, or LEGACY_HEADER_SIZE for version 1.
    payload_offset: int = HEADER_SIZE

    @classmethod
    def for_block(cls, layout: KVLayout, key: str, parent: str | None, payload_checksum: int) -> BlockHeader:
        return cls(
            key=key,
            parent=parent,
            n_layer=layout.n_layer,
            block_size=layout.block_size,
            bytes_per_token_per_layer=layout.bytes_per_token_per_layer,
            dtype=layout.dtype,
            payload_length=layout.full_block_bytes,
            payload_checksum=payload_checksum,
        )


def encode_header(header: BlockHeader) -> bytes:
    """The HEADER_SIZE bytes before a version 2 payload: the fields, their checksum, zeros."""
    parent = bytes.fromhex(header.parent) if header.parent is not None else bytes(16)
    body = _FIELDS.pack(
        MAGIC,
        FORMAT_VERSION,
        _HAS_PARENT if header.parent is not None else 0,
        header.n_layer,
        header.block_size,
        header.bytes_per_token_per_layer,
        header.dtype.encode("ascii").ljust(16, b"\x00"),
        bytes.fromhex(header.key),
        parent,
        header.payload_length,
        header.payload_checksum,
    ) + bytes(_RESERVED)
    return body + _CHECKSUM.pack(checksum(body)) + _PADDING


def decode_header(raw: bytes | bytearray | memoryview, where: str) -> BlockHeader:
    """Parse and verify a header (`raw`: the file's first bytes, HEADER_SIZE of them or all the
    file has); BlockCorruptedError or IncompatibleBlockError if it is bad."""
    if len(raw) < HEADER_FIELDS_SIZE:
        raise BlockCorruptedError(f"{where}: truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
    body = memoryview(raw)[:_BODY_END]
    (stored,) = _CHECKSUM.unpack_from(raw, _BODY_END)
    if checksum(body) != stored:
        raise BlockCorruptedError(f"{where}: header checksum mismatch")
    magic, version, flags, n_layer, block_size, bpt, dtype, key, parent, length, payload_sum = (
        _FIELDS.unpack_from(body)
    )
    if magic != MAGIC:
        raise BlockCorruptedError(f"{where}: not a dualpath block (bad magic {magic!r})")
    if version not in (FORMAT_VERSION, LEGACY_VERSION):
        raise IncompatibleBlockError(
            f"{where}: block format version {version}, this code reads versions {LEGACY_VERSION} and {FORMAT_VERSION}"
        )
    if version == FORMAT_VERSION:
        if len(raw) < HEADER_SIZE:
            raise BlockCorruptedError(f"{where}: truncated header ({len(raw)} of {HEADER_SIZE} bytes)")
        if raw[HEADER_FIELDS_SIZE:HEADER_SIZE] != _PADDING:
            raise BlockCorruptedError(f"{where}: header padding is not zeros")
    return BlockHeader(
        key=key.hex(),
        parent=parent.hex() if flags & _HAS_PARENT else None,
        n_layer=n_layer,
        block_size=block_size,
        bytes_per_token_per_layer=bpt,
        dtype=dtype.rstrip(b"\x00").decode("ascii", errors="replace"),
        payload_length=length,
        payload_checksum=payload_sum,
        payload_offset=HEADER_SIZE if version == FORMAT_VERSION else LEGACY_HEADER_SIZE,
    )


def check_header(header: BlockHeader, layout: KVLayout, key: str, where: str) -> None:
    """Raise unless `header` describes block `key` stored in `layout`."""
    expected = BlockHeader.for_block(layout, key, header.parent, header.payload_checksum)
    mismatched = [
        f"{name}={getattr(header, name)!r} (store: {getattr(expected, name)!r})"
        for name in _LAYOUT_FIELDS
        if getattr(header, name) != getattr(expected, name)
    ]
    if mismatched:
        raise IncompatibleBlockError(
            f"{where}: block written with another KV layout: {', '.join(mismatched)}; "
            "open the store with the layout of the model that wrote it"
        )
    if header.key != key:
        raise BlockCorruptedError(f"{where}: header names block {header.key}, not {key}")


def verify_payload(payload: memoryview | bytes, expected_checksum: int, where: str) -> None:
    if checksum(payload) != expected_checksum:
        raise BlockCorruptedError(f"{where}: payload checksum mismatch")


class HeaderVerifier:
    """The read hot path: checks a raw header against one layout with byte comparisons.

    Equivalent to decode_header + check_header (which it defers to, to name the fault, whenever
    a comparison fails, and to read a version 1 header), without building objects on every read.
    """

    def __init__(self, layout: KVLayout) -> None:
        self.layout = layout
        self._fixed = MAGIC + FORMAT_VERSION.to_bytes(2, "little")
        self._geometry = struct.pack(
            "<III16s",
            layout.n_layer,
            layout.block_size,
            layout.bytes_per_token_per_layer,
            layout.dtype.encode("ascii"),
        )
        self._length = layout.full_block_bytes.to_bytes(8, "little")

    def payload_checksum(self, raw: bytearray | bytes | memoryview, key: str, where: str) -> tuple[int, int]:
        """(payload checksum, payload offset) of a valid header of block `key` (`raw`: the file's
        first HEADER_SIZE bytes, or all of a shorter file); raises if it is not valid."""
        if (
            len(raw) == HEADER_SIZE
            and checksum(memoryview(raw)[:_BODY_END]) == int.from_bytes(raw[_BODY_END:HEADER_FIELDS_SIZE], "little")
            and raw[:_VERSION_END] == self._fixed
            and raw[_GEOMETRY] == self._geometry
            and raw[_KEY] == bytes.fromhex(key)
            and raw[_LENGTH] == self._length
            and raw[HEADER_FIELDS_SIZE:] == _PADDING
        ):
            return int.from_bytes(raw[_PAYLOAD_SUM], "little"), HEADER_SIZE
        header = decode_header(raw, where)
        check_header(header, self.layout, key, where)
        if header.payload_offset == LEGACY_HEADER_SIZE:
            return header.payload_checksum, LEGACY_HEADER_SIZE
        raise BlockCorruptedError(f"{where}: header does not match its layout fields")
