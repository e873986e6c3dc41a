"""A typed wire encoding of the protocol's messages: msgpack, never pickle.

What crosses a socket between processes (runtime/reporting/channel.py) must not be able to
name a class or a function to call: a pickle can, so a forged one is code execution in the
receiver. A `Codec` instead knows a closed set of types, found once by walking the field type
hints of its root messages (every dataclass, NamedTuple and enum reachable from them), so a field
added to a message, or a member to an enum, needs no change here; decoding builds only those
types, checking every value against its field's declared type on the way.

Encoding, on top of msgpack's own nil / bool / int / float / str / bin / array / map:
  dataclass    array [tag, field 1, field 2, ...] in field order; tag: its class name
  NamedTuple   array [field 1, ...]: its field's declared type says which (a union may not hold
               two kinds of array, so the declared type always decides)
  tuple, list  array, decoded as the declared type (tuple[int, ...], tuple[str, int], list[X])
  dict         map; keys str or bytes only
  enum member  its value, decoded as the declared enum: a value that is no member is refused
  np.ndarray   ext (protocol/wire_ext.py): dtype of an allow-list, shape, little-endian bytes;
               decoded only if the bytes are exactly what the shape needs
  a sequence   declared of ints or of floats, 16 items or more: ext of packed numbers
               (wire_ext.py), made back into a tuple (or list) of them in one call
  numpy scalar (an np.int64 token, an np.float32 log-prob) its Python int / float / bool

Decoding refuses (WireError, naming the path to the bad value) anything else: an unknown tag, a
struct of the wrong type or arity, a value of another type than its field declares (an int is
accepted where a float is declared, as Python's numeric tower does, and kept as it came), trailing
bytes, a msgpack timestamp or another ext type. Sender and receiver run the same code (one
deployment), so a struct is positional: its arity is checked, its field names are not sent.
"""

from __future__ import annotations

import dataclasses
import enum
import operator
import types
import typing
from array import array
from typing import Any, Callable

import msgpack
import numpy as np

from dualpath_ray.protocol.wire_ext import (
    FLOATS, INT_CODES, INTS, WireError, describe, pack_array, pack_numbers, unpack_ext,
)

Decoder = Callable[[Any], Any]

# What msgpack hands back for a declared primitive (an int is a float's value too: 0 for 0.0).
PRIMITIVES: dict[Any, frozenset[type]] = {
    int: frozenset({int}), float: frozenset({float, int}), bool: frozenset({bool}), str: frozenset({str}),
    bytes: frozenset({bytes}), type(None): frozenset({type(None)}), np.ndarray: frozenset({np.ndarray}),
}


class Codec:
    """Encodes messages of `roots` (and every type their fields reach) to bytes and back.
    `encode` and `decode` keep no state between calls: any thread may call them."""

    def __init__(self, roots: tuple[type, ...]) -> None:
        for root in roots:
            if not dataclasses.is_dataclass(root):
                raise TypeError(f"a codec's roots are dataclasses (tagged on the wire), not {_name(root)}")
        self.roots = frozenset(roots)
        self.types: dict[str, type] = {}  # tag -> dataclass, every one reachable from the roots
        self.named_tuples: set[type] = set()
        self.enums: set[type] = set()
        # A dataclass's tag and field getter (msgpack packs tuples, NamedTuples and str / int
        # enums itself; `_default` is called for the rest).
        self._getters: dict[type, tuple[str, Callable[[Any], tuple[Any, ...]]]] = {}
        self._decoders: dict[Any, Decoder] = {}
        self._root = self._decoder(typing.Union[roots] if len(roots) > 1 else roots[0])

    # --- encoding -------------------------------------------------------------------------

    def encode(self, message: Any) -> bytes:
        """`message`'s bytes; TypeError if it is no root or holds a value of no registered type."""
        if type(message) not in self.roots:
            raise TypeError(f"{type(message).__name__} is not one of this codec's messages")
        return msgpack.packb(message, default=self._default, use_bin_type=True)

    def _default(self, value: Any) -> Any:
        getter = self._getters.get(type(value))
        if getter is not None:
            tag, fields = getter
            return (tag, *fields(value))
        if isinstance(value, np.ndarray):
            return pack_array(value)
        if isinstance(value, (np.integer, np.floating, np.bool_)):
            return value.item()
        if type(value) in self.enums:
            return value.value
        raise TypeError(f"{type(value).__name__} is not a registered protocol type")

    # --- decoding -------------------------------------------------------------------------

    def decode(self, payload: bytes | bytearray | memoryview) -> Any:
        """The message `payload` encodes; WireError if it is not exactly one well-formed message."""
        try:
            raw = msgpack.unpackb(payload, use_list=False, raw=False, strict_map_key=True, ext_hook=unpack_ext)
        except WireError:
            raise
        except (ValueError, TypeError, msgpack.UnpackException) as exc:
            raise WireError(f"not a msgpack message: {exc!r}") from None
        return self._root(raw)

    def _decoder(self, hint: Any) -> Decoder:
        """The decoder of values declared `hint`, built once per hint (registering what it reaches)."""
        known = self._decoders.get(hint)
        if known is not None:
            return known
        # A placeholder first: a type that reaches itself (a tree of messages) ends the walk here.
        slot: list[Decoder] = []
        self._decoders[hint] = lambda value: slot[0](value)
        built = self._build(hint)
        slot.append(built)
        self._decoders[hint] = built
        return built

    def _build(self, hint: Any) -> Decoder:
        origin, args = typing.get_origin(hint), typing.get_args(hint)
        if origin in (typing.Union, types.UnionType):
            return self._union(args)
        if origin is tuple and len(args) == 2 and args[1] is Ellipsis:
            return _sequence(self._decoder(args[0]), _leaf_types(args[0]), tuple)
        if origin is tuple:
            return _fixed(tuple(self._decoder(arg) for arg in args))
        if origin is list and args:
            return _sequence(self._decoder(args[0]), _leaf_types(args[0]), list)
        if origin is dict and args:
            return _mapping(self._decoder(args[0]), self._decoder(args[1]))
        if hint in PRIMITIVES:
            return _leaf(PRIMITIVES[hint], _name(hint))
        if isinstance(hint, type) and issubclass(hint, enum.Enum):
            self.enums.add(hint)
            return _enum(hint)
        if dataclasses.is_dataclass(hint):
            return self._dataclass(hint)  # type: ignore[arg-type]
        if _is_named_tuple(hint):
            self.named_tuples.add(hint)
            return self._struct(hint, hint._fields, tagged=False, bypass_init=False)
        raise TypeError(f"{_name(hint)} cannot travel on the wire (annotate what a container holds)")

    def _dataclass(self, cls: type) -> Decoder:
        tag = cls.__name__
        if self.types.setdefault(tag, cls) is not cls:
            raise TypeError(f"two protocol types are named {tag}: tags must be unique")
        fields = dataclasses.fields(cls)
        if any(not f.init for f in fields):
            raise TypeError(f"{tag}: a field outside __init__ cannot be rebuilt from the wire")
        names = tuple(f.name for f in fields)
        self._getters[cls] = (tag, _getter(names, _hints(cls)))
        # As pickle rebuilds it: every field set, __init__ (which only sets them, frozen or not)
        # skipped: a third of a report's decoding time. A class that checks its fields in
        # __post_init__ is built through __init__, so its checks run.
        bypass_init = not hasattr(cls, "__post_init__") and not hasattr(cls, "__slots__")
        return self._struct(cls, names, tagged=True, bypass_init=bypass_init)

    def _struct(self, cls: type, names: tuple[str, ...], tagged: bool, bypass_init: bool) -> Decoder:
        hints = _hints(cls)
        tag, head = cls.__name__, int(tagged)
        arity = len(names) + head
        # Fields whose value is kept as it came (str, int, float, None, their unions) are checked
        # all at once at C speed; the others (structs, enums, containers) go through decoders.
        leaves = [(i, _leaf_types(hints[name])) for i, name in enumerate(names)]
        leaf_at = tuple(i for i, kinds in leaves if kinds is not None)
        leaf_kinds = tuple(kinds for _, kinds in leaves if kinds is not None)
        convert = tuple((i, self._decoder(hints[names[i]])) for i, kinds in leaves if kinds is None)
        leaf_values = _picker(leaf_at) if convert else None  # None: every field is a leaf
        contains, new = frozenset.__contains__, object.__new__

        def decode(value: Any) -> Any:
            if type(value) is not tuple or len(value) != arity or (tagged and value[0] != tag):
                raise WireError(f"expected {tag} ({len(names)} fields), got {describe(value)}")
            fields = value[head:] if head else value
            if not all(map(contains, leaf_kinds, map(type, leaf_values(fields) if leaf_values else fields))):
                at = next(i for i, k in zip(leaf_at, leaf_kinds) if type(fields[i]) not in k)
                raise WireError(f"{tag}.{names[at]}: expected {hints[names[at]]}, got {describe(fields[at])}")
            if convert:
                fields = list(fields)
                for i, decode_field in convert:
                    try:
                        fields[i] = decode_field(fields[i])
                    except WireError as exc:
                        raise WireError(f"{tag}.{names[i]}: {exc}") from None
            if bypass_init:
                obj = new(cls)
                obj.__dict__.update(zip(names, fields))
                return obj
            try:
                return cls(*fields)
            except (TypeError, ValueError) as exc:
                raise WireError(f"{tag}: {exc}") from None

        return decode

    def _union(self, members: tuple[Any, ...]) -> Decoder:
        kinds = _leaf_types(typing.Union[members])
        if kinds is not None:
            return _leaf(kinds, " | ".join(map(_name, members)))
        # One member per kind of msgpack value; dataclasses are arrays too, told apart by their
        # tags, so they exclude a tuple or NamedTuple member but not each other.
        seen: dict[str, Any] = {}
        for member in members:
            for kind in _wire_kinds(member):
                clash = seen.get(kind) or (seen.get("array") if kind.startswith("struct:") else None)
                if clash is None and kind == "array":
                    clash = next((m for k, m in seen.items() if k.startswith("struct:")), None)
                if clash is not None:
                    raise TypeError(f"{_name(member)} and {_name(clash)} look alike on the wire: no union of them")
                seen[kind] = member
        optional = type(None) in members
        decoders = tuple(self._decoder(m) for m in members if m is not type(None))
        # Dataclasses carry their tag: the member is known before anything is decoded.
        tagged = {m.__name__: self._decoder(m) for m in members if dataclasses.is_dataclass(m)}

        def decode(value: Any) -> Any:
            if value is None and optional:
                return None
            if type(value) is tuple and value and type(value[0]) is str and value[0] in tagged:
                return tagged[value[0]](value)
            for decode_member in decoders:
                try:
                    return decode_member(value)
                except WireError:
                    continue
            raise WireError(f"expected {' | '.join(map(_name, members))}, got {describe(value)}")

        return decode


# --- pieces -------------------------------------------------------------------------------


def _is_named_tuple(cls: Any) -> bool:
    return isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")


def _name(hint: Any) -> str:
    return getattr(hint, "__name__", None) or repr(hint)


def _hints(cls: type) -> dict[str, Any]:
    try:
        return typing.get_type_hints(cls)
    except NameError as exc:
        raise TypeError(f"{cls.__name__}: a field's type is not importable at run time ({exc})") from None


def _leaf_types(hint: Any) -> frozenset[type] | None:
    """The types a value declared `hint` may arrive as when it is kept as it came; None when it
    must be decoded (a struct, an enum, a container)."""
    if hint in PRIMITIVES:
        return PRIMITIVES[hint]
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        parts = [_leaf_types(arg) for arg in typing.get_args(hint)]
        if all(part is not None for part in parts):
            return frozenset().union(*parts)  # type: ignore[arg-type]
    return None


def _wire_kinds(hint: Any) -> tuple[str, ...]:
    """What a value of `hint` looks like after msgpack: a union may not hold two of a kind."""
    origin = typing.get_origin(hint) or hint
    if origin in PRIMITIVES:
        return tuple(t.__name__ for t in PRIMITIVES[origin])
    if isinstance(origin, type) and issubclass(origin, enum.Enum):
        return tuple({type(m.value).__name__ for m in origin})
    if dataclasses.is_dataclass(origin):
        return (f"struct:{origin.__name__}",)
    if origin in (tuple, list) or _is_named_tuple(origin):
        return ("array",)
    return ("map",) if origin is dict else (repr(hint),)


def _packed_as(leaf: frozenset[type] | None) -> frozenset[str]:
    """The array typecodes a sequence of `leaf` items may travel packed as (wire_ext.py)."""
    return INT_CODES if leaf == PRIMITIVES[int] else frozenset({FLOATS}) if leaf == PRIMITIVES[float] else frozenset()


def _getter(names: tuple[str, ...], hints: dict[str, Any]) -> Callable[[Any], tuple[Any, ...]]:
    """A dataclass's fields in order, sequences of numbers packed (wire_ext.py)."""
    fields = operator.attrgetter(*names) if len(names) > 1 else lambda obj: tuple(getattr(obj, n) for n in names)
    packed = []
    for i, name in enumerate(names):
        origin, args = typing.get_origin(hints[name]), typing.get_args(hints[name])
        item = args[0] if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis) else None
        if item in (int, float):
            packed.append((i, INTS if item is int else FLOATS))
    if not packed:
        return fields  # type: ignore[return-value]

    def get(obj: Any) -> tuple[Any, ...]:
        values = list(fields(obj))
        for i, typecode in packed:
            values[i] = pack_numbers(values[i], typecode)
        return tuple(values)

    return get


def _picker(indices: tuple[int, ...]) -> Callable[[tuple[Any, ...]], tuple[Any, ...]]:
    if len(indices) > 1:
        return operator.itemgetter(*indices)
    return lambda value: tuple(value[i] for i in indices)


def _leaf(kinds: frozenset[type], what: str) -> Decoder:
    def decode(value: Any) -> Any:
        if type(value) not in kinds:
            raise WireError(f"expected {what}, got {describe(value)}")
        return value

    return decode


def _enum(cls: type[enum.Enum]) -> Decoder:
    members = {(type(m.value), m.value): m for m in cls}

    def decode(value: Any) -> Any:
        try:
            return members[(type(value), value)]
        except (KeyError, TypeError):
            raise WireError(f"{describe(value)} is no {cls.__name__}") from None

    return decode


def _sequence(decode_item: Decoder, leaf: frozenset[type] | None, container: type) -> Decoder:
    packed = _packed_as(leaf)

    def decode(value: Any) -> Any:
        if type(value) is not tuple:
            if type(value) is array and value.typecode in packed:
                return container(value)  # numbers packed as bytes (wire_ext.py): ints, or floats, all
            raise WireError(f"expected a sequence, got {describe(value)}")
        if leaf is not None:
            # The common case (tokens, log-probs, keys): checked at C speed, kept as it came.
            if not set(map(type, value)) <= leaf:
                at = next(i for i, item in enumerate(value) if type(item) not in leaf)
                raise WireError(f"[{at}]: {describe(value[at])} where {' | '.join(t.__name__ for t in leaf)} belongs")
            return value if container is tuple else list(value)
        try:
            return container(map(decode_item, value))
        except WireError:
            for at, item in enumerate(value):  # where it failed, for the message (the error path only)
                try:
                    decode_item(item)
                except WireError as exc:
                    raise WireError(f"[{at}]: {exc}") from None
            raise

    return decode


def _fixed(decoders: tuple[Decoder, ...]) -> Decoder:
    def decode(value: Any) -> Any:
        if type(value) is not tuple or len(value) != len(decoders):
            raise WireError(f"expected a tuple of {len(decoders)}, got {describe(value)}")
        return tuple(d(v) for d, v in zip(decoders, value))

    return decode


def _mapping(decode_key: Decoder, decode_item: Decoder) -> Decoder:
    def decode(value: Any) -> Any:
        if type(value) is not dict:
            raise WireError(f"expected a map, got {describe(value)}")
        out = {}
        for key, item in value.items():
            try:
                out[decode_key(key)] = decode_item(item)
            except WireError as exc:
                raise WireError(f"[{key!r}]: {exc}") from None
        return out

    return decode

