"""The wire's binary values (protocol/wire.py): numpy arrays, and long sequences of numbers packed
as bytes, as msgpack ext types; and the error every refused payload raises.

Why pack numbers: a turn's output tokens and log-probs are its report's bulk (two sequences per
result, as long as its output). As msgpack arrays every number is an object for the unpacker to
make and for the codec to type-check; as 8-byte little-endian ints or doubles, typed by their ext
code, the receiver makes the tuple in one C call and checks nothing per item (every item of a
packed sequence is an int, or a float, by construction). Short sequences stay msgpack arrays
(the ext's header would cost more than it saves); the decoder takes either.
"""

from __future__ import annotations

import sys
from array import array
from typing import Any

import msgpack
import numpy as np

ARRAY_EXT = 1  # a numpy array: msgpack [dtype name, shape, little-endian C-order bytes]
INTS_EXT = 2  # a sequence of ints, each an 8-byte signed little-endian one
FLOATS_EXT = 3  # a sequence of floats, each an 8-byte IEEE double, little-endian
SMALL_INTS_EXT = 4  # a sequence of ints that all fit 4 bytes (token ids): each a 4-byte signed one
ARRAY_DTYPES = frozenset({
    "bool", "int8", "int16", "int32", "int64", "uint8", "uint16", "uint32", "uint64", "float16", "float32", "float64",
})
MAX_ARRAY_DIMS = 8
PACK_AT_LEAST = 16  # items; shorter sequences go as msgpack arrays
INTS, FLOATS, SMALL_INTS = "q", "d", "i"  # array typecodes: 8-byte signed int, double, 4-byte int
INT_CODES = frozenset({INTS, SMALL_INTS})  # what a sequence declared of ints may arrive as
_EXT_OF = {INTS: INTS_EXT, FLOATS: FLOATS_EXT, SMALL_INTS: SMALL_INTS_EXT}
_CODE_OF = {ext: (typecode, array(typecode).itemsize) for typecode, ext in _EXT_OF.items()}
_SWAP = sys.byteorder != "little"  # array's items are native: swapped on a big-endian host


class WireError(ValueError):
    """A payload that is not a well-formed message of the codec's types."""


def describe(value: Any) -> str:
    """A value's description in an error, short whatever the value."""
    text = repr(value)
    return f"{type(value).__name__} {text[:60]}{'...' if len(text) > 60 else ''}"


def pack_numbers(values: Any, typecode: str) -> Any:
    """`values` (a tuple or list declared of ints or of floats) as an ext of packed numbers, or
    as they are if short, or if an item does not fit (an int beyond 64 bits, a value that is no
    number: the receiver's check then names it). Numbers arrive as the declared type: an
    np.int64 or a bool as an int, an int or an np.float32 among floats as a float (equal values)."""
    if type(values) not in (tuple, list) or len(values) < PACK_AT_LEAST:
        return values
    try:
        packed = array(SMALL_INTS if typecode == INTS else typecode, values)
    except OverflowError:  # an int beyond 4 bytes: all as 8-byte ones
        try:
            packed = array(typecode, values)
        except (TypeError, OverflowError, ValueError):
            return values
    except (TypeError, ValueError):
        return values
    if _SWAP:
        packed.byteswap()
    return msgpack.ExtType(_EXT_OF[packed.typecode], packed.tobytes())


def pack_array(value: np.ndarray) -> msgpack.ExtType:
    if value.dtype.name not in ARRAY_DTYPES or value.ndim > MAX_ARRAY_DIMS:
        raise TypeError(f"an array of {value.dtype} x {value.ndim} dims cannot travel (dtypes: {sorted(ARRAY_DTYPES)})")
    little = np.ascontiguousarray(value, dtype=value.dtype.newbyteorder("<"))
    return msgpack.ExtType(ARRAY_EXT, msgpack.packb((value.dtype.name, value.shape, little.tobytes())))


def unpack_ext(code: int, data: bytes) -> Any:
    """msgpack's hook for an ext value: a numpy array, or an `array` of numbers (typecode of
    INT_CODES or FLOATS: only a sequence declared of them takes it); WireError for anything
    else, before anything of a size it names is allocated."""
    if code in _CODE_OF:
        typecode, size = _CODE_OF[code]
        if len(data) % size:
            raise WireError(f"{len(data)} bytes of {size}-byte numbers")
        numbers = array(typecode)
        numbers.frombytes(data)
        if _SWAP:
            numbers.byteswap()
        return numbers
    if code != ARRAY_EXT:
        raise WireError(f"unknown ext type {code}")
    try:
        header = msgpack.unpackb(data, use_list=False, raw=False, strict_map_key=True)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:
        raise WireError(f"a malformed array: {exc!r}") from None
    if type(header) is not tuple or len(header) != 3:
        raise WireError(f"a malformed array: {describe(header)}")
    dtype_name, shape, raw = header
    if type(dtype_name) is not str or dtype_name not in ARRAY_DTYPES:
        raise WireError(f"an array of dtype {dtype_name!r} is not allowed")
    if type(shape) is not tuple or len(shape) > MAX_ARRAY_DIMS or any(type(n) is not int or n < 0 for n in shape):
        raise WireError(f"an array of shape {describe(shape)}")
    dtype = np.dtype(dtype_name).newbyteorder("<")
    size = 1
    for n in shape:
        size *= n
    if type(raw) is not bytes or len(raw) != size * dtype.itemsize:
        raise WireError(f"an array {shape} of {dtype_name} with {describe(raw)[:20]}... of other length")
    # A copy in native byte order: writable and owning its memory, as the sender's array was.
    return np.frombuffer(raw, dtype=dtype).astype(np.dtype(dtype_name)).reshape(shape)
