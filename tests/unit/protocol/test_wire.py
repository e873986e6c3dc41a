"""The typed wire encoding (protocol/wire.py): every message round-trips as itself, types
included, whatever fields it has; anything else is refused with a clear error and never built."""

from __future__ import annotations

import dataclasses
import enum
import inspect
import itertools
import pickle
import types
import typing
from dataclasses import dataclass
from typing import Any, Iterator, NamedTuple

import msgpack
import numpy as np
import pytest

from dualpath_ray.protocol import messages
from dualpath_ray.protocol.messages import (
    EngineReport, ErrorKind, GroupReport, Holding, PersistedBlock, ReaderReport, TokenChunk, TurnResult,
)
from dualpath_ray.protocol.wire import Codec, WireError
from dualpath_ray.protocol.wire_ext import ARRAY_EXT, FLOATS_EXT, INTS_EXT, SMALL_INTS_EXT
from dualpath_ray.protocol.types import ReadPath, StopReason

REPORTS = (EngineReport, ReaderReport)


# --- values with every field set, built from the type hints (so new fields are covered too) ---


def populated(hint: Any, counter: Iterator[int], depth: int = 0) -> Any:
    """A value of `hint` unlike any default: every number distinct, enums their last member,
    optional fields set (but for a type nesting itself, below a few levels), containers of two."""
    n = next(counter)
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin in (typing.Union, types.UnionType):
        if type(None) in args and depth > 4:
            return None
        return populated(next(a for a in args if a is not type(None)), counter, depth + 1)
    if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
        return (populated(args[0], counter, depth + 1), populated(args[0], counter, depth + 1))
    if origin is tuple:
        return tuple(populated(a, counter, depth + 1) for a in args)
    if origin is list:
        return [populated(args[0], counter, depth + 1), populated(args[0], counter, depth + 1)]
    if origin is dict:
        return {populated(args[0], counter, depth + 1): populated(args[1], counter, depth + 1)}
    if hint is bool:
        return True
    if hint is int:
        return 1000 + n
    if hint is float:
        return n + 0.25
    if hint is str:
        return f"s{n}"
    if hint is bytes:
        return bytes([n % 256]) * 3
    if hint is np.ndarray:
        return np.arange(6, dtype=np.float32).reshape(2, 3) + n
    if isinstance(hint, type) and issubclass(hint, enum.Enum):
        return list(hint)[-1]
    hints = typing.get_type_hints(hint)
    if dataclasses.is_dataclass(hint):
        defaults = {f.name: f.default for f in dataclasses.fields(hint)}
    else:
        defaults = {name: hint._field_defaults.get(name) for name in hint._fields}
    values = {name: populated(hints[name], counter, depth + 1) for name in defaults}
    # A bool unlike its default (True for a field defaulting to False, and the other way round).
    values.update({name: not default for name, default in defaults.items() if type(default) is bool})
    return hint(**values)


def same(a: Any, b: Any) -> bool:
    """Equal, and of the same types all the way down (a NamedTuple is not a tuple, an enum member
    not its value, an array equal in dtype, shape and content)."""
    if type(a) is not type(b):
        return False
    if isinstance(a, np.ndarray):
        return a.dtype == b.dtype and a.shape == b.shape and bool(np.array_equal(a, b))
    if dataclasses.is_dataclass(a):
        return all(same(getattr(a, f.name), getattr(b, f.name)) for f in dataclasses.fields(a))
    if isinstance(a, (tuple, list)):
        return len(a) == len(b) and all(same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return bool(a == b)


def assert_no_default(value: Any) -> None:
    for f in dataclasses.fields(value):
        default = f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default
        assert default is dataclasses.MISSING or not same(getattr(value, f.name), default), (
            f"{type(value).__name__}.{f.name} is populated with a value unlike its default"
        )


def resolvable_messages() -> list[type]:
    """Every protocol dataclass whose field types resolve at run time (GroupReport's EngineLoad
    is imported for type checking only: it never travels)."""
    found = []
    for _, cls in inspect.getmembers(messages, inspect.isclass):
        if dataclasses.is_dataclass(cls) and cls.__module__ == messages.__name__ and cls is not GroupReport:
            found.append(cls)
    return found


def test_every_type_the_report_codec_carries_round_trips_with_every_field_set():
    codec = Codec(REPORTS)
    assert set(REPORTS) <= set(codec.types.values()) and Holding in codec.named_tuples, "the walk found the types"
    for cls in codec.types.values():
        value = populated(cls, itertools.count(1))
        assert_no_default(value)
        assert same(Codec((cls,)).decode(Codec((cls,)).encode(value)), value), f"{cls.__name__} round-trips as itself"
    for root in REPORTS:
        value = populated(root, itertools.count(1))
        assert same(codec.decode(codec.encode(value)), value), f"{root.__name__} round-trips on the report codec"


@pytest.mark.parametrize("cls", resolvable_messages(), ids=lambda c: c.__name__)
def test_every_protocol_message_round_trips_arrays_included(cls):
    value = populated(cls, itertools.count(1))
    assert_no_default(value)
    codec = Codec((cls,))
    assert same(codec.decode(codec.encode(value)), value), f"{cls.__name__} round-trips with its arrays and enums"


def test_a_report_of_a_real_decode_step_round_trips():
    result = TurnResult(
        "r1", 2, (5, 6, 7), (-0.5, -1.0, -0.25), StopReason.STOP, 10, 4, ReadPath.SPLIT, "prefill/p0/g0",
        "decode/d0/g0", 0.1, 0.01, 5, 1, (PersistedBlock("k1", None), PersistedBlock("k2", "k1")), "boom",
        ErrorKind.KV_CORRUPT, ("k1",), 7,
    )
    report = EngineReport("decode/d0/g0", "inc", {"r1": Holding(2, True, 7)}, (result,),
                          (TokenChunk("r1", 2, 7, 0, (5, 6), (-0.5, -1.0)),))
    codec = Codec(REPORTS)
    assert same(codec.decode(codec.encode(report)), report), "a decode step's report round-trips exactly"


@dataclass(frozen=True)
class Extended:
    """A message as a later version might have it: fields of shapes the protocol does not use yet."""

    name: str
    by_request: dict[str, tuple[Holding, ...]]
    kinds: list[ErrorKind]
    pair: tuple[str, int]
    maybe: float | None = None
    blocks: tuple[PersistedBlock, ...] = ()
    raw: bytes = b""
    weights: np.ndarray | None = None
    nested: Extended | None = None


def test_new_fields_and_types_need_no_codec_change():
    value = populated(Extended, itertools.count(1))
    assert value.nested is not None, "it nests itself"
    codec = Codec((Extended,))
    assert same(codec.decode(codec.encode(value)), value), "a message with new fields round-trips, self-nesting too"


def test_numpy_scalars_travel_as_python_numbers():
    chunk = TokenChunk("r", np.int64(1), 0, np.int32(3), (np.int64(5), 6), (np.float32(-0.5), -1.0))
    report = EngineReport("e", "i", chunks=(chunk,))
    decoded = Codec(REPORTS).decode(Codec(REPORTS).encode(report))
    assert decoded == report, "values are kept"
    assert {type(x) for x in (*decoded.chunks[0].tokens, decoded.chunks[0].start)} == {int}, "as Python ints"
    assert {type(x) for x in decoded.chunks[0].log_probs} == {float}, "as Python floats"


@pytest.mark.parametrize("first_token, int_bytes", [(150_000, 4), (2**40, 8)])
def test_long_number_sequences_travel_packed_and_come_back_as_python_numbers(first_token, int_bytes):
    tokens = tuple(range(first_token, first_token + 300))
    log_probs = tuple(-0.001 * i for i in range(300))
    chunk = TokenChunk("r", 1, 0, 3, tokens[:-1] + (np.int64(7),), log_probs[:-1] + (np.float32(-0.5),))
    codec = Codec(REPORTS)
    payload = codec.encode(EngineReport("e", "i", chunks=(chunk,)))
    assert len(payload) < 300 * (int_bytes + 8) + 64, (
        f"packed as {int_bytes}-byte ints (4 where all fit) and 8-byte doubles, a few bytes of header"
    )
    decoded = codec.decode(payload).chunks[0]
    assert decoded == chunk, "the values are kept exactly"
    assert {type(x) for x in decoded.tokens} == {int} and {type(x) for x in decoded.log_probs} == {float}, (
        "as Python ints and floats, whatever numpy type the sender had"
    )
    huge = dataclasses.replace(chunk, tokens=(2**70,) * 20)
    with pytest.raises((TypeError, OverflowError)):
        codec.encode(EngineReport("e", "i", chunks=(huge,)))  # msgpack's ints end at 64 bits: refused at the sender


# --- what decoding refuses --------------------------------------------------------------


def raw(cls: type, **changes: Any) -> tuple[Any, ...]:
    """A populated `cls` as msgpack hands it to the codec, the named fields replaced by raw
    values (whatever fields the message has by now)."""
    fields = msgpack.unpackb(Codec((cls,)).encode(populated(cls, itertools.count(1))), use_list=False)
    names = [f.name for f in dataclasses.fields(cls)]
    assert set(changes) <= set(names), f"{cls.__name__} has fields {names}"
    return (fields[0], *(changes.get(name, item) for name, item in zip(names, fields[1:])))


def reader_fields(**changes: Any) -> tuple[Any, ...]:
    return raw(ReaderReport, **changes)


def turn_result(**changes: Any) -> tuple[Any, ...]:
    return raw(TurnResult, **changes)


def engine_report(results: tuple[Any, ...] = (), handed_off: Any = None) -> tuple[Any, ...]:
    return raw(EngineReport, handed_off={} if handed_off is None else handed_off, results=results, chunks=())


def packed(value: Any) -> bytes:
    return msgpack.packb(value, use_bin_type=True)


def deep(n: int) -> bytes:
    return b"\x91" * n + b"\x00"  # n nested one-element arrays


HOSTILE = {
    "a pickle": (pickle.dumps(ReaderReport("n", "r", "i", 1)), "not a msgpack message"),
    "an unknown tag": (packed(("Popen", "rm -rf /")), "expected EngineReport | ReaderReport"),
    "a registered type that is no message": (packed(turn_result()), "expected EngineReport | ReaderReport"),
    "a struct of the wrong arity": (packed(reader_fields()[:-1]), "expected ReaderReport ("),
    "a str for an int": (packed(reader_fields(read_q_tokens="12")), "ReaderReport.read_q_tokens"),
    "a bool for an int": (packed(reader_fields(read_q_tokens=True)), "ReaderReport.read_q_tokens"),
    "a float for an int": (packed(reader_fields(read_q_tokens=1.5)), "ReaderReport.read_q_tokens"),
    "None for a str": (packed(reader_fields(node_id=None)), "ReaderReport.node_id"),
    "a value that is no member": (packed(engine_report((turn_result(stop_reason="exploded"),))),
                                  "EngineReport.results: [0]: TurnResult.stop_reason"),
    "a member of another enum": (packed(engine_report((turn_result(error_kind="pe"),))), "TurnResult.error_kind"),
    "another struct where one is declared": (packed(engine_report((reader_fields(),))), "expected TurnResult"),
    "a str among int tokens": (packed(engine_report((turn_result(output_tokens=(1, "2")),))),
                               "TurnResult.output_tokens: [1]"),
    "a map with int keys": (packed(engine_report(handed_off={1: (1, True, 0)})), "not a msgpack message"),
    "a NamedTuple of the wrong arity": (packed(engine_report(handed_off={"r": (1, True)})), "expected Holding"),
    "trailing bytes": (packed(reader_fields()) + b"\x00", "not a msgpack message"),
    "a cut message": (packed(reader_fields())[:-1], "not a msgpack message"),
    "a timestamp": (packed(reader_fields(read_q_tokens=msgpack.Timestamp(1, 0))), "ReaderReport.read_q_tokens"),
    "an unknown ext type": (packed(reader_fields(read_q_tokens=msgpack.ExtType(5, b"x"))), "unknown ext type 5"),
    "an array for an int": (
        packed(reader_fields(read_q_tokens=msgpack.ExtType(ARRAY_EXT, packed(("int64", (1,), bytes(8)))))),
        "ReaderReport.read_q_tokens",
    ),
    "a nesting too deep": (deep(100_000), "not a msgpack message"),
    "packed numbers of a cut length": (
        packed(engine_report((turn_result(output_tokens=msgpack.ExtType(INTS_EXT, bytes(12))),))), "12 bytes",
    ),
    "packed small ints of a cut length": (
        packed(engine_report((turn_result(output_tokens=msgpack.ExtType(SMALL_INTS_EXT, bytes(6))),))), "6 bytes",
    ),
    "packed floats where ints are declared": (
        packed(engine_report((turn_result(output_tokens=msgpack.ExtType(FLOATS_EXT, bytes(16))),))),
        "TurnResult.output_tokens",
    ),
    "packed ints where strs are declared": (
        packed(engine_report((turn_result(bad_keys=msgpack.ExtType(INTS_EXT, bytes(16))),))), "TurnResult.bad_keys",
    ),
    "packed ints for an int": (packed(reader_fields(read_q_tokens=msgpack.ExtType(INTS_EXT, bytes(8)))),
                               "ReaderReport.read_q_tokens"),
    "nothing": (b"", "not a msgpack message"),
}


@pytest.mark.parametrize("name", list(HOSTILE))
def test_decoding_refuses_anything_but_a_well_formed_message(name):
    payload, says = HOSTILE[name]
    with pytest.raises(WireError) as refused:
        Codec(REPORTS).decode(payload)
    assert says in str(refused.value), f"{name}: the error names what is wrong ({refused.value})"


@dataclass(frozen=True)
class Weights:
    values: np.ndarray


@pytest.mark.parametrize("header, says", [
    (("object", (1,), bytes(8)), "dtype 'object'"),
    (("complex128", (1,), bytes(16)), "dtype 'complex128'"),
    (("float32", (2, 2), bytes(12)), "of other length"),  # 4 floats need 16 bytes
    (("float32", (-1,), b""), "shape"),
    (("float32", (1,) * 9, bytes(4)), "shape"),
    (("float32", (2**62, 2**62), bytes(4)), "of other length"),  # checked before any allocation
    (("float32", (1,)), "malformed array"),
])
def test_an_array_is_decoded_only_from_an_allowed_dtype_and_matching_bytes(header, says):
    payload = packed(("Weights", msgpack.ExtType(ARRAY_EXT, packed(header))))
    with pytest.raises(WireError) as refused:
        Codec((Weights,)).decode(payload)
    assert says in str(refused.value), f"the error says what is wrong with the array ({refused.value})"


def test_encoding_refuses_what_the_codec_does_not_know():
    codec = Codec(REPORTS)
    with pytest.raises(TypeError):
        codec.encode(populated(TurnResult, itertools.count(1)))  # registered, but not a message of this codec
    with pytest.raises(TypeError):
        codec.encode(ReaderReport("n", "r", object(), 1))  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        Codec((Weights,)).encode(Weights(np.array(["text"], dtype=object)))


class Point(NamedTuple):
    x: int


@dataclass(frozen=True)
class Loose:
    anything: Any


@dataclass(frozen=True)
class Ambiguous:
    either: tuple[int, ...] | Point


@dataclass(frozen=True)
class Untyped:
    items: tuple


@pytest.mark.parametrize("cls", [Loose, Ambiguous, Untyped, GroupReport], ids=lambda c: c.__name__)
def test_a_type_that_could_not_be_decoded_safely_is_refused_when_the_codec_is_built(cls):
    """Any (would decode whatever came), a union of look-alikes, a container without its item
    type, a field type not importable at run time."""
    with pytest.raises(TypeError):
        Codec((cls,))


def test_nothing_but_registered_types_is_built():
    """A struct tagged with the name of a class the codec does not know is refused before any
    lookup by name could happen."""
    payload = packed(engine_report(results=(("Planted", "x"),)))
    with pytest.raises(WireError) as refused:
        Codec(REPORTS).decode(payload)
    assert "expected TurnResult" in str(refused.value), "the unknown tag is refused where a TurnResult is declared"


def test_field_order_is_the_dataclass_order():
    """Positional structs: the encoding follows dataclasses.fields, so a field added anywhere is
    placed the same way on both sides."""
    value = populated(ReaderReport, itertools.count(1))
    raw_value = msgpack.unpackb(Codec(REPORTS).encode(value), use_list=False)
    expected = ("ReaderReport", *(getattr(value, f.name) for f in dataclasses.fields(ReaderReport)))
    assert raw_value == expected, "tag, then the fields in declaration order"
