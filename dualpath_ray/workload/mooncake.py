"""Import of the public Mooncake (FAST'25) request traces as one-turn trajectories.

A Mooncake line is a JSON object: `timestamp` (ms), `input_length`, `output_length` and
`hash_ids`, one id per 512-token block of the input, where equal leading ids mean an equal token
prefix. We give every block real token ids such that two requests share exactly the token
prefix their common leading hash ids imply (512 tokens per id, the last block cut to
input_length) and nothing more:

* The block at position j of a request is named by its chain c_j = BLAKE2b(c_{j-1} || id_j),
  so equal chains mean equal leading ids; its 512 tokens are `expand_tokens(512, seed(c_j), V)`.
* Blocks that follow the same chain c_{j-1} with different ids ("siblings") must differ at
  token 0, or a prefix match would run past the divergence. Each sibling gets a rank (the order
  in which the file first shows it under that chain), and the first k tokens of the block are
  `(offset_i(c_{j-1}) + digit_i(rank)) mod V`, with k the number of base-V digits that the
  largest rank needs. Siblings therefore always differ within their first k tokens, and at token
  0 whenever a chain has at most V successors (k = 1).

The tokens of a request are a function of the whole file (through the ranks), and importing the
same file always gives the same tokens.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa

from dualpath_ray.workload.tokens import MAX_TOKEN_SEED, check_vocab_size, expand_tokens
from dualpath_ray.workload.trace import (
    TraceError,
    Trajectory,
    list_array,
    make_table,
    table_to_trajectories,
    write_table,
)

MOONCAKE_BLOCK_TOKENS = 512
MOONCAKE_FIELDS = ("timestamp", "input_length", "output_length", "hash_ids")
_ROOT_CHAIN = hashlib.blake2b(b"dualpath-ray/mooncake-root/v1", digest_size=16).digest()


@dataclass(frozen=True)
class MooncakeRequest:
    """One validated line of a Mooncake trace (`line` is 1-based)."""

    line: int
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]

    @property
    def trajectory_id(self) -> str:
        return f"mooncake-{self.line}"


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _line_error(line: int, problem: str, field: str | None = None, fix: str | None = None) -> TraceError:
    return TraceError(problem, line=line, field=field, fix=fix)


def parse_mooncake_line(text: str, line: int) -> MooncakeRequest:
    """Parse and validate one JSON line; every problem is a TraceError naming the line."""
    try:
        record = json.loads(text)
    except json.JSONDecodeError as exc:
        raise _line_error(line, f"not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(record, dict):
        raise _line_error(line, f"expected a JSON object, got {type(record).__name__}")
    missing = [name for name in MOONCAKE_FIELDS if name not in record]
    if missing:
        raise _line_error(
            line, f"missing field(s) {missing}; a Mooncake line has {', '.join(MOONCAKE_FIELDS)}",
            field=missing[0],
        )
    timestamp = record["timestamp"]
    if isinstance(timestamp, bool) or not isinstance(timestamp, (int, float)) or not (
        math.isfinite(timestamp) and timestamp >= 0
    ):
        raise _line_error(line, f"must be a number of ms >= 0, got {timestamp!r}", "timestamp")
    for name in ("input_length", "output_length"):
        if not _is_int(record[name]) or record[name] < 1:
            raise _line_error(line, f"must be an integer >= 1, got {record[name]!r}", name)
    hash_ids = record["hash_ids"]
    if not isinstance(hash_ids, list) or not all(_is_int(h) for h in hash_ids):
        raise _line_error(line, "must be a list of integers", "hash_ids")
    blocks = -(-record["input_length"] // MOONCAKE_BLOCK_TOKENS)
    if len(hash_ids) != blocks:
        raise _line_error(
            line,
            f"has {len(hash_ids)} ids but input_length {record['input_length']} spans {blocks} "
            f"blocks of {MOONCAKE_BLOCK_TOKENS} tokens",
            "hash_ids", fix="give one hash id per 512-token block, the last one partial",
        )
    return MooncakeRequest(
        line=line,
        timestamp_ms=float(timestamp),
        input_length=record["input_length"],
        output_length=record["output_length"],
        hash_ids=tuple(hash_ids),
    )


def parse_mooncake_lines(lines: Iterable[str]) -> list[MooncakeRequest]:
    """Requests of an iterable of lines; blank lines are skipped but still counted."""
    return [
        parse_mooncake_line(text, number)
        for number, text in enumerate(lines, start=1)
        if text.strip()
    ]


def read_mooncake(path: str | Path) -> list[MooncakeRequest]:
    """Requests of a Mooncake .jsonl file; errors name the file and the line."""
    try:
        with open(path, encoding="utf-8") as handle:
            return parse_mooncake_lines(handle)
    except FileNotFoundError:
        raise TraceError("no such file", source=str(path)) from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"not UTF-8 text ({exc.reason})", source=str(path)) from None
    except OSError as exc:
        raise TraceError(f"cannot read the file ({exc.strerror})", source=str(path)) from None
    except TraceError as exc:
        raise exc.with_source(str(path)) from None


def implied_shared_prefix(a: MooncakeRequest, b: MooncakeRequest) -> int:
    """Tokens two requests share by their hash ids: 512 per common leading id, cut to length."""
    common = 0
    for x, y in zip(a.hash_ids, b.hash_ids):
        if x != y:
            break
        common += 1
    return min(common * MOONCAKE_BLOCK_TOKENS, a.input_length, b.input_length)


def _chain(parent: bytes, hash_id: int) -> bytes:
    return hashlib.blake2b(parent + str(hash_id).encode(), digest_size=16).digest()


def _seed(chain: bytes) -> int:
    return int.from_bytes(chain[:8], "little") & MAX_TOKEN_SEED


def _digits(count: int, base: int) -> int:
    """Base-`base` digits needed to write every rank below `count` (at least 1)."""
    digits = 1
    while base**digits < count:
        digits += 1
    return digits


class MooncakeTokenizer:
    """Token ids of the blocks of a set of Mooncake requests (see the module docstring)."""

    def __init__(self, requests: Sequence[MooncakeRequest], vocab_size: int) -> None:
        check_vocab_size(vocab_size)
        self.vocab_size = vocab_size
        self._ranks: dict[bytes, dict[int, int]] = {}
        for request in requests:
            parent = _ROOT_CHAIN
            for hash_id in request.hash_ids:
                siblings = self._ranks.setdefault(parent, {})
                siblings.setdefault(hash_id, len(siblings))
                parent = _chain(parent, hash_id)

    def block(self, parent: bytes, hash_id: int) -> np.ndarray:
        """The 512 token ids of the block `hash_id` that follows chain `parent`."""
        tokens = expand_tokens(MOONCAKE_BLOCK_TOKENS, _seed(_chain(parent, hash_id)), self.vocab_size)
        siblings = self._ranks[parent]
        width = min(_digits(len(siblings), self.vocab_size), MOONCAKE_BLOCK_TOKENS)
        offsets = expand_tokens(width, _seed(parent), self.vocab_size).astype(np.int64)
        rank = siblings[hash_id]
        digits = np.array([(rank // self.vocab_size**i) % self.vocab_size for i in range(width)])
        tokens[:width] = (offsets + digits) % self.vocab_size
        return tokens

    def tokens(self, request: MooncakeRequest) -> np.ndarray:
        """All input token ids of a request (int32, input_length of them)."""
        parent = _ROOT_CHAIN
        blocks = []
        for hash_id in request.hash_ids:
            blocks.append(self.block(parent, hash_id))
            parent = _chain(parent, hash_id)
        return np.concatenate(blocks)[: request.input_length]


def mooncake_table(requests: Sequence[MooncakeRequest], vocab_size: int) -> pa.Table:
    """A trace table with one one-turn trajectory per request, arriving at timestamp / 1000 s."""
    tokenizer = MooncakeTokenizer(requests, vocab_size)
    lengths = [request.input_length for request in requests]
    return make_table(
        {
            "trajectory_id": [request.trajectory_id for request in requests],
            "turn": [0] * len(requests),
            "appended": list_array([tokenizer.tokens(r) for r in requests], lengths),
            "appended_len": lengths,
            "gen_len": [request.output_length for request in requests],
            "tool_latency_s": [0.0] * len(requests),
            "arrival_s": [request.timestamp_ms / 1000.0 for request in requests],
        }
    )


def import_mooncake(path: str | Path, vocab_size: int) -> list[Trajectory]:
    """The requests of a Mooncake .jsonl file as one-turn trajectories."""
    return table_to_trajectories(mooncake_table(read_mooncake(path), vocab_size), vocab_size)


def convert_mooncake(in_path: str | Path, out_path: str | Path, vocab_size: int) -> pa.Table:
    """Convert a Mooncake .jsonl file to a Parquet trace; returns the written table."""
    table = mooncake_table(read_mooncake(in_path), vocab_size)
    write_table(table, out_path)
    return table
