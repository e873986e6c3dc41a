"""Mooncake trace import: reuse implied by hash ids is exactly the reuse the prefix index sees."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from dualpath_ray.kv.index import PrefixIndex, block_keys, namespace_for
from dualpath_ray.workload.mooncake import (
    MOONCAKE_BLOCK_TOKENS,
    MooncakeTokenizer,
    convert_mooncake,
    import_mooncake,
    parse_mooncake_lines,
    read_mooncake,
)
from dualpath_ray.workload.trace import TraceError, read_trace

BLOCK = 64
VOCAB = 512
NAMESPACE = namespace_for("dualpath-tiny", 0)


def _record(ids: list[int], length: int, timestamp: int, output: int = 7) -> dict[str, object]:
    return {"timestamp": timestamp, "input_length": length, "output_length": output, "hash_ids": ids}


def _length_for(blocks: int, rng: np.random.Generator) -> int:
    return int(rng.integers(MOONCAKE_BLOCK_TOKENS * (blocks - 1) + 1, MOONCAKE_BLOCK_TOKENS * blocks + 1))


def _overlapping_records(n: int, seed: int) -> list[dict[str, object]]:
    """Requests that share prefixes with earlier ones at random depths (known overlaps)."""
    rng = np.random.default_rng(seed)
    records: list[dict[str, object]] = []
    fresh = iter(range(10_000, 1_000_000))
    system_prompt = [1, 2]
    for i in range(n):
        if records and rng.random() < 0.7:
            base = records[int(rng.integers(len(records)))]["hash_ids"]
            ids = list(base[: int(rng.integers(0, len(base) + 1))])
        else:
            ids = list(system_prompt[: int(rng.integers(0, 3))])
        ids += [next(fresh) for _ in range(int(rng.integers(0 if ids else 1, 5)))]
        records.append(_record(ids, _length_for(len(ids), rng), timestamp=1000 * i + 17))
    first = records[0]["hash_ids"]
    reordered = list(reversed(first)) if len(first) > 1 else [first[0], 77]
    records.append(_record(reordered, _length_for(len(reordered), rng), timestamp=1000 * n))
    records.append(dict(records[3], timestamp=1000 * n + 1))
    return records


def _write(path: Path, records: list[dict[str, object]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def _shared_tokens(a: dict[str, object], b: dict[str, object]) -> int:
    common = 0
    for x, y in zip(a["hash_ids"], b["hash_ids"]):
        if x != y:
            break
        common += 1
    return min(common * MOONCAKE_BLOCK_TOKENS, a["input_length"], b["input_length"])


def _common_prefix(x: tuple[int, ...], y: tuple[int, ...]) -> int:
    n = min(len(x), len(y))
    differ = np.flatnonzero(np.asarray(x[:n]) != np.asarray(y[:n]))
    return int(differ[0]) if differ.size else n


def test_index_hits_equal_the_reuse_the_hash_ids_imply(tmp_path: Path) -> None:
    records = _overlapping_records(70, seed=5)
    trajectories = import_mooncake(_write(tmp_path / "m.jsonl", records), VOCAB)
    index = PrefixIndex(BLOCK)
    hits = 0
    for r, trajectory in enumerate(trajectories):
        prompt = trajectory.turns[0].appended
        shared = max((_shared_tokens(records[r], records[q]) for q in range(r)), default=0)
        expected = BLOCK * (shared // BLOCK)
        hit = index.match(prompt, NAMESPACE)
        assert hit.hit_tokens == expected, (
            f"request {r}: the index must hit exactly the implied shared prefix rounded down "
            f"to full blocks ({expected}), got {hit.hit_tokens}"
        )
        index.insert(block_keys(prompt, BLOCK, NAMESPACE))
        hits += expected > 0
    assert hits > len(records) // 2, "most requests of the generated file reuse an earlier prefix"
    assert any(
        _shared_tokens(records[r], records[q]) % BLOCK and _shared_tokens(records[r], records[q])
        for r in range(len(records)) for q in range(r)
    ), "the generated file exercises shared prefixes that end inside a 64-token block"


@pytest.mark.parametrize("vocab_size", [VOCAB, 32])
def test_token_prefixes_are_exactly_the_implied_ones(tmp_path: Path, vocab_size: int) -> None:
    # The file has a block with 20 successors: over 32 ids, random first tokens would collide
    # almost surely, so vocab 32 checks the sibling ranks, not luck.
    records = _overlapping_records(50, seed=11)
    trajectories = import_mooncake(_write(tmp_path / "m.jsonl", records), vocab_size)
    prompts = [t.turns[0].appended for t in trajectories]
    for r in range(len(records)):
        assert len(prompts[r]) == records[r]["input_length"], "a prompt has input_length tokens"
        for q in range(r):
            assert _common_prefix(prompts[r], prompts[q]) == _shared_tokens(records[r], records[q]), (
                f"requests {q} and {r} share exactly their implied prefix and not one token more"
            )


def test_more_siblings_than_vocabulary_still_diverge_early() -> None:
    lines = [json.dumps(_record([h, 1], 600, 0)) for h in range(10)]
    requests = parse_mooncake_lines(lines)
    tokenizer = MooncakeTokenizer(requests, vocab_size=4)
    prompts = [tuple(tokenizer.tokens(r).tolist()) for r in requests]
    for a in range(10):
        for b in range(a):
            assert _common_prefix(prompts[a], prompts[b]) < 2, (
                "10 siblings over a 4-token vocabulary differ within their first 2 tokens"
            )
    assert len({p[0] for p in prompts[:4]}) == 4, "the first 4 siblings differ at token 0"


def test_fields_become_one_turn_trajectories(tmp_path: Path) -> None:
    lines = [
        json.dumps(_record(list(range(14)), 6955, 27482, output=52)),
        "",
        json.dumps(_record([0, 1], 600, 30000, output=3)),
    ]
    path = tmp_path / "m.jsonl"
    path.write_text("\n".join(lines) + "\n")
    first, second = import_mooncake(path, VOCAB)
    assert (first.trajectory_id, second.trajectory_id) == ("mooncake-1", "mooncake-3"), (
        "trajectory ids carry the source line number (blank lines still count)"
    )
    assert first.arrival_s == pytest.approx(27.482), "arrival is timestamp / 1000 seconds"
    assert len(first.turns) == 1 and first.turns[0].gen_len == 52, "one turn, gen = output_length"
    assert len(first.turns[0].appended) == 6955, "the prompt has input_length tokens"
    assert _common_prefix(first.turns[0].appended, second.turns[0].appended) == 600, (
        "two leading ids in common, the second request cut at 600 tokens"
    )


def test_parquet_conversion_round_trips(tmp_path: Path) -> None:
    source = _write(tmp_path / "m.jsonl", _overlapping_records(12, seed=2))
    convert_mooncake(source, tmp_path / "m.parquet", VOCAB)
    assert read_trace(tmp_path / "m.parquet", VOCAB) == import_mooncake(source, VOCAB), (
        "the Parquet trace holds the same trajectories as a direct import"
    )
    assert import_mooncake(source, VOCAB) == import_mooncake(source, VOCAB), "import is deterministic"


_GOOD = json.dumps(_record([1, 2], 1000, 5))


@pytest.mark.parametrize(
    ("bad", "field", "words"),
    [
        ('{"timestamp": 1, "input_length": ', None, "not valid JSON"),
        ("[1, 2]", None, "expected a JSON object"),
        (json.dumps({"timestamp": 1, "input_length": 10, "output_length": 1}), "hash_ids", "missing"),
        (json.dumps(_record([1], -5, 1)), "input_length", ">= 1"),
        (json.dumps(_record([1], 10, 1, output=-1)), "output_length", ">= 1"),
        (json.dumps(_record([1], 10, -3)), "timestamp", ">= 0"),
        (json.dumps(_record([1, 2, 3], 1000, 1)), "hash_ids", "spans 2 blocks"),
        (json.dumps(_record([1], 1025, 1)), "hash_ids", "spans 3 blocks"),
        (json.dumps(dict(_record([1], 10, 1), hash_ids="abc")), "hash_ids", "list of integers"),
        (json.dumps(dict(_record([1], 10, 1), timestamp=True)), "timestamp", "number"),
    ],
)
def test_malformed_lines_name_their_line(tmp_path: Path, bad: str, field: str | None, words: str) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text("\n".join([_GOOD, _GOOD, bad, _GOOD]) + "\n")
    with pytest.raises(TraceError) as info:
        read_mooncake(path)
    assert info.value.line == 3 and "line 3" in str(info.value), (
        f"the error names the malformed line, got {info.value}"
    )
    assert info.value.field == field, f"the error names the bad field {field}"
    assert words in str(info.value) and str(path) in str(info.value), (
        f"the message explains the problem ({words!r}) and names the file: {info.value}"
    )
